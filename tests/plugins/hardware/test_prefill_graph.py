"""Padded prefill steps (plugins/hardware/prefill_graph.py), what the CUDA prefill graphs replay.

On the CPU, under the Triton interpreter, an engine whose prefill steps run from the padded
static inputs (eagerly, as a graph would replay them) gives the plain engine's tokens and
logprobs: prompts alone and together, prompts that share and repeat prefixes (cached), a
prompt longer than the largest shape (eager), and more requests than a shape holds. Which steps
are padded follows the rules (no decodes, no input logprobs, at most 4 requests).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve import Engine  # noqa: E402
from radixserve.core.batch import ForwardBatch  # noqa: E402
from radixserve.core.memory import ReqToTokenPool  # noqa: E402
from radixserve.plugins.hardware.prefill_graph import (  # noqa: E402
    PaddedPrefill,
    prefill_shapes,
    prefill_token_sizes,
)

MAX_TOKENS = 64


def test_token_sizes_double_from_32_to_the_maximum() -> None:
    assert prefill_token_sizes(512) == [32, 64, 128, 256, 512]
    assert prefill_token_sizes(100) == [32, 64, 100]
    assert prefill_token_sizes(20) == [20]
    assert prefill_token_sizes(0) == []
    assert prefill_shapes(64) == [(1, 64), (2, 64), (4, 64), (1, 32), (2, 32), (4, 32)]


class PaddedEagerSteps:
    """A step executor that runs every paddable prefill step from ``PaddedPrefill``'s static
    inputs, eagerly, exactly as ``CudaGraphRunner`` captures it; other steps as the CPU
    does. Counts the shapes it padded to."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        pad_row = runner.attention.bind_table(runner.req_to_token)
        self.prefill = PaddedPrefill(
            runner.model, runner.attention, runner.kv_pool, runner.req_to_token, pad_row,
            MAX_TOKENS, runner.device,
        )  # fmt: skip
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        shape = self.prefill.shape_for(batch)
        if shape is None:
            self.runner.attention.prepare(batch)
            return self.runner.model.forward(batch)
        static = self.prefill.static_batch(shape, batch.capture_hidden_layers)
        self.prefill.fill(batch, shape)
        self.prefill.prepare(shape)
        logits = self.runner.model.forward(static)
        if static.hidden_states is not None:
            n = batch.num_tokens
            batch.hidden_states = {i: h[:n] for i, h in static.hidden_states.items()}
        self.shapes.append(shape)
        return logits[: batch.batch_size]


def _traffic(engine: Engine) -> list[dict[str, Any]]:
    shared = list(range(5, 30))
    greedy = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    out = [engine.generate(input_ids=shared + [40, 41], sampling_params=greedy,
                           return_logprob=True)]  # fmt: skip
    # three at once, two over the cached prefix (new tokens: 40 + 3 + 3)
    prompts = [shared + [50] * 40, shared + [60, 61, 62], [7, 8, 9]]
    out += engine.generate(input_ids=prompts, sampling_params=greedy, return_logprob=True)
    out.append(engine.generate(input_ids=list(range(3, 90)), sampling_params=greedy))  # > 64
    six = [[i, i + 1, i + 2] for i in range(60, 66)]  # more requests than a shape holds
    out += engine.generate(input_ids=six, sampling_params=greedy)
    return out


def _engine(model_dir: Path, plugins: tuple[str, ...] = ("attention=triton", "hardware=cpu"),
            **settings: Any) -> Engine:  # fmt: skip
    return Engine(
        str(model_dir), plugins=list(plugins), dtype="float32",
        max_total_tokens=2048, debug_leak_check=True, **settings,
    )  # fmt: skip


def _assert_same(ours: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in ref]
    for a, b in zip(ours, ref, strict=True):
        if "output_token_logprobs" in a["meta_info"]:
            got = [lp for lp, _, _ in a["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _, _ in b["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's interpreted Triton")
def test_padded_prefill_equals_eager_prefill(tiny_llama_dir: Path) -> None:
    with _engine(tiny_llama_dir, disable_overlap_schedule=True) as engine:
        plain = _traffic(engine)
    with _engine(tiny_llama_dir, disable_overlap_schedule=True) as engine:
        padded = PaddedEagerSteps(engine.core.runner)
        engine.core.runner.step = padded
        ours = _traffic(engine)
    _assert_same(ours, plain)
    # the lone prompt and the three at once were padded; the 87-token prompt and the six
    # short ones at once were not
    assert padded.shapes == [(1, 32), (4, 64)]


def _batch(extend_lens: list[int], num_decode: int = 0, logits: int | None = None) -> ForwardBatch:
    n = sum(extend_lens)
    rows = len(extend_lens) if logits is None else logits
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64),
        out_cache_loc=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.zeros(len(extend_lens), dtype=torch.int64),
        req_to_token=torch.zeros(1, 1),
        seq_lens=list(extend_lens),
        extend_lens=extend_lens,
        num_decode=num_decode,
        logits_indices=torch.zeros(rows, dtype=torch.int64),
        kv_pool=None,
        req_to_token_pool=None,  # type: ignore[arg-type]
    )


def test_which_steps_are_padded() -> None:
    table = ReqToTokenPool(2, 128)
    prefill = PaddedPrefill(None, None, None, table, 0, MAX_TOKENS, "cpu")  # type: ignore[arg-type]
    assert prefill.shape_for(_batch([10])) == (1, 32)
    assert prefill.shape_for(_batch([33])) == (1, 64)
    assert prefill.shape_for(_batch([10, 10, 10])) == (4, 32)
    assert prefill.shape_for(_batch([65])) is None  # too many tokens
    assert prefill.shape_for(_batch([2] * 5)) is None  # too many requests
    assert prefill.shape_for(_batch([1, 1, 10], num_decode=2)) is None  # decodes in the step
    assert prefill.shape_for(_batch([10], logits=4)) is None  # input logprobs
    with_pooling = _batch([10])
    with_pooling.hidden_rows = torch.zeros(1, dtype=torch.int64)
    assert prefill.shape_for(with_pooling) is None
    # a short context caps the shapes at the slot table's width (the padding request reads
    # that many positions of the padding row)
    narrow = PaddedPrefill(None, None, None, ReqToTokenPool(2, 17), 0, MAX_TOKENS, "cpu")  # type: ignore[arg-type]
    assert narrow.shapes == [(1, 17), (2, 17), (4, 17)]
    assert narrow.shape_for(_batch([11, 11, 11])) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's interpreted Triton")
def test_a_context_shorter_than_the_largest_shape_pads_within_the_table(
    tiny_llama_dir: Path,
) -> None:
    """Three 11-token prompts with a 16-token context: unpadded they would take the 64-token
    shape, whose padding request would read 31 positions of a 17-wide table row."""
    prompts = [[i] * 11 for i in (5, 6, 7)]
    greedy = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}

    def run(padded: bool) -> tuple[list[list[int]], list[tuple[int, int]]]:
        with _engine(tiny_llama_dir, context_length=16, disable_overlap_schedule=True) as engine:
            steps = PaddedEagerSteps(engine.core.runner) if padded else None
            if steps is not None:
                engine.core.runner.step = steps
            out = [engine.generate(input_ids=prompts[0], sampling_params=greedy)]
            out += engine.generate(input_ids=prompts, sampling_params=greedy)
            return [o["output_ids"] for o in out], steps.shapes if steps else []

    plain, _ = run(False)
    ours, shapes = run(True)
    assert ours == plain
    assert shapes == [(1, 17)]  # the lone prompt; the three together ran eagerly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_prefill_graphs_equal_the_cpu(tiny_llama_dir: Path) -> None:
    """The real graphs (captured at start, replayed with overlap scheduling), float32: the
    CPU's tokens and logprobs; the two paddable prefill steps replayed a graph."""
    gpu = ("attention=triton", "hardware=cuda")
    with _engine(tiny_llama_dir, gpu, cuda_graph_max_prefill_tokens=MAX_TOKENS) as engine:
        ours = _traffic(engine)
        assert engine.core.runner.step.prefill_replays == 2
    with _engine(tiny_llama_dir, ("attention=torch_native", "hardware=cpu")) as engine:
        ref = _traffic(engine)
    _assert_same(ours, ref)
