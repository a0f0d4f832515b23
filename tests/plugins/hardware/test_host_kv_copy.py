"""plugins/hardware/host_kv_copy.py: HiCache's per-layer gather of KV rows from host buffers
into the device pool, against indexed copies; on the CPU under the Triton interpreter
(tests/conftest.py turns it on without CUDA), from pinned host memory on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.plugins.hardware.host_kv_copy import copy_layer_rows  # noqa: E402

LAYERS, HEADS, HEAD_DIM, ROWS = 3, 2, 8, 40
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _host(layout: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Host K and V of layer 1 as HostKVPool keeps them: views of [rows, layers, 2, heads,
    head_dim] (page_first) or their own [rows, heads, head_dim] buffers (layer_first)."""
    gen = torch.Generator().manual_seed(0)
    if layout == "page_first":
        buf = torch.randn((ROWS, LAYERS, 2, HEADS, HEAD_DIM), generator=gen).to(dtype)
        buf = buf.pin_memory() if CUDA else buf
        return buf[:, 1, 0], buf[:, 1, 1]
    k, v = (torch.randn((ROWS, HEADS, HEAD_DIM), generator=gen).to(dtype) for _ in range(2))
    return (k.pin_memory(), v.pin_memory()) if CUDA else (k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_rows_land_where_indexed_copies_put_them(layout: str, dtype: torch.dtype) -> None:
    src_k, src_v = _host(layout, dtype)
    dst_k, dst_v = (torch.zeros((ROWS, HEADS, HEAD_DIM), dtype=dtype, device=DEVICE)
                    for _ in range(2))  # fmt: skip
    src_rows = torch.tensor([7, 3, 30, 31, 32, 1, 19], dtype=torch.int64)
    dst_rows = torch.tensor([2, 9, 10, 11, 39, 5, 1], dtype=torch.int64)
    copy_layer_rows(
        src_k, src_v, src_rows.to(DEVICE), dst_k, dst_v, dst_rows.to(DEVICE)
    )  # fmt: skip
    want_k = torch.zeros((ROWS, HEADS, HEAD_DIM), dtype=dtype)
    want_v = want_k.clone()
    want_k[dst_rows], want_v[dst_rows] = src_k[src_rows], src_v[src_rows]
    bits = torch.uint8 if dtype.itemsize == 1 else dtype  # FP8 compares by its bits
    assert torch.equal(dst_k.cpu().view(bits), want_k.view(bits))
    assert torch.equal(dst_v.cpu().view(bits), want_v.view(bits))


def test_no_rows_launch_nothing_and_mismatched_sources_are_refused() -> None:
    src_k, src_v = _host("page_first", torch.float32)
    dst = torch.zeros((ROWS, HEADS, HEAD_DIM), device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    copy_layer_rows(src_k, src_v, none, dst, dst, none)
    assert not dst.any()
    rows = torch.tensor([1], device=DEVICE)
    with pytest.raises(ValueError, match="row stride"):
        copy_layer_rows(src_k, src_v.contiguous(), rows, dst, dst, rows)
    with pytest.raises(ValueError, match="rows as long"):
        copy_layer_rows(src_k[:, :1], src_v[:, :1], rows, dst, dst, rows)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_the_gpu_reads_pinned_host_memory() -> None:
    """What the CUDA platform checks before it hands HiCache the kernel."""
    from radixserve.plugins.hardware.host_kv_copy import reads_host_memory

    assert reads_host_memory("cuda")
