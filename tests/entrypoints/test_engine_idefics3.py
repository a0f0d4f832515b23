"""Idefics3 / SmolVLM through the offline Engine on a tiny random model saved with transformers:
images split into tiles plus the global image, the prompt expanded as transformers' processor
does, greedy outputs and logprobs equal transformers' (float32) with one and two images of
different sizes, batched with a text-only prompt and prefilled in chunks that end inside tiles;
a repeated image is a radix hit over all its tiles and is not encoded again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from platform_choice import CPU
from tiny_vlm import idefics3_reference_logprobs, make_tiny_idefics3_dir, png

from radixserve import Engine
from radixserve.core.multimodal_strategy import multimodal_of

NEW = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW}
ONE = "Hello <image> the quick brown fox"
TWO = "<image> and <image> Hello world"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3_dir(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Engine]:
    # chunks of 16 tokens: the 16-token runs of a tile's image tokens are cut between chunks
    with Engine(str(model_dir), plugins=[CPU], dtype="float32", chunked_prefill_size=16,
                max_total_tokens=4096) as eng:  # fmt: skip
        yield eng


def check_equal(model_dir: Path, prompt: str, images: list[bytes], result: dict[str, Any]) -> None:
    output = result["output_ids"]
    assert len(output) == NEW
    ref = idefics3_reference_logprobs(model_dir, prompt, images, output)
    assert ref.argmax(-1).tolist() == output
    ours = torch.tensor([t[0] for t in result["meta_info"]["output_token_logprobs"]])
    theirs = ref[torch.arange(NEW), torch.tensor(output)]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_tiled_images_batched_with_text_match_transformers(engine: Engine, model_dir: Path) -> None:
    # 40x40: 2x2 tiles + global (80 image tokens); 60x20: 1x2 + global; 24x36: 2x2 + global
    prompts = [ONE, TWO, "def add(a, b): return"]
    images: list[Any] = [[png(40, 40, 1)], [png(60, 20, 2), png(24, 36, 3)], None]
    results = engine.generate(prompts, GREEDY, image_data=images, return_logprob=True)
    for prompt, imgs, result in zip(prompts, images, results, strict=True):
        check_equal(model_dir, prompt, imgs or [], result)


def test_repeated_image_is_a_cache_hit_over_all_tiles(engine: Engine) -> None:
    assert engine.flush_cache()
    strategy = multimodal_of(engine.core)
    assert strategy is not None
    image = png(48, 48, 7)
    before = strategy.images_encoded
    first = engine.generate(ONE, GREEDY, image_data=[image])
    encoded, steps = strategy.images_encoded, strategy.encoder_steps
    assert encoded == before + 5  # its 2x2 tiles and the global image
    second = engine.generate(ONE, GREEDY, image_data=[image])
    assert second["output_ids"] == first["output_ids"]
    # everything but the last prompt token: all five tiles' spans and the text between them
    assert second["meta_info"]["cached_tokens"] == second["meta_info"]["prompt_tokens"] - 1
    assert (strategy.images_encoded, strategy.encoder_steps) == (encoded, steps)
    # another image of the same size: the same text between the tiles, but no tile is a hit;
    # the prefix ends before the first tile's image tokens ('Hello ', <fake>, <row_1_col_1>)
    other = engine.generate(ONE, GREEDY, image_data=[png(48, 48, 8)])
    prefix = len(engine.tokenizer.encode("Hello <fake_token_around_image><row_1_col_1>"))
    assert other["meta_info"]["cached_tokens"] == prefix
    assert strategy.images_encoded == encoded + 5


@pytest.mark.slow
def test_smolvlm_architecture_matches_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = make_tiny_idefics3_dir(tmp_path_factory.mktemp("smolvlm"), architecture="SmolVLM")
    images = [png(30, 50, 5)]
    with Engine(str(model), plugins=[CPU], dtype="float32", max_total_tokens=2048) as eng:
        result = eng.generate(ONE, GREEDY, image_data=images, return_logprob=True)
    check_equal(model, ONE, images, result)


@pytest.mark.parametrize("splitting", [True, False])
def test_prompt_expansion_equals_transformers_processor(
    model_dir: Path, tmp_path: Path, splitting: bool
) -> None:
    import io
    import json
    import shutil

    from PIL import Image
    from transformers import AutoImageProcessor, Idefics3Processor, PreTrainedTokenizerFast

    from radixserve.core.model_config import ModelConfig
    from radixserve.core.tokenizer import Tokenizer
    from radixserve.plugins.models.idefics3 import Idefics3Images

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    processor_config = json.loads((model_dir / "preprocessor_config.json").read_text())
    processor_config["do_image_splitting"] = splitting
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor_config))
    ours = Idefics3Images(str(tmp_path), ModelConfig.from_dir(tmp_path))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    theirs = Idefics3Processor(AutoImageProcessor.from_pretrained(tmp_path), tokenizer,
                               image_seq_len=16)  # fmt: skip
    prompt = "A <image> then\n<image>, and <image>."
    # split: 1x2, 2x1 and 2x2 tiles (the small image is resized up), each + the global image
    images = [png(100, 10, 1), png(10, 70, 2), png(8, 8, 3)]
    ids, mm = ours.expand(Tokenizer(str(tmp_path)).encode(prompt), images)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    expected = theirs(text=prompt, images=pil, return_tensors="pt")
    image_token = ours.image_token
    spans = {i for item in mm.images for i in range(item.offset, item.offset + item.length)}
    assert [image_token if i in spans else t for i, t in enumerate(ids)] == (
        expected["input_ids"][0].tolist()
    )
    # the tiles' pixels, in order, are transformers' (no padding between these equal tiles)
    pixels = torch.stack([item.pixel_tensor() for item in mm.images])
    assert torch.equal(pixels, expected["pixel_values"][0].float())
    assert len(mm.images) == (3 + 3 + 5 if splitting else 3)
