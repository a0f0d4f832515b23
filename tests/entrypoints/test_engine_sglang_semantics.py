"""The offline Engine follows the server's (and SGLang's) rules, from the same code: seeded n>1
choices get distinct seeds, streamed text is never taken back at a stop string, sampling params
may be a list of one per prompt, and shutdown() frees device memory for the next Engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from inprocess_plugins import DeviceMemory, Stepper

from radixserve import Engine, SamplingParams
from radixserve.core.plugins import PluginHost
from radixserve.core.request import InvalidRequest
from radixserve.entrypoints.engine import EngineDeadError
from radixserve.entrypoints.fanout import choice_params

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    with Engine(str(tiny_llama_dir), max_total_tokens=8192) as eng:
        yield eng


def test_seeded_n_gives_distinct_choices_seeded_as_the_server_seeds_them(engine: Engine) -> None:
    params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 1.0, "seed": 11, "n": 3}
    outs = engine.generate(PROMPT, params)
    assert len({tuple(o["output_ids"]) for o in outs}) == 3, [o["output_ids"] for o in outs]
    again = engine.generate(PROMPT, params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    base = SamplingParams.from_dict(params)
    for i, out in enumerate(outs):
        alone = engine.generate(PROMPT, {**params, "n": 1, "seed": choice_params(base, i).seed})
        assert out["output_ids"] == alone["output_ids"], i


def test_sampling_params_list_gives_one_per_prompt(engine: Engine) -> None:
    short = {"max_new_tokens": 3, **GREEDY}
    pair = {"max_new_tokens": 5, "n": 2, **GREEDY}
    outs = engine.generate([PROMPT, "Hello world"], [short, pair])
    assert [len(o["output_ids"]) for o in outs] == [3, 5, 5]
    assert outs[1]["output_ids"] == engine.generate("Hello world", pair)[0]["output_ids"]
    by_ids = engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=[short, short])
    assert [len(o["output_ids"]) for o in by_ids] == [3, 3]
    same = engine.generate([PROMPT, "Hello world"], {"max_new_tokens": 4, **GREEDY})
    assert [len(o["output_ids"]) for o in same] == [4, 4]  # one dict applies to every prompt
    with pytest.raises(InvalidRequest, match="sampling_params has 3 entries for a batch of 2"):
        engine.generate([PROMPT, "Hello world"], [short, short, short])
    with pytest.raises(InvalidRequest, match="sampling_params has 2 entries for a batch of 1"):
        engine.generate(PROMPT, [short, short])


def _stepped(engine: Engine, stepper: Stepper, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Stream with the engine held between steps: each chunk is what one step made visible."""
    chunks = []
    stepper.allow()  # the prefill
    for chunk in engine.generate(PROMPT, params, stream=True):
        chunks.append(chunk)
        stepper.allow()
    stepper.drain()
    return chunks


def _straddling_stop(head: str, tail: str) -> str | None:
    """A stop string that starts at the last character of one step's text ``head`` and ends in
    the next step's ``tail``: after the first step its start is visible, and the stop (first
    found there) later cuts it. None when these two steps give none."""
    stop = tail[len(head) - 1 :]
    whole_chars = stop.isprintable() and "\ufffd" not in stop  # no partial UTF-8
    if head and tail.startswith(head) and len(stop) > 1 and whole_chars:
        return stop if tail.find(stop) == len(head) - 1 else None
    return None


def test_streamed_text_is_never_taken_back_at_a_stop_string(tiny_llama_dir: Path) -> None:
    stepper = Stepper()
    host = PluginHost(extra_plugins=[("stepper", stepper)])
    # the CPU platform: a CUDA graph would replay steps without the gate's Python forward
    plugins = ["model=SteppedLlama", "hardware=cpu"]
    settings: dict[str, Any] = {"max_total_tokens": 4096, "plugins": plugins}
    with Engine(str(tiny_llama_dir), host=host, **settings) as engine:
        plain = [c["text"] for c in _stepped(engine, stepper, {"max_new_tokens": 24, **GREEDY})]
        k = next(k for k in range(len(plain) - 1) if _straddling_stop(plain[k], plain[k + 1]))
        stop, cut = _straddling_stop(plain[k], plain[k + 1]), len(plain[k]) - 1
        assert stop is not None
        params = {"max_new_tokens": 24, "stop": [stop], **GREEDY}
        chunks = _stepped(engine, stepper, params)
        stepper.allow(64)
        whole = engine.generate(PROMPT, params)
        stepper.drain()
    texts = [c["text"] for c in chunks]
    assert whole["text"] == plain[k][:cut]
    assert whole["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    pairs = list(zip(texts, texts[1:], strict=False))
    for before, after in pairs:
        assert after.startswith(before), (before, after, stop)  # nothing taken back
    deltas = [texts[0], *(after[len(before) :] for before, after in pairs)]
    assert "".join(deltas) == texts[-1] == whole["text"]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "draft-model"])
def test_shutdown_frees_device_memory_for_a_second_engine(
    tiny_llama_dir: Path, speculative: bool
) -> None:
    """On a device whose KV pool is sized from free memory (the CUDA rule), the first engine's
    pool takes the budget; after its shutdown() a second engine gets the same pool, although
    the caller still holds the first Engine object. With a draft model, its own KV pool is
    freed too (on the H200 an EAGLE-3 engine kept 128 GiB until the Engine was dropped)."""
    memory = DeviceMemory(capacity=256 << 20)
    host = PluginHost(extra_plugins=[("device_memory", memory)])
    settings: dict[str, Any] = {"plugins": ["hardware=metered_cpu"]}
    if speculative:
        settings |= {"speculative_algorithm": "STANDALONE",
                     "speculative_draft_model_path": str(tiny_llama_dir),
                     "speculative_disable_batch_size": 64}  # fmt: skip
    params = {"max_new_tokens": 6, **GREEDY}
    first = Engine(str(tiny_llama_dir), host=host, **settings)
    kv_size = first.core.runner.kv_size
    assert kv_size > 10_000  # the budget, not a cap
    out = first.generate(PROMPT, params)
    first.shutdown()
    first.shutdown()  # again: nothing to do
    with Engine(str(tiny_llama_dir), host=host, **settings) as second:
        assert second.core.runner.kv_size == kv_size
        assert second.generate(PROMPT, params)["output_ids"] == out["output_ids"]
    assert memory.live == 0 and memory.cached == 0  # freed, and given back to the device
    with pytest.raises(EngineDeadError, match="shut down"):
        first.generate(PROMPT, params)
