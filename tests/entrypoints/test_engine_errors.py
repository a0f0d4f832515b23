"""Bad input gets a clear error and the engine keeps serving."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine
from radixserve.core.plugins import PluginError
from radixserve.core.request import InvalidRequest
from radixserve.entrypoints.engine import EngineDeadError


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path):
    eng = Engine(str(tiny_llama_dir), max_total_tokens=4096)
    yield eng
    eng.shutdown()


def _still_serving(engine: Engine) -> None:
    out = engine.generate("Hello", {"max_new_tokens": 3, "ignore_eos": True})
    assert len(out["output_ids"]) == 3
    engine.core.scheduler.check_no_leak()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, "prompt is empty"),
        ({"input_ids": []}, "prompt is empty"),
        (
            {"prompt": "Hi", "sampling_params": {"max_new_tokens": -1}},
            "max_new_tokens must be >= 0",
        ),
        ({"prompt": "Hi", "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"prompt": "Hi", "sampling_params": {"top_p": 1.5}}, "top_p must be in"),
        ({"prompt": "Hi", "sampling_params": {"temperature": -1}}, "temperature must be in"),
        ({"prompt": "Hi", "sampling_params": {"top_k": 0}}, "top_k must be -1"),
        ({"prompt": "Hi", "sampling_params": {"n": 0}}, "n must be >= 1"),
        ({"prompt": "Hi", "sampling_params": {"bogus": 1}}, "unknown sampling parameter 'bogus'"),
        ({"prompt": "Hi", "sampling_params": {"stop": [""]}}, "stop must be"),
        ({"input_ids": [1, 2, 10**9]}, "is outside the vocabulary"),
        ({"input_ids": ["a"]}, "integer token ids"),
    ],
)
def test_bad_request_is_rejected_clearly(engine: Engine, kwargs, message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        engine.generate(**kwargs)
    assert message in str(err.value)
    _still_serving(engine)


def test_prompt_longer_than_context(engine: Engine) -> None:
    context = engine.core.max_context
    with pytest.raises(InvalidRequest, match=f"context length is {context}"):
        engine.generate(input_ids=[5] * (context + 10))
    _still_serving(engine)


def test_unknown_plugin_name_stops_startup_with_one_line(tiny_llama_dir: Path) -> None:
    with pytest.raises(PluginError) as err:
        Engine(str(tiny_llama_dir), plugins=["attention=flashy"], max_total_tokens=256)
    msg = str(err.value)
    assert "\n" not in msg
    assert "unknown attention plugin 'flashy'" in msg and "torch_native" in msg


def test_unknown_plugin_kind(tiny_llama_dir: Path) -> None:
    with pytest.raises(PluginError, match="unknown plugin kind 'attn'"):
        Engine(str(tiny_llama_dir), plugins=["attn=torch_native"], max_total_tokens=256)


def test_bad_model_path(tmp_path: Path) -> None:
    from radixserve.core.config import ConfigError

    with pytest.raises(ConfigError, match="not a model directory"):
        Engine(str(tmp_path / "missing"))


def test_a_failing_loop_answers_the_requests_queued_behind_its_step(tiny_llama_dir: Path) -> None:
    """A request submitted while the failing step runs sits in the inbox the loop never reads
    again: it must end with the loop's error, not leave its caller waiting forever."""
    eng = Engine(str(tiny_llama_dir), max_total_tokens=512)
    entered, release = threading.Event(), threading.Event()

    def failing_step() -> list[Any]:
        entered.set()
        release.wait()  # the test decides when the step fails
        raise RuntimeError("simulated device error")

    eng.core.step = failing_step  # type: ignore[method-assign]
    results: dict[str, Any] = {}

    def call(tag: str) -> None:
        try:
            results[tag] = eng.generate("hello", {"max_new_tokens": 4})
        except Exception as e:  # noqa: BLE001 - the outcome is asserted below
            results[tag] = e

    first = threading.Thread(target=call, args=("first",), daemon=True)
    first.start()
    assert entered.wait(120)
    queued = threading.Thread(target=call, args=("queued",), daemon=True)
    queued.start()
    for _ in range(12_000):  # until its request is in the inbox (at most 60 s)
        if eng._inbox.qsize():
            break
        time.sleep(0.005)
    release.set()
    first.join(120)
    queued.join(120)
    assert not first.is_alive() and not queued.is_alive(), "a caller still waits"
    for tag in ("first", "queued"):
        assert isinstance(results[tag], EngineDeadError), results[tag]
        assert "simulated device error" in str(results[tag])
    with pytest.raises(EngineDeadError, match="simulated device error"):
        eng.flush_cache()
    eng.shutdown()


def test_flush_cache_after_shutdown_raises_instead_of_waiting(tiny_llama_dir: Path) -> None:
    eng = Engine(str(tiny_llama_dir), max_total_tokens=256)
    assert eng.flush_cache() is True
    eng.shutdown()
    outcome: list[Any] = []

    def flush() -> None:
        try:
            outcome.append(eng.flush_cache())
        except EngineDeadError as e:
            outcome.append(e)

    t = threading.Thread(target=flush, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and isinstance(outcome[0], EngineDeadError)


def test_the_item_the_loop_fails_on_is_answered_too(tiny_llama_dir: Path) -> None:
    """A flush whose own handling fails was taken from the inbox already: it must still get an
    answer (False), and later calls an EngineDeadError, not a wait."""
    eng = Engine(str(tiny_llama_dir), max_total_tokens=256)

    def failing_flush() -> bool:
        raise RuntimeError("simulated flush failure")

    eng.core.flush_cache = failing_flush  # type: ignore[method-assign]
    outcome: list[Any] = []
    t = threading.Thread(target=lambda: outcome.append(eng.flush_cache()), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and outcome == [False]
    with pytest.raises(EngineDeadError, match="simulated flush failure"):
        eng.generate("hello", {"max_new_tokens": 2})
    eng.shutdown()
