"""@function programs name a LoRA adapter: gen(lora_path=...) or run(lora_path=...) reach the
engine (EngineBackend in process, over a tiny random model) and the native /generate body."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_adapters import make_adapter

from radixserve.entrypoints.engine import Engine
from radixserve.lang import EngineBackend, function, gen
from radixserve.lang.backends.native import generate_body
from radixserve.lang.sampling import SamplingOptions

PROMPT = "Say hi " * 4


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = make_adapter(tiny_llama_dir, tmp_path_factory.mktemp("lang-lora") / "a", 8, 1, scale=4)
    with Engine(str(tiny_llama_dir), max_total_tokens=4096, lora_paths=[f"a={path}"]) as eng:
        yield eng


@function
def said(s, adapter):
    s += PROMPT
    s += gen("g", max_tokens=6, temperature=0, ignore_eos=True, lora_path=adapter)


@function
def plain(s):
    s += PROMPT
    s += gen("g", max_tokens=6, temperature=0, ignore_eos=True)


def test_programs_name_the_adapter(engine: Engine) -> None:
    backend = EngineBackend(engine)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with_a = engine.generate(PROMPT, params, lora_path="a")["text"]
    base = engine.generate(PROMPT, params)["text"]
    assert with_a != base
    assert said.run("a", backend=backend)["g"] == with_a
    assert said.run(None, backend=backend)["g"] == base
    assert plain.run(backend=backend, lora_path="a")["g"] == with_a  # the run's default


def test_native_body_carries_lora_path() -> None:
    body = generate_body("x", SamplingOptions(max_new_tokens=2, lora_path="a"))
    assert body["lora_path"] == "a" and "lora_path" not in body["sampling_params"]


def test_engine_loads_and_unloads_adapters(engine: Engine, tmp_path: Path) -> None:
    from radixserve.core.request import InvalidRequest

    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    base = engine.generate(PROMPT, params)["output_ids"]
    reply = engine.load_lora_adapter("b", str(engine_adapter_path(engine)))
    assert reply["success"] and set(reply["loaded_adapters"]) == {"a", "b"}
    assert engine.generate(PROMPT, params, lora_path="b")["output_ids"] != base
    bad = engine.load_lora_adapter("c", str(tmp_path))
    assert not bad["success"] and "not a PEFT adapter directory" in bad["error_message"]
    assert engine.unload_lora_adapter("b")["success"]
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'b'"):
        engine.generate(PROMPT, params, lora_path="b")


def engine_adapter_path(engine: Engine) -> str:
    """The path adapter 'a' was loaded from (loaded again under another name)."""
    from radixserve.core.lora_strategy import lora_of

    lora = lora_of(engine.core)
    assert lora is not None
    return lora.names()["a"]
