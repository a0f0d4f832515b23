"""The garbage-collection timer that /server_info reports for each server process."""

from __future__ import annotations

import gc

import pytest

from radixserve.entrypoints.gc_timer import (
    GC_FREEZE_ENV,
    GcTimer,
    freeze_if_asked,
    process_gc_timer,
)


def test_collections_are_counted_and_timed_per_generation() -> None:
    timer = GcTimer()
    try:
        gc.collect(0)
        gc.collect(2)
        out = timer.to_json()
        assert out["collections"][0] >= 1 and out["collections"][2] >= 1
        assert out["seconds"][2] > 0 and len(out["seconds"]) == 3
    finally:
        gc.callbacks.remove(timer._callback)


def test_one_hook_per_process() -> None:
    assert process_gc_timer() is process_gc_timer()
    hooks = [cb for cb in gc.callbacks if getattr(cb, "__self__", None) is process_gc_timer()]
    assert len(hooks) == 1


def test_freeze_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GC_FREEZE_ENV, raising=False)
    assert freeze_if_asked() is False
    monkeypatch.setenv(GC_FREEZE_ENV, "1")
    try:
        assert freeze_if_asked() is True and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
