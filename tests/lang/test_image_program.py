"""The frontend's image(path) on a tiny random Qwen2-VL, in process (EngineBackend): the
chat template's image token goes in the text and the image beside it, so a program's gen
equals Engine.generate on the same text and image; select scores with the image too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from platform_choice import CPU
from tiny_vlm import make_tiny_qwen2_vl_dir, png

from radixserve.entrypoints.engine import Engine
from radixserve.lang import (
    EngineBackend,
    assistant,
    function,
    gen,
    image,
    select,
    user,
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model = make_tiny_qwen2_vl_dir(tmp_path_factory.mktemp("qwen2_vl_lang"))
    with Engine(str(model), plugins=[CPU], dtype="float32", max_total_tokens=2048) as eng:
        yield eng


@function
def describe(s, path):
    s += user(image(path) + "What is it?")
    s += assistant(gen("answer", max_tokens=5, temperature=0))


@function
def pick(s, path):
    s += user(image(path) + "Fox or dog?")
    s += assistant(select("animal", ["fox", "dog"]))


def test_image_program_equals_engine_generate(engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "noise.png"
    path.write_bytes(png(36, 28, 31))
    backend = EngineBackend(engine)
    assert backend.chat_template.name == "qwen2-vl"
    state = describe.run(str(path), backend=backend)
    answer = state["answer"]
    text = state.text()
    assert text.count("<|image_pad|>") == 1
    prompt = text[: len(text) - len(answer) - len("<|im_end|>\n")]
    direct = engine.generate(
        prompt, {"max_new_tokens": 5, "temperature": 0}, image_data=[str(path)]
    )
    assert answer == direct["text"]
    # the same program with another image runs on that image (a different prompt for the model)
    assert pick.run(str(path), backend=backend)["animal"] in ("fox", "dog")
