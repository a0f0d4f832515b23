"""core/hicache_pool.py's HostKVPool alone, on a real CPU device pool: its size and token
shape, the copies between the device and the host pool in both layouts, storage pages read
and written, and the refused io backend (milliseconds a test; test_hicache.py runs it in the
engine)."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.config_checks import ConfigError
from radixserve.core.hicache_pool import HostKVPool
from radixserve.core.memory import KVPool

LAYERS, HEADS, HEAD_DIM = 3, 2, 4
LAYOUTS = ("layer_first", "page_first")


def device_pool(
    dtype: torch.dtype = torch.float32, layers: int = LAYERS, device: str = "cpu"
) -> KVPool:
    """A device pool (on the CPU unless told) whose every K and V element is distinct."""
    pool = KVPool(16, layers, HEADS, HEAD_DIM, dtype, device)
    per_layer = pool.k[0].numel()
    for layer in range(layers):
        shape = pool.k[layer].shape
        base = 2 * layer * per_layer
        pool.k[layer].copy_(torch.arange(base, base + per_layer).view(shape))
        pool.v[layer].copy_(torch.arange(base + per_layer, base + 2 * per_layer).view(shape))
    return pool


def test_size_shape_and_bytes_per_token() -> None:
    dev = device_pool(torch.float16)
    host = HostKVPool(dev, 43, 4, "layer_first", "direct")  # pages 1..10 (page 0 pads)
    assert host.size == 40 and host.allocator.size == 40 and host.allocator.page_size == 4
    assert host.num_layers == LAYERS
    assert host.token_shape == (HEADS, HEAD_DIM)
    assert host.dtype == torch.float16
    assert len(host.k) == len(host.v) == LAYERS
    assert host.k[0].shape == (44, HEADS, HEAD_DIM)  # slots 0..43, as on the device
    assert host.v[LAYERS - 1].shape == (44, HEADS, HEAD_DIM)
    assert host.k[0].dtype == host.v[0].dtype == torch.float16
    assert not host.k[0].is_pinned()
    paged = HostKVPool(dev, 42, 4, "page_first", "direct")
    assert paged.size == 36  # whole pages: 1..9
    assert paged.buf.shape == (43, LAYERS, 2, HEADS, HEAD_DIM)
    assert paged.buf.dtype == torch.float16
    assert paged.page_shape(8) == (8, LAYERS, 2, HEADS, HEAD_DIM)
    # K and V of every layer: 2 * 3 * (2 * 4) elements of 2 bytes
    assert HostKVPool.bytes_per_token(dev) == 2 * LAYERS * HEADS * HEAD_DIM * 2
    assert HostKVPool.bytes_per_token(device_pool()) == 2 * LAYERS * HEADS * HEAD_DIM * 4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_then_load_moves_each_slots_kv(layout: str) -> None:
    dev = device_pool()
    host = HostKVPool(dev, 20, 1, layout, "direct")
    want_k = [dev.k[layer][[3, 5, 6]].clone() for layer in range(LAYERS)]
    want_v = [dev.v[layer][[3, 5, 6]].clone() for layer in range(LAYERS)]
    host.backup(torch.tensor([3, 5, 6]), torch.tensor([10, 2, 17]))
    pages = host.read_pages(torch.tensor([10, 2, 17]))
    assert pages.shape == host.page_shape(3)
    assert pages.is_contiguous()
    for layer in range(LAYERS):
        assert torch.equal(pages[:, layer, 0], want_k[layer])
        assert torch.equal(pages[:, layer, 1], want_v[layer])
    untouched = host.read_pages(torch.tensor([1, 3, 11]))
    assert not untouched.any()
    for layer in range(LAYERS):  # the device slots are overwritten, then loaded back
        dev.k[layer].zero_()
        dev.v[layer].zero_()
    host.load(torch.tensor([17, 10]), torch.tensor([8, 1]))
    for layer in range(LAYERS):
        assert torch.equal(dev.k[layer][[1, 8]], want_k[layer][[0, 2]])
        assert torch.equal(dev.v[layer][[1, 8]], want_v[layer][[0, 2]])
        others = [s for s in range(dev.k[layer].shape[0]) if s not in (1, 8)]
        assert not dev.k[layer][others].any() and not dev.v[layer][others].any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_storage_pages_written_are_read_and_loaded_back(layout: str) -> None:
    dev = device_pool()
    host = HostKVPool(dev, 20, 1, layout, "direct")
    data = torch.arange(2 * LAYERS * 2 * HEADS * HEAD_DIM, dtype=torch.float32)
    data = data.view(host.page_shape(2)) + 1
    host.write_pages(torch.tensor([4, 9]), data)
    assert torch.equal(host.read_pages(torch.tensor([4, 9])), data)
    assert torch.equal(host.read_pages(torch.tensor([9])), data[1:])
    assert not host.read_pages(torch.tensor([5, 8])).any()
    host.load(torch.tensor([9]), torch.tensor([2]))
    for layer in range(LAYERS):
        assert torch.equal(dev.k[layer][2], data[1, layer, 0])
        assert torch.equal(dev.v[layer][2], data[1, layer, 1])


def test_the_two_layouts_hold_the_same_pages() -> None:
    dev = device_pool()
    hosts = [HostKVPool(dev, 20, 1, layout, "direct") for layout in LAYOUTS]
    for host in hosts:
        host.backup(torch.tensor([1, 2, 7]), torch.tensor([5, 6, 3]))
    first, second = (h.read_pages(torch.tensor([3, 5, 6])) for h in hosts)
    assert torch.equal(first, second) and first.any()


def test_the_kernel_io_backend_needs_a_cuda_pool() -> None:
    with pytest.raises(ConfigError) as err:
        HostKVPool(device_pool(), 20, 1, "layer_first", "kernel")
    assert str(err.value) == (
        "--hicache-io-backend kernel needs a CUDA device pool; use direct on cpu"
    )


def test_a_pool_of_one_layer() -> None:
    dev = device_pool(layers=1)
    host = HostKVPool(dev, 20, 1, "layer_first", "direct")
    assert host.num_layers == 1 and len(host.k) == 1
    assert HostKVPool.bytes_per_token(dev) == 2 * HEADS * HEAD_DIM * 4
    want = dev.k[0][[2, 4]].clone()
    host.backup(torch.tensor([2, 4]), torch.tensor([7, 8]))
    dev.k[0].zero_()
    host.load(torch.tensor([8, 7]), torch.tensor([1, 3]))
    assert torch.equal(dev.k[0][[3, 1]], want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copies_between_a_cuda_pool_and_pinned_host_memory(layout: str, io_backend: str) -> None:
    """On CUDA the host buffers are pinned; with the kernel backend the copies run on a copy
    stream that the compute stream waits for."""
    dev = device_pool(device="cuda")
    host = HostKVPool(dev, 20, 1, layout, io_backend)
    buffers = [host.buf] if layout == "page_first" else [*host.k, *host.v]
    assert all(b.device.type == "cpu" and b.is_pinned() for b in buffers)
    want_k = [dev.k[layer][[3, 5]].cpu() for layer in range(LAYERS)]
    want_v = [dev.v[layer][[3, 5]].cpu() for layer in range(LAYERS)]
    host.backup(torch.tensor([3, 5]), torch.tensor([10, 2]))
    for layer in range(LAYERS):
        dev.k[layer].zero_()
        dev.v[layer].zero_()
    host.load(torch.tensor([2, 10]), torch.tensor([1, 8]))
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(dev.k[layer][[8, 1]].cpu(), want_k[layer])
        assert torch.equal(dev.v[layer][[8, 1]].cpu(), want_v[layer])
