"""The fused MoE path (``fused_moe.py``: pairs sorted by expert, two grouped-GEMM Triton kernels)
equals the reference loop of ``moe.SparseMoE``, and a Qwen3-MoE model running it equals
transformers.

On a CPU machine the kernels run under TRITON_INTERPRET=1 at tiny shapes; on a CUDA machine
compiled, at Qwen3-30B-A3B's expert shapes (and captured in a CUDA graph).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from tiny_models import make_tiny_model_dir  # noqa: E402

from radixserve.core.config import EngineConfig  # noqa: E402
from radixserve.core.model_runner import ModelRunner  # noqa: E402
from radixserve.core.plugins import default_host  # noqa: E402
from radixserve.core.request import Req, SamplingParams  # noqa: E402
from radixserve.core.step_plan import StepPlan  # noqa: E402
from radixserve.plugins.models import fused_moe, moe  # noqa: E402
from radixserve.plugins.models.moe import SparseMoE  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
#: (hidden, expert intermediate, experts, top-k): Qwen3-30B-A3B's on a GPU
SHAPE = (2048, 768, 128, 8) if CUDA else (64, 48, 6, 2)
TOKENS = (1, 7, 64, 300) if CUDA else (1, 5, 37)


def _moe(renormalize: bool, dtype: torch.dtype, seed: int = 0) -> SparseMoE:
    hidden, inter, experts, top_k = SHAPE
    torch.manual_seed(seed)
    layer = SparseMoE(hidden, inter, experts, top_k, renormalize, "silu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, hidden**-0.5)
    return layer.to(DEVICE, dtype)


def test_align_puts_every_pair_once_in_a_block_of_its_expert() -> None:
    g = torch.Generator().manual_seed(1)
    experts, block = 9, 4
    for tokens, top_k in ((1, 2), (3, 3), (50, 2)):
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
        a = fused_moe.align(ids.to(DEVICE), experts, block)
        sorted_ids, expert_ids = a.sorted_ids.cpu().long(), a.expert_ids.cpu().long()
        used, pairs = int(a.num_padded), tokens * top_k
        assert used % block == 0 and used <= len(sorted_ids)
        assert (sorted_ids[used:] == pairs).all()  # nothing past the padded total
        real = sorted_ids[:used] < pairs
        assert sorted(sorted_ids[:used][real].tolist()) == list(range(pairs))
        block_of = torch.arange(used) // block
        assert (ids.flatten()[sorted_ids[:used][real]] == expert_ids[block_of[real]]).all()
        for e in range(experts):  # each expert's pairs in token order
            run = sorted_ids[:used][real][ids.flatten()[sorted_ids[:used][real]] == e]
            assert run.tolist() == sorted(run.tolist())
        # each expert's run is padded by less than one block
        counts = torch.bincount(ids.flatten(), minlength=experts)
        assert used == int(((counts + block - 1) // block * block).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "softmax"])
def test_fused_experts_equal_the_reference(dtype: torch.dtype, renormalize: bool) -> None:
    """float32: equal to rounding; bfloat16: as close to the float32 result as the reference."""
    layer = _moe(renormalize, dtype)
    exact = _moe(renormalize, torch.float32)
    exact.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    for tokens in TOKENS:
        x = torch.randn(tokens, SHAPE[0], device=DEVICE).to(dtype)
        weights, ids = exact.route(x.float())  # one routing for all three: ties cannot differ
        got = fused_moe.fused_experts(x, layer.w13, layer.w2, weights, ids).float()
        truth = _reference(exact, x.float(), weights, ids)
        if dtype == torch.float32:
            tol = 2e-4 if CUDA else 1e-5  # sums of 2,048 products in another order
            torch.testing.assert_close(got, truth, rtol=tol, atol=tol)
            continue
        ref = _reference(layer, x, weights.to(dtype), ids).float()
        scale = truth.abs().max().item()
        err, ref_err = (got - truth).abs().max().item(), (ref - truth).abs().max().item()
        # NOTE: the interpreter truncates float32 -> bfloat16 (a GPU rounds): up to twice the error
        assert err <= 2 * ref_err + scale / 256, (tokens, err, ref_err, scale)


def _reference(layer: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """The reference loop with the given routing (``SparseMoE.forward`` routes itself)."""
    route = layer.route
    layer.route = lambda _: (weights, ids)  # type: ignore[method-assign]
    try:
        return layer(x)
    finally:
        layer.route = route  # type: ignore[method-assign]


def test_empty_batch() -> None:
    layer = _moe(True, torch.float32)
    x = torch.empty(0, SHAPE[0], device=DEVICE)
    weights, ids = layer.route(x)
    assert fused_moe.fused_experts(x, layer.w13, layer.w2, weights, ids).shape == (0, SHAPE[0])


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")
def test_fused_experts_replay_in_a_cuda_graph() -> None:
    """Fixed shapes, no host sync: captured once, replayed on new tokens, it equals a fresh run."""
    layer = _moe(True, torch.bfloat16)
    layer.kernels = fused_moe
    x = torch.randn(8, SHAPE[0], device=DEVICE, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, layer(x), rtol=0, atol=0)


def test_qwen3_moe_logits_through_the_fused_path_equal_hf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3-layer Qwen3-MoE (a dense layer between sparse ones) built with the fused kernels on
    this device: a prefill of 11 tokens and 3 decodes give transformers' logits (float32)."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model_dir(
        tmp_path, "qwen3_moe", "Qwen3MoeForCausalLM", num_hidden_layers=3, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
        mlp_only_layers=[1],
    )  # fmt: skip
    monkeypatch.setattr(moe, "fused_moe_for", lambda device: fused_moe)
    config = EngineConfig(
        max_total_tokens=256, dtype="float32", plugins=("attention=torch_native",)
    )
    runner = ModelRunner(model_dir, config, default_host())
    sparse = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(sparse) == 2 and all(m.kernels is fused_moe for m in sparse)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    req = Req("a", prompt, SamplingParams())
    req.req_pool_idx = runner.req_to_token.alloc()
    for n in (11, 1, 1, 1):
        slots = runner.allocator.alloc(n)
        runner.req_to_token.write(req.req_pool_idx, req.kv_len, slots)
        fb, _ = runner.build_batch(StepPlan([req], [n], int(n == 1)))
        fb.logits_indices = torch.arange(n)
        runner.attention.prepare(fb)
        logits = runner.model.forward(fb).cpu()
        req.kv_len += n
        ids = req.fill_ids()[: req.kv_len]
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -n:].float()
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
        req.output_ids.append(int(logits[-1].argmax()))
