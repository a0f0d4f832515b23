"""The offline Engine builds its EngineCore on the loop's own thread and steps it there: the
caller's thread runs none of the engine's torch work. torch's CPU kernels parallelize through
OpenMP, and libgomp keeps a worker pool per thread that starts parallel work; a core built on
the caller's thread left a second pool beside the loop's, more OpenMP threads than cores, and
libgomp then woke its workers through the kernel for every kernel: batch-1 decode steps took
twice as long as the server engine's (entrypoints/engine.py, ``_run_engine_thread``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.core.hookspecs import hookimpl
from radixserve.core.plugins import PluginError, PluginHost


class ThreadRecorder:
    """Which threads announced the built engine and finished its steps."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.steps: set[int] = set()

    @hookimpl
    def engine_started(self, info: dict[str, Any]) -> None:
        self.started.append(threading.get_ident())

    @hookimpl
    def step_finished(self, stats: dict[str, Any]) -> None:
        self.steps.add(threading.get_ident())


def test_engine_is_built_and_stepped_on_its_loop_thread(tiny_llama_dir: Path) -> None:
    recorder = ThreadRecorder()
    host = PluginHost(extra_plugins=[("threads", recorder)])
    forwards: set[int] = set()
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: forwards.add(threading.get_ident())
    )
    try:
        with Engine(str(tiny_llama_dir), host=host, max_total_tokens=4096) as engine:
            out = engine.generate("Hello", {"max_new_tokens": 4, "ignore_eos": True})
            loop = engine._thread.ident
    finally:
        hook.remove()
    assert len(out["output_ids"]) == 4
    assert loop is not None and loop != threading.get_ident()
    assert recorder.started == [loop]  # built there
    assert recorder.steps == {loop}  # stepped there
    assert forwards == {loop}  # and no model forward ran on the caller's thread


def test_a_build_error_reaches_the_caller_and_ends_the_loop_thread(tiny_llama_dir: Path) -> None:
    before = set(threading.enumerate())
    with pytest.raises(PluginError, match="no_such_backend"):
        Engine(str(tiny_llama_dir), max_total_tokens=4096, plugins=["attention=no_such_backend"])
    assert not [
        t for t in threading.enumerate() if t not in before and t.name == "radixserve-engine"
    ]
