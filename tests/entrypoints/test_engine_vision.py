"""Images in, text out through the offline Engine on a tiny random Qwen2-VL and Qwen2.5-VL
(windowed vision attention) saved with transformers: greedy outputs and logprobs equal
transformers' (float32) with one and two images of different sizes, batched with text-only
prompts, prefilled in chunks that end inside an image; the radix cache and the encoder cache
reuse a repeated image; bad images and text-only models are refused with clear messages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from platform_choice import CPU
from tiny_vlm import (
    llava_reference_logprobs,
    load_reference,
    make_tiny_llava_dir,
    make_tiny_qwen2_vl_dir,
    png,
    reference_logprobs,
)

from radixserve import Engine
from radixserve.core.multimodal_strategy import multimodal_of
from radixserve.core.request import InvalidRequest

NEW = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


#: the M-RoPE families; the tests of the tokenizer side (shared by both) run on the first only
FAMILIES = ["qwen2_vl", "qwen2_5_vl"]
TOKENIZER_SIDE = pytest.mark.parametrize("vl_dir", FAMILIES[:1], indirect=True)


@pytest.fixture(scope="module", params=FAMILIES)
def vl_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return make_tiny_qwen2_vl_dir(tmp_path_factory.mktemp(family), family=family)


@pytest.fixture(scope="module")
def engine(vl_dir: Path) -> Iterator[Engine]:
    # chunks of 16 tokens: a 20-token image span is always cut between two chunks
    with Engine(str(vl_dir), plugins=[CPU], dtype="float32", chunked_prefill_size=16,
                max_total_tokens=4096) as eng:  # fmt: skip
        yield eng


@pytest.fixture(scope="module")
def reference(vl_dir: Path) -> Any:
    return load_reference(vl_dir)


def check_equal(reference: Any, engine: Engine, prompt: str, images: list[bytes],
                result: dict[str, Any]) -> None:  # fmt: skip
    output = result["output_ids"]
    assert len(output) == NEW
    ref = reference_logprobs(reference, engine.tokenizer.encode(prompt), images, output)
    assert ref.argmax(-1).tolist() == output
    ours = torch.tensor([t[0] for t in result["meta_info"]["output_token_logprobs"]])
    theirs = ref[torch.arange(NEW), torch.tensor(output)]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


ONE = f"Hello {IMAGE} the quick brown fox"
TWO = f"{IMAGE} and {IMAGE} Hello world"


def test_one_image_matches_transformers(engine: Engine, reference: Any) -> None:
    images = [png(30, 40, 1)]
    result = engine.generate(ONE, GREEDY, image_data=images, return_logprob=True)
    check_equal(reference, engine, ONE, images, result)


def test_two_images_of_different_sizes_batched_with_text(engine: Engine, reference: Any) -> None:
    two = [png(50, 20, 2), png(24, 36, 3)]
    prompts = [TWO, "def add(a, b): return", ONE]
    images: list[Any] = [two, None, [png(40, 40, 4)]]
    results = engine.generate(prompts, GREEDY, image_data=images, return_logprob=True)
    for prompt, imgs, result in zip(prompts, images, results, strict=True):
        check_equal(reference, engine, prompt, imgs or [], result)


def test_repeated_image_is_a_cache_hit_and_not_encoded_again(engine: Engine) -> None:
    assert engine.flush_cache()
    strategy = multimodal_of(engine.core)
    assert strategy is not None
    image = png(32, 32, 7)
    first = engine.generate(ONE, GREEDY, image_data=[image])
    encoded = strategy.images_encoded
    second = engine.generate(ONE, GREEDY, image_data=[image])
    assert second["output_ids"] == first["output_ids"]
    # everything but the last prompt token: the image span (16 tokens after 'Hello ' and
    # vision_start) included
    assert second["meta_info"]["cached_tokens"] == second["meta_info"]["prompt_tokens"] - 1
    assert strategy.images_encoded == encoded
    # another image of the same size: the prefix up to the image only, and encoded
    other = engine.generate(ONE, GREEDY, image_data=[png(32, 32, 8)])
    prefix = len(engine.tokenizer.encode(ONE.split("<|image_pad|>")[0]))
    assert other["meta_info"]["cached_tokens"] == prefix
    assert strategy.images_encoded == encoded + 1


@TOKENIZER_SIDE
def test_bad_images_are_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="not a decodable image"):
        engine.generate(ONE, GREEDY, image_data=[b"\x89PNG not really"])
    with pytest.raises(InvalidRequest, match="2 images"):
        engine.generate(ONE, GREEDY, image_data=[png(8, 8, 1), png(8, 8, 2)])
    with pytest.raises(InvalidRequest, match="max-images-per-request"):
        engine.generate(ONE, GREEDY, image_data=[png(8, 8, 1)] * 9)
    with pytest.raises(InvalidRequest, match="no such file"):
        engine.generate(ONE, GREEDY, image_data=["/nonexistent/cat.png"])
    with pytest.raises(InvalidRequest, match="allow-remote-media"):
        engine.generate(ONE, GREEDY, image_data=["http://127.0.0.1:9/cat.png"])
    with pytest.raises(InvalidRequest, match="scores image tokens"):
        engine.generate(ONE, GREEDY, image_data=[png(8, 8, 1)], return_logprob=True,
                        logprob_start_len=0)  # fmt: skip
    # prompt logprobs after the image are fine
    n = engine.generate(ONE, GREEDY, image_data=[png(16, 16, 1)])["meta_info"]["prompt_tokens"]
    after = engine.generate(ONE, GREEDY, image_data=[png(16, 16, 1)], return_logprob=True,
                            logprob_start_len=n - 3)  # fmt: skip
    assert len(after["meta_info"]["input_token_logprobs"]) == 3


@TOKENIZER_SIDE
def test_file_path_and_data_url_inputs(engine: Engine, tmp_path: Path) -> None:
    import base64

    image = png(28, 28, 11)
    path = tmp_path / "cat.png"
    path.write_bytes(image)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    by_bytes = engine.generate(ONE, GREEDY, image_data=[image])["output_ids"]
    assert engine.generate(ONE, GREEDY, image_data=[str(path)])["output_ids"] == by_bytes
    assert engine.generate(ONE, GREEDY, image_data=[url])["output_ids"] == by_bytes


def test_text_only_model_refuses_images(tiny_llama_dir: Path) -> None:
    with Engine(str(tiny_llama_dir), plugins=[CPU], max_total_tokens=1024) as eng:
        with pytest.raises(InvalidRequest, match="LlamaForCausalLM takes text only"):
            eng.generate("Hello", GREEDY, image_data=[png(8, 8, 1)])


def test_llava_two_images_batched_with_text_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = make_tiny_llava_dir(tmp_path_factory.mktemp("llava"))
    prompts = ["Hello <image> the quick <image> brown fox", "def add(a, b): return"]
    images: list[Any] = [[png(40, 30, 1), png(20, 50, 2)], None]
    # chunks of 16 tokens: each 16-token image span straddles two chunks
    with Engine(str(model), plugins=[CPU], dtype="float32", chunked_prefill_size=16,
                max_total_tokens=2048) as eng:  # fmt: skip
        results = eng.generate(prompts, GREEDY, image_data=images, return_logprob=True)
        for prompt, imgs, result in zip(prompts, images, results, strict=True):
            output = result["output_ids"]
            ids = eng.tokenizer.encode(prompt)
            ref = llava_reference_logprobs(model, ids, imgs or [], output)
            assert ref.argmax(-1).tolist() == output
            ours = torch.tensor([t[0] for t in result["meta_info"]["output_token_logprobs"]])
            theirs = ref[torch.arange(NEW), torch.tensor(output)]
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
