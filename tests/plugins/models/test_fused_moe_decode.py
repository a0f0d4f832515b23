"""The fused MoE kernels' decode configuration and FP8 experts (plugins/models/fused_moe.py).

- one block per (token, slot) pair (``align_pairs``, batch 1's default) gives the per-expert
  blocks' result;
- FP8 experts (a scale per output row) through the same kernels equal the reference loop over
  the same dequantized weights, and stay within FP8's rounding of the 16-bit experts;
- the tiles come from the stored table at the nearest tuned token count, else the defaults;
- on a GPU, a batch-1 MoE block (router top-k included) runs without a host sync.

On a CPU machine the kernels run under TRITON_INTERPRET=1 at tiny shapes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.plugins.models import fused_moe  # noqa: E402
from radixserve.plugins.models.moe import SparseMoE  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SHAPE = (2048, 768, 128, 8) if CUDA else (64, 48, 6, 2)  # hidden, inter, experts, top-k


def _moe(seed: int = 0) -> SparseMoE:
    hidden, inter, experts, top_k = SHAPE
    torch.manual_seed(seed)
    layer = SparseMoE(hidden, inter, experts, top_k, True, "silu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, hidden**-0.5)
    return layer.to(DEVICE, torch.float32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_pair_blocks_equal_expert_blocks() -> None:
    layer = _moe()
    for tokens in (1, 3):
        x = torch.randn(tokens, SHAPE[0], device=DEVICE)
        weights, ids = layer.route(x)
        per_expert = fused_moe.Tiles(16, 64, 128, 4, 3)
        per_pair = per_expert._replace(pair_blocks=True)
        a = fused_moe.fused_experts(x, layer.w13, layer.w2, weights, ids, per_expert)
        b = fused_moe.fused_experts(x, layer.w13, layer.w2, weights, ids, per_pair)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    aligned = fused_moe.align_pairs(ids, 16)
    assert int(aligned.num_padded) == ids.numel() * 16
    assert aligned.sorted_ids.view(-1, 16)[:, 0].tolist() == list(range(ids.numel()))
    assert aligned.expert_ids.tolist() == ids.flatten().tolist()


def test_fp8_experts_through_the_kernels_equal_the_reference() -> None:
    layer = _moe(1)
    exact = _moe(1)
    layer.quantize_fp8()
    assert layer.w13.dtype == torch.float8_e4m3fn and layer.w2.dtype == torch.float8_e4m3fn
    assert layer.fp8_scales is not None and layer.fp8_scales[0].shape == layer.w13.shape[:2]
    for tokens in (1, 5, 37):
        x = torch.randn(tokens, SHAPE[0], device=DEVICE)
        weights, ids = exact.route(x)
        got = fused_moe.fused_experts(x, layer.w13, layer.w2, weights, ids, scales=layer.fp8_scales)
        ref = torch.zeros_like(x)  # the reference loop over the dequantized experts
        for t in range(tokens):
            for k in range(ids.shape[1]):
                ref[t] += weights[t, k] * layer.expert(int(ids[t, k]), x[t : t + 1])[0]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        full = fused_moe.fused_experts(x, exact.w13, exact.w2, weights, ids)
        assert 1e-3 < _rel(got, full) < 0.05  # FP8's rounding of the weights, no more


def test_tiles_come_from_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = {
        "Some GPU": {
            "6,48,64": {
                "1": {"block_m": 16, "block_n": 32, "block_k": 64, "num_warps": 4,
                      "num_stages": 4, "pair_blocks": True},
                "16": {"block_m": 32, "block_n": 128, "block_k": 64, "num_warps": 8,
                       "num_stages": 3},
            }
        }
    }  # fmt: skip
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(fused_moe, "CONFIGS", path)
    t1 = fused_moe.tiles(1, 2, 6, 48, 64, "Some GPU")
    assert t1 == fused_moe.Tiles(16, 32, 64, 4, 4, True)
    assert fused_moe.tiles(5, 10, 6, 48, 64, "Some GPU").block_m == 32  # next tuned: 16
    assert fused_moe.tiles(300, 600, 6, 48, 64, "Some GPU").block_m == 32  # the largest
    # another shape or device: the defaults
    assert fused_moe.tiles(1, 2, 6, 48, 96, "Some GPU") == fused_moe.default_tiles(1, 2, 6)
    assert fused_moe.tiles(1, 2, 6, 48, 64, None) == fused_moe.default_tiles(1, 2, 6)
    # and the table really runs
    layer = _moe()
    x = torch.randn(1, SHAPE[0], device=DEVICE)
    weights, ids = layer.route(x)
    a = fused_moe.fused_experts(x, layer.w13, layer.w2, weights, ids, t1)
    b = fused_moe.fused_experts(x, layer.w13, layer.w2, weights, ids)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_stored_table_parses() -> None:
    stored = json.loads(fused_moe.CONFIGS.read_text())
    for device, shapes in stored.items():
        if device.startswith("_"):
            continue
        for shape, entries in shapes.items():
            assert len(shape.split(",")) == 3
            for tokens, fields in entries.items():
                assert int(tokens) > 0 and fused_moe.Tiles(**fields).block_m >= 16


@pytest.mark.skipif(not CUDA, reason="host syncs are a GPU's")
def test_a_batch_1_moe_block_does_not_sync_with_the_host() -> None:
    layer = _moe().to(torch.bfloat16)
    layer.kernels = fused_moe
    x = torch.randn(1, SHAPE[0], device=DEVICE, dtype=torch.bfloat16)
    layer(x)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fp8_quantization_of_a_qwen3_moe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--quantization fp8`` on a MoE model: attention and dense projections become FP8
    layers, the experts FP8 codes run by the fused kernels, the router stays 16-bit; the
    logits stay within FP8's rounding (a random model amplifies it: < 25% of their norm)."""
    from tiny_models import make_tiny_model_dir

    from radixserve.core.config import EngineConfig
    from radixserve.core.model_runner import ModelRunner
    from radixserve.core.plugins import default_host
    from radixserve.core.request import Req, SamplingParams
    from radixserve.core.step_plan import StepPlan
    from radixserve.plugins.models import fp8, fp8_loading, moe

    model_dir = make_tiny_model_dir(
        tmp_path, "qwen3_moe", "Qwen3MoeForCausalLM", num_hidden_layers=2, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
    )  # fmt: skip
    monkeypatch.setattr(moe, "fused_moe_for", lambda device: fused_moe)
    config = EngineConfig(
        max_total_tokens=256, dtype="bfloat16", plugins=("attention=torch_native",)
    )
    runner = ModelRunner(model_dir, config, default_host())

    def logits() -> torch.Tensor:
        req = Req("a", list(range(3, 14)), SamplingParams())
        req.req_pool_idx = runner.req_to_token.alloc()
        slots = runner.allocator.alloc(11)
        runner.req_to_token.write(req.req_pool_idx, 0, slots)
        fb, _ = runner.build_batch(StepPlan([req], [11], 0))
        fb.logits_indices = torch.arange(11)
        runner.attention.prepare(fb)
        out = runner.model.forward(fb).float().cpu()
        runner.allocator.free(slots)
        runner.req_to_token.free(req.req_pool_idx)
        return out

    before = logits()
    assert fp8_loading.quantize_model(runner.model) == 2 * 2  # qkv and o in each layer
    block = runner.model.layers[0].moe
    assert type(block.gate) is torch.nn.Linear and block.w13.dtype == torch.float8_e4m3fn
    assert isinstance(runner.model.layers[1].qkv_proj, fp8.Fp8Linear)
    after = logits()
    assert _rel(after, before) < 0.25
