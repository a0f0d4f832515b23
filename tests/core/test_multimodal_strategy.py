"""core/multimodal_strategy.py engine-free: which requests are tracked, the rows and embedding
slices a step's images take (chunks ending inside an image, the encoder cache, one encoder call
a step), M-RoPE positions, the build's refusals and text_ids. The model is a stand-in whose
encoder output row ``i`` of image ``h`` holds ``h * 100 + i``, so each slice names its source."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixserve.core.config import EngineConfig
from radixserve.core.config_checks import ConfigError
from radixserve.core.multimodal import ImageInput, MultimodalInputs
from radixserve.core.multimodal_strategy import (
    DEFAULT_ENCODER_CACHE_BYTES,
    MultimodalStrategy,
    build,
    multimodal_of,
    text_ids,
)
from radixserve.core.request import FinishReason, InvalidRequest, Req, SamplingParams


class Encoder:
    def __init__(self, mrope: bool = False) -> None:
        self.uses_mrope = mrope
        self.calls: list[list[int]] = []

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        self.calls.append([i.hash for i in images])
        return [
            (i.hash * 100 + torch.arange(i.length, dtype=torch.float32)).unsqueeze(1).repeat(1, 2)
            for i in images
        ]


def image(h: int, offset: int, length: int) -> ImageInput:
    return ImageInput(hash=h, pixels=b"", shape=(0,), grid=(1,), offset=offset, length=length)


def req(
    rid: str, n: int, images: list[ImageInput] | None, row: int | None = None, **mm: Any
) -> Req:
    r = Req(rid, list(range(1, n + 1)), SamplingParams())
    r.mm_inputs = None if images is None else MultimodalInputs(images=images, **mm)
    r.req_pool_idx = row
    return r


def step(pool: list[int], extend: list[int], seq: list[int]) -> Any:
    return SimpleNamespace(req_pool_indices=torch.tensor(pool), extend_lens=extend, seq_lens=seq,
                           mm="unset")  # fmt: skip


def embeds(batch: Any) -> list[float]:
    return batch.mm.embeds[:, 0].tolist()


def test_requests_with_images_are_tracked_until_they_finish() -> None:
    mm = MultimodalStrategy(Encoder(), "cpu", 1 << 20)
    assert (mm.device, mm.mrope, mm.cache.max_bytes, mm.tracked) == ("cpu", False, 1 << 20, {})
    a, b, text = req("a", 4, [image(1, 0, 2)]), req("b", 4, [image(2, 0, 2)]), req("t", 4, None)
    assert mm.admit(a, False) is False and mm.admit(b, True) is False
    assert mm.admit(text, False) is False
    assert mm.tracked == {"a": a, "b": b}
    mm.ended([a, b])  # neither finished
    assert set(mm.tracked) == {"a", "b"}
    a.finish(FinishReason("length"))
    mm.ended([a, b])
    assert mm.tracked == {"b": b}
    mm.refused(b, "no room")
    mm.refused(text, "no room")
    assert mm.tracked == {}
    assert mm.stats() == {"images_encoded": 0, "encoder_steps": 0, "encoder_cache_hits": 0,
                          "encoder_cache_entries": 0, "encoder_cache_bytes": 0}  # fmt: skip


def test_a_text_only_step_sets_nothing() -> None:
    mm = MultimodalStrategy(Encoder(), "cpu", 1 << 20)
    batch = step([0], [3], [3])
    mm.before_forward(batch)
    assert batch.mm is None
    waiting = req("w", 4, [image(1, 0, 2)])  # tracked, no row yet
    other = req("o", 4, [image(1, 0, 2)], row=5)  # tracked, not in this step
    mm.admit(waiting, False), mm.admit(other, False)
    batch = step([0, 1], [3, 1], [3, 9])
    mm.before_forward(batch)
    assert batch.mm is None and mm.model.calls == []


def test_image_rows_and_slices_across_chunks_and_the_cache() -> None:
    model = Encoder()
    mm = MultimodalStrategy(model, "cpu", 1 << 20)
    # r: tokens 0..9, images 7 at 2..5 and 8 at 7..8; text request t on row 1 before it
    r = req("r", 10, [image(7, 2, 4), image(8, 7, 2)], row=3)
    mm.admit(r, False)
    batch = step([1, 3], [2, 4], [5, 4])  # t decodes 2 tokens; r's first chunk: tokens 0..3
    mm.before_forward(batch)
    assert batch.mm.rows.tolist() == [4, 5] and embeds(batch) == [700.0, 701.0]
    assert batch.mm.rows.dtype == torch.int64 and batch.mm.mrope is None
    assert model.calls == [[7]]
    batch = step([3], [6], [10])  # the rest: tokens 4..9
    mm.before_forward(batch)
    assert batch.mm.rows.tolist() == [0, 1, 3, 4] and embeds(batch) == [702.0, 703.0, 800.0, 801.0]
    assert model.calls == [[7], [8]]  # 7 from the cache
    assert mm.stats() == {"images_encoded": 2, "encoder_steps": 2, "encoder_cache_hits": 1,
                          "encoder_cache_entries": 2,
                          "encoder_cache_bytes": (4 + 2) * 2 * 4}  # fmt: skip


def test_one_encoder_call_a_step_each_image_once() -> None:
    model = Encoder()
    mm = MultimodalStrategy(model, "cpu", 1 << 20)
    a = req("a", 6, [image(5, 0, 2), image(6, 3, 2)], row=0)
    b = req("b", 4, [image(5, 1, 2)], row=1)  # the same image as a's first
    mm.admit(a, False), mm.admit(b, False)
    batch = step([0, 1], [6, 4], [6, 4])
    mm.before_forward(batch)
    assert model.calls == [[5, 6]]
    assert batch.mm.rows.tolist() == [0, 1, 3, 4, 7, 8]
    assert embeds(batch) == [500.0, 501.0, 600.0, 601.0, 500.0, 501.0]
    assert (mm.images_encoded, mm.encoder_steps) == (2, 1)


def test_an_image_dropped_from_the_cache_is_encoded_again() -> None:
    model = Encoder()
    mm = MultimodalStrategy(model, "cpu", 16)  # one 2-row output: 16 bytes
    a = req("a", 4, [image(1, 0, 2), image(2, 2, 2)], row=0)
    mm.admit(a, False)
    mm.before_forward(step([0], [2], [2]))
    mm.before_forward(step([0], [2], [4]))
    batch = step([0], [4], [4])  # again from the start (say after a retraction)
    mm.before_forward(batch)
    assert model.calls == [[1], [2], [1]]  # 2 is in the cache; 1 was dropped for it
    assert embeds(batch) == [100.0, 101.0, 200.0, 201.0] and mm.cache.hits == 1


def test_a_chunk_past_its_images_takes_no_rows() -> None:
    model = Encoder()
    mm = MultimodalStrategy(model, "cpu", 1 << 20)
    a = req("a", 8, [image(1, 0, 2)], row=2)
    mm.admit(a, False)
    batch = step([2], [1], [9])  # a decode after the prompt
    mm.before_forward(batch)
    assert batch.mm.rows.tolist() == [] and batch.mm.rows.dtype == torch.int64
    assert batch.mm.embeds.numel() == 0 and batch.mm.mrope is None and model.calls == []
    batch = step([2], [2], [4])  # a chunk starting right where the image ends
    mm.before_forward(batch)
    assert batch.mm.rows.tolist() == [] and model.calls == []


def test_mrope_positions() -> None:
    mm = MultimodalStrategy(Encoder(mrope=True), "cpu", 1 << 20)
    assert mm.mrope is True
    table = [[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]]  # a 5-token prompt
    a = req("a", 5, [image(1, 1, 3)], row=0, mrope=table, mrope_delta=-1)
    plain = req("p", 5, [image(2, 0, 1)], row=2)  # no M-RoPE table: positions themselves
    mm.admit(a, False), mm.admit(plain, False)
    batch = step([1, 0, 2], [2, 3, 1], [6, 4, 3])  # text t (4, 5), a 1..3, plain 2
    mm.before_forward(batch)
    assert batch.mm.mrope.tolist() == [
        [4, 5, 1, 1, 1, 2],
        [4, 5, 1, 1, 2, 2],
        [4, 5, 1, 2, 1, 2],
    ]
    assert batch.mm.mrope.dtype == torch.int64
    batch = step([0], [3], [7])  # a's last prompt token and two after it: delta -1
    mm.before_forward(batch)
    assert batch.mm.mrope.tolist() == [[3, 4, 5], [3, 4, 5], [3, 4, 5]]
    batch = step([0], [1], [9])  # a decode
    mm.before_forward(batch)
    assert batch.mm.mrope.tolist() == [[7], [7], [7]]
    batch = step([0], [5], [5])  # the whole prompt
    mm.before_forward(batch)
    assert batch.mm.mrope.tolist() == table


def core_of(model: Any, strategies: list[Any] | None = None, **cfg: Any) -> Any:
    runner = SimpleNamespace(model=model, device="cpu", config=EngineConfig(**cfg))
    return SimpleNamespace(runner=runner, strategies=strategies or [])


@pytest.mark.parametrize(
    ("cfg", "flag"),
    [
        ({"tp_size": 2}, "--tp-size > 1"),
        ({"pp_size": 2}, "--pp-size > 1"),
        ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm"),
        ({"disaggregation_mode": "prefill"}, "--disaggregation-mode"),
        ({"enable_lora": True}, "--enable-lora"),
    ],
)
def test_what_a_vision_model_does_not_run_with(cfg: dict[str, Any], flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(core_of(Encoder(), **cfg))
    assert str(err.value) == f"a vision-language model (Encoder) does not run with {flag} yet"
    assert build(core_of(object(), **cfg)) is None  # a text model: no strategy, no refusal


def test_build_sizes_the_encoder_cache() -> None:
    model = Encoder(mrope=True)
    mm = build(core_of(model))
    assert mm is not None and mm.model is model and mm.device == "cpu" and mm.mrope
    assert mm.cache.max_bytes == 256 << 20 == DEFAULT_ENCODER_CACHE_BYTES
    assert build(core_of(model, mm_encoder_cache_mb=3)).cache.max_bytes == 3 << 20
    assert build(core_of(model, mm_encoder_cache_mb=0)).cache.max_bytes == 0
    core = core_of(model)
    core.runner.config = SimpleNamespace(tp_size=1, pp_size=1, speculative_algorithm=None,
                                         disaggregation_mode="null", enable_lora=False)  # fmt: skip
    assert build(core).cache.max_bytes == DEFAULT_ENCODER_CACHE_BYTES  # a config without it
    assert multimodal_of(core_of(model, [object()])) is None
    assert multimodal_of(core_of(model, [object(), mm])) is mm


def test_text_ids() -> None:
    text = req("t", 4, None)
    assert text_ids(text) is text.input_ids
    r = req("r", 8, [image(1, 1, 2), image(2, 4, 3)])
    assert text_ids(r) == [1, 0, 0, 4, 0, 0, 0, 8]
    r.logprob_start_len = 7
    assert text_ids(r) == [1, 0, 0, 4, 0, 0, 0, 8]
    for start in (0, 6):
        r.logprob_start_len = start
        with pytest.raises(InvalidRequest) as err:
            text_ids(r)
        assert str(err.value) == (
            f"logprob_start_len={start} scores image tokens; prompt logprobs start after the "
            "last image (logprob_start_len >= 7)"
        )
    r.logprob_start_len = -1
    r.session_params = {"id": "s"}
    with pytest.raises(InvalidRequest) as err:
        text_ids(r)
    assert str(err.value) == "a request with images cannot continue a session yet"


def test_a_finished_request_without_images_ends_quietly() -> None:
    mm = MultimodalStrategy(Encoder(), "cpu", 1 << 20)
    text = req("t", 4, None)
    mm.admit(text, False)
    text.finish(FinishReason("length"))
    mm.ended([text])  # never tracked: nothing to drop
    assert mm.tracked == {}


def test_a_model_without_the_mrope_flag_takes_plain_positions() -> None:
    class Plain:
        def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
            return [torch.zeros(i.length, 2) for i in images]

    mm = MultimodalStrategy(Plain(), "cpu", 1 << 20)
    assert mm.mrope is False
    mm.admit(req("a", 4, [image(1, 0, 2)], row=0), False)
    batch = step([0], [4], [4])
    mm.before_forward(batch)
    assert batch.mm.mrope is None


def test_the_cache_is_asked_once_per_image_and_step() -> None:
    model = Encoder()
    mm = MultimodalStrategy(model, "cpu", 1 << 20)
    a = req("a", 4, [image(5, 0, 2), image(6, 2, 2)], row=0)
    b = req("b", 4, [image(5, 0, 2), image(7, 2, 2)], row=1)  # 5 again, then a new image
    c = req("c", 6, [image(8, 3, 2)], row=2)  # after two requests: rows from 4 + 4 + 3
    for r in (a, b, c):
        mm.admit(r, False)
    batch = step([0, 1, 2], [4, 4, 6], [4, 4, 6])
    mm.before_forward(batch)
    assert model.calls == [[5, 6, 7, 8]]
    assert batch.mm.rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 11, 12]
    assert embeds(batch) == [500.0, 501.0, 600.0, 601.0, 500.0, 501.0, 700.0, 701.0, 800.0, 801.0]
    assert (mm.cache.misses, mm.cache.hits) == (4, 0)
    batch = step([0, 1], [4, 4], [4, 4])  # again: each from the cache, asked once
    mm.before_forward(batch)
    assert (mm.cache.misses, mm.cache.hits) == (4, 3) and len(model.calls) == 1


def test_an_encoder_or_a_batch_of_the_wrong_size_is_refused() -> None:
    class Short(Encoder):
        def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
            return super().encode_images(images)[:-1]

    mm = MultimodalStrategy(Short(), "cpu", 1 << 20)
    mm.admit(req("a", 4, [image(1, 0, 2), image(2, 2, 2)], row=0), False)
    with pytest.raises(ValueError):
        mm.before_forward(step([0], [4], [4]))
    mm = MultimodalStrategy(Encoder(), "cpu", 1 << 20)
    mm.admit(req("a", 4, [image(1, 0, 2)], row=0), False)
    with pytest.raises(ValueError):
        mm.before_forward(step([0, 1], [4], [4, 1]))


def test_mrope_tables_are_built_once_and_decodes_after_the_prompt() -> None:
    mm = MultimodalStrategy(Encoder(mrope=True), "cpu", 1 << 20)
    table = [[0, 1, 1], [0, 1, 2], [0, 2, 1]]
    a = req("a", 3, [image(1, 1, 2)], row=0, mrope=table, mrope_delta=4)
    mm.admit(a, False)
    mm.before_forward(step([0], [2], [2]))
    built = a.mrope_table
    assert built.tolist() == table and built.dtype == torch.int64
    a.mrope_table = torch.tensor([[9, 9, 9]] * 3)  # the request's own table is what is read
    batch = step([0], [3], [3])
    mm.before_forward(batch)
    assert batch.mm.mrope.tolist() == [[9, 9, 9]] * 3
    batch = step([0], [2], [6])  # two tokens after the prompt: 4 + 4, 5 + 4
    mm.before_forward(batch)
    assert batch.mm.mrope.tolist() == [[8, 9]] * 3
