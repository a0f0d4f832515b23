"""The C++ CPU kernels behind checks written in Python: every operand's type, dtype, device,
shape, layout and the values that index memory (slots, positions) is checked here, with the
kernels' own messages, so bad input raises ``KernelInputError`` before any C++ runs.

Why not rely on the kernels' ``TORCH_CHECK``s alone: they throw a C++ exception that must cross
from this separately compiled library into torch's dispatcher and its Python binding. On torch
2.13 (CPU) that arrives as a RuntimeError, but on a CUDA build of torch 2.11 the same failures
crashed the interpreter (a segmentation fault in each test that handed a kernel bad input), and
nothing the library controls makes such a crossing safe on every build of torch that the
dependency range admits. ``decode_attention`` also reads K/V rows at the slots it is given
without a bounds check (the hot path's slots come from the allocator): a bad slot there is an
out-of-bounds read, caught only here.

The engine's own layers call the kernels directly (``cpu_kernels.load()``): their operands are
built to fit, and a few microseconds of checks on each of ~200 calls a token would be a
measurable share of a CPU decode step. Anything else calls them through
``cpu_kernels.checked()``.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

Q4_BLOCK = 32  # q4_linear.cpp kBlock: input features per block
Q4_BLOCK_BYTES = 20  # kBlockBytes: a block's scale, minimum and 32 4-bit codes
F32_PANEL = 16  # f32_linear.cpp kPanel: output features per packed panel
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class KernelInputError(RuntimeError):
    """An operand a CPU kernel cannot take (a RuntimeError, as the kernel's own check is)."""


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise KernelInputError(message)


def _cpu(op: str, **tensors: Any) -> None:
    for name, t in tensors.items():
        _need(isinstance(t, torch.Tensor), f"{op}: {name} must be a tensor, not {type(t).__name__}")
        _need(t.device.type == "cpu", f"{op}: {name} is on {t.device}; the kernel runs on the CPU")


def _index_range(op: str, what: str, values: torch.Tensor, low: int, high: int) -> None:
    """Every value in [low, high), else the first one outside, in the kernel's words."""
    if values.numel() == 0:
        return
    bad = (values < low) | (values >= high)
    if bool(bad.any()):
        first = int(values[bad][0])
        raise KernelInputError(f"{op}: {what} {first} outside the {_of(op, high)}")


def _of(op: str, high: int) -> str:
    return f"table of {high} positions" if op == "rope" else f"pool of {high}"


def _decode_operands(
    op: str, q: Any, k_buf: Any, v_buf: Any, slots: Any, starts: Any, lens: Any
) -> None:
    _cpu(op, q=q, k_buf=k_buf, v_buf=v_buf, slots=slots, starts=starts, lens=lens)
    _need(q.dim() == 3 and q.dtype == torch.float32 and q.is_contiguous(),
          f"{op}: q must be a contiguous float32 [decodes, heads, dim] tensor")  # fmt: skip
    _need(k_buf.dim() == 3 and k_buf.dtype in KV_DTYPES and k_buf.stride(2) == 1
          and k_buf.stride(1) == k_buf.size(2) and k_buf.size(2) == q.size(2),
          f"{op}: k_buf must be float32, float16 or bfloat16 [slots, kv_heads, dim] with dense "
          "rows")  # fmt: skip
    _need(v_buf.shape == k_buf.shape and v_buf.stride() == k_buf.stride()
          and v_buf.dtype == k_buf.dtype, f"{op}: v_buf must match k_buf")  # fmt: skip
    _need(k_buf.size(1) > 0 and q.size(1) % k_buf.size(1) == 0,
          f"{op}: heads not a multiple of kv_heads")  # fmt: skip
    nd = q.size(0)
    for t in (slots, starts, lens):
        _need(t.dtype == torch.int64 and t.is_contiguous() and t.dim() >= 1 and t.size(0) == nd,
              f"{op}: slots, starts and lens must be contiguous int64, a row each")  # fmt: skip
    _need(slots.dim() == 2, f"{op}: slots must be [decodes, max_len]")
    _need(starts.dim() == 1 and lens.dim() == 1, f"{op}: starts and lens must be [decodes]")
    max_len = slots.size(1)
    _need(bool(((starts >= 0) & (starts <= lens) & (lens <= max_len)).all()),
          f"{op}: need 0 <= starts <= lens <= slots.size(1)")  # fmt: skip
    # the kernel reads K/V at each row's slots starts[b] .. lens[b] - 1, unchecked
    cols = torch.arange(max_len)
    used = (cols >= starts[:, None]) & (cols < lens[:, None])
    _index_range(op, "slot", slots[used], 0, k_buf.size(0))


def decode_attention(
    q: Any, k_buf: Any, v_buf: Any, slots: Any, starts: Any, lens: Any, scale: float,
    softcap: float,
) -> torch.Tensor:  # fmt: skip
    """q [decodes, heads, dim] attends row b's keys at slots[b, starts[b]:lens[b]]."""
    _decode_operands("decode_attention", q, k_buf, v_buf, slots, starts, lens)
    return _library().decode_attention(q, k_buf, v_buf, slots, starts, lens, scale, softcap)


def store_decode_attention(
    q: Any, k_new: Any, v_new: Any, loc: Any, k_buf: Any, v_buf: Any, slots: Any, starts: Any,
    lens: Any, scale: float, softcap: float,
) -> torch.Tensor:  # fmt: skip
    """Store k_new, v_new at slots ``loc`` of the pool, then ``decode_attention``."""
    op = "store_decode_attention"
    _cpu(op, k_new=k_new, v_new=v_new, loc=loc)
    _need(k_new.dim() == 3 and k_new.dtype == torch.float32 and v_new.shape == k_new.shape
          and v_new.dtype == torch.float32 and isinstance(k_buf, torch.Tensor)
          and k_buf.dim() == 3 and k_new.shape[1:] == k_buf.shape[1:],
          f"{op}: k_new and v_new must be float32 [decodes, kv_heads, dim] matching the "
          "pool")  # fmt: skip
    _need(loc.dim() == 1 and loc.dtype == torch.int64 and loc.size(0) == k_new.size(0),
          f"{op}: loc must be int64 [decodes]")  # fmt: skip
    _cpu(op, k_buf=k_buf, v_buf=v_buf)
    _need(k_buf.is_contiguous() and v_buf.is_contiguous() and v_buf.shape == k_buf.shape
          and v_buf.dtype == k_buf.dtype,
          f"{op}: k_buf and v_buf must be contiguous and alike")  # fmt: skip
    _index_range(op, "slot", loc, 0, k_buf.size(0))
    _decode_operands(op, q, k_buf, v_buf, slots, starts, lens)
    return _library().store_decode_attention(
        q, k_new, v_new, loc, k_buf, v_buf, slots, starts, lens, scale, softcap
    )


def _rows(op: str, x: Any, name: str = "x") -> None:
    _cpu(op, **{name: x})
    _need(x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1,
          f"{op}: expected a float32 [rows, features] tensor with unit feature stride")  # fmt: skip


def _norm_weight(op: str, weight: Any, features: int) -> None:
    _cpu(op, weight=weight)
    _need(weight.is_contiguous() and weight.dtype == torch.float32
          and weight.numel() == features, f"{op}: weight must be float32 [features]")  # fmt: skip


def rms_norm(x: Any, weight: Any, eps: float) -> torch.Tensor:
    _rows("rms_norm", x)
    _norm_weight("rms_norm", weight, x.size(1))
    return _library().rms_norm(x, weight, eps)


def add_rms_norm(
    x: Any, residual: Any, weight: Any, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    _rows("add_rms_norm", x)
    _rows("add_rms_norm", residual, "residual")
    _need(x.shape == residual.shape, "add_rms_norm: x and residual differ in shape")
    _norm_weight("add_rms_norm", weight, x.size(1))
    return _library().add_rms_norm(x, residual, weight, eps)


def silu_mul(x: Any) -> torch.Tensor:
    _rows("silu_mul", x)
    _need(x.size(1) % 2 == 0, "silu_mul: expected [rows, 2 * n]")
    return _library().silu_mul(x)


def rope(x: Any, positions: Any, cos: Any, sin: Any) -> torch.Tensor:
    op = "rope"
    _cpu(op, x=x, positions=positions, cos=cos, sin=sin)
    _need(x.dim() == 3 and x.dtype == torch.float32 and x.stride(2) == 1,
          "rope: expected float32 [tokens, heads, dim] with unit dim stride")  # fmt: skip
    _need(positions.dtype == torch.int64 and positions.is_contiguous()
          and positions.numel() == x.size(0), "rope: positions must be int64 [tokens]")  # fmt: skip
    _need(cos.dim() == 2 and cos.is_contiguous() and sin.is_contiguous()
          and cos.dtype == torch.float32 and sin.dtype == torch.float32
          and cos.size(1) == x.size(2) // 2 and sin.shape == cos.shape,
          "rope: cos and sin must be float32 [positions, dim / 2]")  # fmt: skip
    _index_range(op, "position", positions, 0, cos.size(0))
    return _library().rope(x, positions, cos, sin)


def q4_1_linear(x: Any, blocks: Any) -> torch.Tensor:
    op = "q4_1_linear"
    _cpu(op, x=x, blocks=blocks)
    _need(x.dim() == 2 and x.dtype == torch.float32,
          f"{op}: x must be float32 [rows, in_features]")  # fmt: skip
    _need(blocks.dim() == 2 and blocks.dtype == torch.uint8 and blocks.is_contiguous(),
          f"{op}: blocks must be contiguous uint8 "
          "[out_features, in_features / 32 * 20]")  # fmt: skip
    features = x.size(1)
    _need(features % Q4_BLOCK == 0 and blocks.size(1) == features // Q4_BLOCK * Q4_BLOCK_BYTES,
          f"{op}: {features} input features do not match blocks of shape "
          f"{list(blocks.shape)}")  # fmt: skip
    return _library().q4_1_linear(x, blocks)


def linear_f32_packed(x: Any, packed: Any, n: int, bias: Any = None) -> torch.Tensor:
    op = "linear_f32_packed"
    _cpu(op, x=x, packed=packed)
    _need(x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1,
          f"{op}: x must be float32 [rows, in_features] with unit stride")  # fmt: skip
    _need(packed.dim() == 3 and packed.dtype == torch.float32 and packed.is_contiguous()
          and packed.size(2) == F32_PANEL and packed.size(1) == x.size(1)
          and packed.data_ptr() % 64 == 0,
          f"{op}: packed must be float32 [panels, in_features, 16], contiguous and 64-byte "
          "aligned")  # fmt: skip
    panels = packed.size(0)
    _need(isinstance(n, int) and 0 < n <= panels * F32_PANEL and n > (panels - 1) * F32_PANEL,
          f"{op}: {n} features do not fill {panels} panels")  # fmt: skip
    if bias is not None:
        _cpu(op, bias=bias)
        _need(bias.dtype == torch.float32 and bias.is_contiguous() and bias.numel() == n,
              f"{op}: bias must be float32 [out_features]")  # fmt: skip
    return _library().linear_f32_packed(x, packed, n, bias)


def _library() -> Any:
    # the ops ``load()`` (cpu_kernels/__init__.py) registered; ``checked()`` loads them first
    return torch.ops.radixserve_cpu


@cache
def checked_ops() -> SimpleNamespace:
    """The kernels as ``load()`` has them (it must have run), each behind its checks."""
    return SimpleNamespace(
        decode_attention=decode_attention,
        store_decode_attention=store_decode_attention,
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        silu_mul=silu_mul,
        rope=rope,
        q4_1_linear=q4_1_linear,
        linear_f32_packed=linear_f32_packed,
        linear_f32_vectorized=lambda: bool(_library().linear_f32_vectorized()),
    )
