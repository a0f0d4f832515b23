"""The Llama Triton ops (RMSNorm, add+RMSNorm, RoPE, SiLU-mul) equal the eager torch code they
replace.

On a CPU machine they run under TRITON_INTERPRET=1; on a CUDA machine compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.core.config import ModelConfig  # noqa: E402
from radixserve.plugins.models import fused_ops  # noqa: E402
from radixserve.plugins.models.blocks import RMSNorm, RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: one rounding step apart at most
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype) -> None:
    dim = 4096 if DEVICE == "cuda" else 200
    norm = RMSNorm(dim, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x = torch.randn(7, dim, device=DEVICE).to(dtype) * 3
    want = norm(x)
    norm.fused = fused_ops
    _close(norm(x), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    dim = 4096 if DEVICE == "cuda" else 200
    norm = RMSNorm(dim, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x, residual = (torch.randn(7, dim, device=DEVICE).to(dtype) * 3 for _ in range(2))
    want_total = x + residual
    norm.fused = fused_ops
    out, total = norm.add_forward(x, residual)
    if DEVICE == "cuda":  # the interpreter truncates float32 -> bfloat16 instead of rounding
        assert torch.equal(total, want_total)
    _close(total, want_total, dtype)
    norm.fused = None
    _close(out, norm(total), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_strided_q_and_k(dtype: torch.dtype) -> None:
    heads, kv_heads, dim = (32, 8, 128) if DEVICE == "cuda" else (6, 2, 32)
    config = ModelConfig.from_dict(
        {"architectures": ["X"], "hidden_size": heads * dim, "num_attention_heads": heads,
         "num_hidden_layers": 1, "vocab_size": 8, "max_position_embeddings": 300,
         "rope_theta": 500000.0}
    )  # fmt: skip
    rope = RotaryEmbedding(config, DEVICE, dtype)
    t = 9
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=DEVICE).to(dtype)
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    positions = torch.tensor([0, 1, 5, 17, 100, 299, 3, 3, 42], device=DEVICE)
    want_q, want_k = rope.apply(q, positions), rope.apply(k, positions)
    rope.fused = fused_ops
    _close(rope.apply(q, positions), want_q, dtype)
    _close(rope.apply(k, positions), want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    inter = 14336 if DEVICE == "cuda" else 1100  # not a multiple of the 1024 block
    x = torch.randn(5, 2 * inter, device=DEVICE).to(dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    _close(fused_ops.silu_mul(x), torch.nn.functional.silu(gate) * up, dtype)
