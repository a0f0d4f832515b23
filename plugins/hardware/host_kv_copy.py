"""HiCache's per-layer load: one layer's K and V rows gathered from pinned host memory straight
into the device KV pool by a Triton kernel (``CudaPlatform.host_kv_layer_copy``).

Pinned host buffers are mapped into the GPU's address space (unified virtual addressing), so a
kernel can read them over the bus by row, with no staging tensor and no copy per run of host
slots: one launch per layer whatever the slots' order, which is what lets a step's forward wait
for its KV layer by layer (core/hicache_pool.py). Rows are moved as raw bits (an integer type
of the element's width), so FP8 and bfloat16 pools take the same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@triton.jit
def _gather_rows(
    src_k, src_v, src_rows, dst_k, dst_v, dst_rows, src_stride,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # one program per row: K's and V's elements of source row src_rows[i] -> dst_rows[i]
    i = tl.program_id(0)
    src = tl.load(src_rows + i).to(tl.int64) * src_stride
    dst = tl.load(dst_rows + i).to(tl.int64) * ROW
    for start in tl.static_range(0, ROW, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < ROW
        tl.store(dst_k + dst + offs, tl.load(src_k + src + offs, mask=mask), mask=mask)
        tl.store(dst_v + dst + offs, tl.load(src_v + src + offs, mask=mask), mask=mask)


def copy_layer_rows(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    src_rows: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """``dst_k[dst_rows] = src_k[src_rows]`` and the same for V. ``src_*``: [rows, heads,
    head_dim] views (pinned host memory, or device), each row contiguous, K and V with one
    row stride; ``dst_*``: contiguous [rows, heads, head_dim] buffers; rows: int64 tensors on
    the device. Queued on the current stream."""
    n = len(src_rows)
    if n == 0:
        return
    row = dst_k[0].numel()
    if src_k.stride() != src_v.stride() or src_k[0].numel() != row or not src_k[0].is_contiguous():
        raise ValueError("K and V sources must have one row stride and rows as long as dst's")
    bits = _BITS[dst_k.element_size()]
    block = min(triton.next_power_of_2(row), 4096)
    _gather_rows[(n,)](
        src_k.view(bits), src_v.view(bits), src_rows, dst_k.view(bits), dst_v.view(bits),
        dst_rows, src_k.stride(0), ROW=row, BLOCK=block, num_warps=4,
    )  # fmt: skip


def reads_host_memory(device: str) -> bool:
    """Whether the kernel reads pinned host memory on ``device`` (unified addressing), tried
    once on a few rows."""
    src = torch.arange(2 * 4 * 8, dtype=torch.float32).view(2 * 4, 1, 8).pin_memory()
    dst = torch.zeros((4, 1, 8), device=device)
    rows = torch.tensor([3, 0, 2, 1], device=device)
    try:
        copy_layer_rows(src[::2], src[1::2], rows, dst, dst.clone(), rows)
        torch.cuda.synchronize(device)
    except (ValueError, RuntimeError):
        return False
    return bool(torch.equal(dst.cpu(), src[::2]))
