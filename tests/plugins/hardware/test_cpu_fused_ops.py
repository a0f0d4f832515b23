"""The CPU's fused per-token ops (C++, plugins/hardware/cpu_fused_ops.py) against the model's eager
formulas: RMSNorm, add + RMSNorm, SiLU-mul and RoPE on contiguous and strided rows, one thread
and two, float32 within a few ulp; other dtypes and traced steps take the eager formulas; bad
input gets a reason. The model-level check is tests/plugins/models/test_llama_logits.py (the
CPU model runs these ops by default there, against HF)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import checked_without_the_kernels

from radixserve.plugins.hardware.cpu_kernels import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _eager_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("strided", [False, True])
def test_norms_match_eager(rows: int, strided: bool, threads: int) -> None:
    from radixserve.plugins.hardware import cpu_fused_ops

    gen = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 2 * 576, generator=gen)
    x = wide[:, :576] if strided else wide[:, :576].contiguous()
    residual = torch.randn(rows, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    torch.testing.assert_close(cpu_fused_ops.rms_norm(x, w, 1e-5), _eager_norm(x, w, 1e-5),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    normed, total = cpu_fused_ops.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed, _eager_norm(x + residual, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 33])
def test_silu_mul_matches_eager(rows: int, threads: int) -> None:
    from radixserve.plugins.hardware import cpu_fused_ops

    x = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_fused_ops.silu_mul(x), F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("width", [8, 13])  # 13: vector lanes and the scalar tail
def test_silu_mul_at_the_extremes(width: int) -> None:
    """The vectorized sigmoid near exp's limits: no overflow, 0 (not a ~1e-38 floor) far
    below, and inf / nan where eager gives them. Eager's denormals past -87 may read 0."""
    from radixserve.plugins.hardware import cpu_fused_ops

    edges = [-1e30, -1e4, -100.0, -88.0, -87.0, -20.0, -0.0, 0.0, 1e-30, 20.0, 88.0, 1e4]
    edges += [float("inf"), float("-inf"), 3.0]
    for start in range(0, len(edges), width):
        gate = torch.tensor((edges[start : start + width] * width)[:width])
        up = torch.linspace(-2.0, 2.0, width)
        x = torch.cat([gate, up])[None]
        expected = F.silu(gate) * up
        torch.testing.assert_close(
            cpu_fused_ops.silu_mul(x)[0], expected, rtol=1e-6, atol=1e-30, equal_nan=True
        )


@pytest.mark.parametrize("tokens", [1, 40])
def test_rope_matches_eager(tokens: int, threads: int) -> None:
    from radixserve.plugins.hardware import cpu_fused_ops

    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(tokens, 15, 64, generator=gen)
    q = qkv[:, :9]  # strided in tokens, as the model's q view of its fused projection
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    freqs = torch.outer(torch.arange(128.0), 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))
    cos, sin = freqs.cos(), freqs.sin()
    c, s = cos[positions][:, None], sin[positions][:, None]
    x1, x2 = q[..., :32], q[..., 32:]
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out = cpu_fused_ops.rope(q, positions, cos, sin)
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_other_dtypes_run_the_eager_formulas() -> None:
    from radixserve.plugins.hardware import cpu_fused_ops

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(cpu_fused_ops.rms_norm(x, w, 1e-6), expected)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(cpu_fused_ops.silu_mul(x), F.silu(gate) * up)


def test_bad_inputs_get_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = checked_without_the_kernels(monkeypatch)
    cos = sin = torch.zeros(8, 4)
    with pytest.raises(RuntimeError, match="position 8 outside the table"):
        ops.rope(torch.zeros(2, 1, 8), torch.tensor([3, 8]), cos, sin)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        ops.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* n"):
        ops.silu_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="x and residual differ in shape"):
        ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.zeros(8), 1e-6)
    with pytest.raises(RuntimeError, match="positions must be int64"):
        ops.rope(torch.zeros(2, 1, 8), torch.tensor([3.0, 4.0]), cos, sin)
    with pytest.raises(RuntimeError, match="features do not fill 2 panels"):
        ops.linear_f32_packed(torch.zeros(2, 8), torch.zeros(2, 8, 16), 40, None)


def test_the_checked_ops_compute_what_the_kernels_do() -> None:
    from radixserve.plugins.hardware.cpu_kernels import checked, load

    gen = torch.Generator().manual_seed(3)
    x, residual, w = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen), \
        torch.randn(8, generator=gen)  # fmt: skip
    cos, sin = torch.randn(16, 4, generator=gen), torch.randn(16, 4, generator=gen)
    q, positions = torch.randn(3, 2, 8, generator=gen), torch.tensor([0, 7, 15])
    ops, raw = checked(), load()
    assert torch.equal(ops.rms_norm(x, w, 1e-6), raw.rms_norm(x, w, 1e-6))
    for got, want in zip(ops.add_rms_norm(x, residual, w, 1e-6),
                         raw.add_rms_norm(x, residual, w, 1e-6), strict=True):  # fmt: skip
        assert torch.equal(got, want)
    assert torch.equal(ops.silu_mul(x), raw.silu_mul(x))
    assert torch.equal(ops.rope(q, positions, cos, sin), raw.rope(q, positions, cos, sin))


def test_the_cpu_model_uses_them_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.plugins.hardware import cpu_fused_ops
    from radixserve.plugins.models.kernel_choice import fused_ops_for

    assert fused_ops_for("cpu") is cpu_fused_ops
    monkeypatch.setenv("RADIXSERVE_CPU_FUSED_OPS", "0")
    assert fused_ops_for("cpu") is None
