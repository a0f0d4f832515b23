"""core/hicache_pool.py's HostKVPool alone, on a real CPU device pool: its size and token
shape, the copies between the device and the host pool in both layouts, storage pages read
and written, and the refused io backend (milliseconds a test; test_hicache.py runs it in the
engine)."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.config_checks import ConfigError
from radixserve.core.hicache_pool import HostKVPool, _chunks, slot_runs
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


def load_now(host: HostKVPool, *args: object) -> None:
    """``HostKVPool.load`` queues until the next forward: queue and issue at once."""
    host.load(*args)  # type: ignore[arg-type]
    host.issue_loads()


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
    load_now(host, torch.tensor([17, 10]), torch.tensor([8, 1]))
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
    load_now(host, torch.tensor([9]), torch.tensor([2]))
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
    load_now(host, torch.tensor([8, 7]), torch.tensor([1, 3]))
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
    load_now(host, torch.tensor([2, 10]), torch.tensor([1, 8]))
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(dev.k[layer][[8, 1]].cpu(), want_k[layer])
        assert torch.equal(dev.v[layer][[8, 1]].cpu(), want_v[layer])


# -- copies by runs of host slots: the same result as indexed copies, slot by slot -----------


def indexed_backup(host: HostKVPool, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
    """What backup did before copies went by runs: one indexed copy per layer's K and V."""
    dev = host.device_pool
    for layer in range(host.num_layers):
        if host.layout == "page_first":
            host.buf[host_slots, layer, 0] = dev.k[layer][device_slots]
            host.buf[host_slots, layer, 1] = dev.v[layer][device_slots]
        else:
            host.k[layer][host_slots] = dev.k[layer][device_slots]
            host.v[layer][host_slots] = dev.v[layer][device_slots]


def host_state(host: HostKVPool) -> list[torch.Tensor]:
    return [host.buf] if host.layout == "page_first" else [*host.k, *host.v]


def paged_slots(pages: list[int], page: int) -> torch.Tensor:
    return torch.tensor([p * page + i for p in pages for i in range(page)])


# host slots: a single run, one page, pages in order with a gap, pages shuffled (many runs),
# slots scattered one by one
HOST_CASES = {
    "single run": list(range(9, 9 + 24)),
    "one page": paged_slots([3], 4).tolist(),
    "pages with a gap": paged_slots([1, 2, 3, 7, 8], 4).tolist(),
    "shuffled pages": paged_slots([9, 2, 14, 5, 11, 1, 7, 12, 3, 10, 4, 13], 4).tolist(),
    "scattered": [40, 3, 17, 25, 8, 31, 12, 57, 1, 44, 20, 50],
}


@pytest.mark.parametrize("by_runs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", HOST_CASES)
def test_run_copies_equal_indexed_copies(
    layout: str, dtype: torch.dtype, case: str, by_runs: bool
) -> None:
    """Backup and load give what indexed copies give, on the CPU pool's default path (gather /
    scatter on the host) and by runs of host slots (CUDA's path)."""
    host_slots = torch.tensor(HOST_CASES[case])
    n = len(host_slots)
    dev = KVPool(64, LAYERS, HEADS, HEAD_DIM, dtype, "cpu")
    for t in [*dev.k, *dev.v]:
        t.normal_(generator=torch.Generator().manual_seed(t.data_ptr() % 1000))
    device_slots = torch.randperm(64, generator=torch.Generator().manual_seed(n))[:n] + 1
    got, want = (HostKVPool(dev, 64, 4, layout, "direct") for _ in range(2))
    assert got.run_copy_max_runs == 0  # on the CPU
    if by_runs:
        got.run_copy_max_runs = 1 << 30
    got.backup(device_slots, host_slots)
    indexed_backup(want, device_slots, host_slots)
    for g, w in zip(host_state(got), host_state(want), strict=True):
        assert torch.equal(g, w)
    assert host_state(got)[0][host_slots].any()
    # load back into other device slots, in another scattered order
    target = torch.randperm(64, generator=torch.Generator().manual_seed(n + 1))[:n] + 1
    before = [t.clone() for t in [*dev.k, *dev.v]]
    load_now(got, host_slots, target)
    for i, t in enumerate([*dev.k, *dev.v]):
        expect = before[i].clone()
        expect[target] = before[i][device_slots]
        assert torch.equal(t, expect)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("max_runs", [0, 1000])
def test_chunked_staging_and_both_load_paths(layout: str, max_runs: int) -> None:
    """Staging smaller than a copy splits it into chunks (runs split across them); layer_first
    loads gather on the host past ``run_copy_max_runs`` runs, and copy runs below."""
    dev = device_pool()
    host = HostKVPool(dev, 40, 4, layout, "direct")
    host.run_copy_max_runs = max_runs
    per_token = HostKVPool.bytes_per_token(dev) // (1 if layout == "page_first" else 2 * LAYERS)
    host.staging_bytes = 3 * per_token  # chunks of 3 slots
    assert host._chunk_tokens() == 3
    device_slots = torch.tensor([16, 2, 9, 4, 11, 6, 13])
    host_slots = torch.tensor([5, 6, 7, 8, 21, 22, 3])
    host.backup(device_slots, host_slots)
    pages = host.read_pages(host_slots)
    for layer in range(LAYERS):
        assert torch.equal(pages[:, layer, 0], dev.k[layer][device_slots])
        assert torch.equal(pages[:, layer, 1], dev.v[layer][device_slots])
    for t in [*dev.k, *dev.v]:
        t.zero_()
    load_now(host, host_slots, torch.tensor([1, 3, 5, 7, 9, 12, 15]))
    for layer in range(LAYERS):
        assert torch.equal(dev.k[layer][[1, 3, 5, 7, 9, 12, 15]], pages[:, layer, 0])
        assert torch.equal(dev.v[layer][[1, 3, 5, 7, 9, 12, 15]], pages[:, layer, 1])
    assert int((dev.k[0] != 0).any(dim=(1, 2)).sum()) == 7


class CopyCalls(torch.overrides.TorchFunctionMode):
    """Counts ``Tensor.copy_`` calls: the run path's cost is its number of copies."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_run_copies_make_one_copy_per_run(layout: str) -> None:
    """By runs, a page_first copy moves every layer of a run at once and a layer_first one a
    layer's K or V, in chunks of ``staging_bytes``; a layer_first load with more than
    ``run_copy_max_runs`` runs (and exactly that many: still by runs) gathers instead."""
    dev = device_pool()
    host = HostKVPool(dev, 40, 4, layout, "direct")
    host.run_copy_max_runs = 2
    host_slots = paged_slots([1, 5], 4)  # two runs of 4
    device_slots = torch.tensor([3, 1, 4, 15, 9, 2, 6, 5])
    per_run = 1 if layout == "page_first" else 2 * LAYERS
    with CopyCalls() as calls:
        host.backup(device_slots, host_slots)
    assert calls.count == 2 * per_run
    with CopyCalls() as calls:
        load_now(host, host_slots, device_slots)
    assert calls.count == 2 * per_run
    per_token = HostKVPool.bytes_per_token(dev) // (1 if layout == "page_first" else 2 * LAYERS)
    host.staging_bytes = per_token // 2  # less than a token: chunks of one slot
    with CopyCalls() as calls:
        load_now(host, host_slots, device_slots)
    assert calls.count == 8 * per_run
    host.run_copy_max_runs = 1
    with CopyCalls() as calls:
        load_now(host, host_slots, device_slots)
    assert calls.count == 0  # gathered on the host: index_select and index_copy_ only


def test_an_empty_copy_moves_nothing() -> None:
    dev = device_pool()
    host = HostKVPool(dev, 20, 1, "page_first", "direct")
    empty = torch.tensor([], dtype=torch.int64)
    host.backup(empty, empty)
    load_now(host, empty, empty)
    assert not host.buf.any()


@pytest.mark.parametrize(
    ("slots", "runs"),
    [
        ([], []),
        ([7], [(7, 1)]),
        ([3, 4, 5, 6], [(3, 4)]),
        ([9, 2, 14, 5], [(9, 1), (2, 1), (14, 1), (5, 1)]),
        ([4, 5, 6, 7, 16, 17, 18, 19, 8, 9], [(4, 4), (16, 4), (8, 2)]),
        ([5, 5, 6, 4], [(5, 1), (5, 2), (4, 1)]),  # a repeat or a step back starts a run
    ],
)
def test_slot_runs(slots: list[int], runs: list[tuple[int, int]]) -> None:
    assert slot_runs(torch.tensor(slots, dtype=torch.int64)) == runs


def test_chunks_split_runs_at_the_limit() -> None:
    runs = [(10, 5), (30, 2), (50, 4)]
    assert list(_chunks(runs, 4)) == [
        (0, 4, [(10, 4)]),
        (4, 4, [(14, 1), (30, 2), (50, 1)]),
        (8, 3, [(51, 3)]),
    ]
    assert list(_chunks(runs, 100)) == [(0, 11, runs)]
    assert list(_chunks([], 4)) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_backup_is_asynchronous_and_host_readers_wait(layout: str, io_backend: str) -> None:
    """A backup queued behind slow device work returns before its copies ran; read_pages and
    write_pages wait for them, and a load after a host write sees the written page."""
    dev = device_pool(device="cuda")
    host = HostKVPool(dev, 64, 4, layout, io_backend)
    slots = torch.tensor([*range(8, 12), *range(20, 24)])
    want = [dev.k[layer][[1, 2, 3, 4, 5, 6, 7, 8]].cpu() for layer in range(LAYERS)]
    torch.cuda._sleep(200_000_000)  # the device busy for ~0.1 s: the copies queue behind it
    host.backup(torch.arange(1, 9), slots)
    assert host.streams.pending_backup is not None and not host.streams.pending_backup.query()
    pages = host.read_pages(slots)
    assert host.streams.pending_backup is None
    for layer in range(LAYERS):
        assert torch.equal(pages[:, layer, 0], want[layer])
    data = pages + 1
    torch.cuda._sleep(200_000_000)
    load_now(host, slots, torch.arange(1, 9))
    host.write_pages(slots, data)  # waits for the queued load's reads of the old page
    load_now(host, slots, torch.arange(9, 17))
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(dev.k[layer][1:9].cpu(), want[layer])
        assert torch.equal(dev.k[layer][9:17].cpu(), data[:, layer, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_cuda_host_gather_waits_for_a_queued_backup(io_backend: str) -> None:
    """A layer_first load past run_copy_max_runs gathers on the host: it must read what a
    backup still queued behind device work writes there."""
    dev = device_pool(device="cuda")
    host = HostKVPool(dev, 64, 1, "layer_first", io_backend)
    host.run_copy_max_runs = 0
    want = [dev.k[layer][1:5].cpu() for layer in range(LAYERS)]
    torch.cuda._sleep(200_000_000)
    host.backup(torch.arange(1, 5), torch.tensor([30, 10, 50, 20]))
    load_now(host, torch.tensor([30, 10, 50, 20]), torch.arange(9, 13))
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(dev.k[layer][9:13].cpu(), want[layer])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_backups_hold_up_neither_steps_nor_loads_of_other_pages(layout: str) -> None:
    """With copy streams a backup held up on its stream does not hold up the compute stream;
    a fence on its event orders the next write of its device slots after it, and a load of
    its host slots waits for it (the backup stream is held up by a sleep queued on it, so a
    missing wait would read or write too early every time)."""
    dev = device_pool(device="cuda")
    host = HostKVPool(dev, 64, 4, layout, "kernel")
    slots = torch.tensor([*range(8, 12), *range(20, 24)])
    want = [dev.k[layer][1:9].cpu() for layer in range(LAYERS)]
    with torch.cuda.stream(host.streams.backup_stream):
        torch.cuda._sleep(500_000_000)  # the backup stream busy for ~0.3 s
    backup = host.backup(torch.arange(1, 9), slots)
    assert backup is not None
    step = torch.cuda.Event()
    step.record()  # the compute stream's work after the backup: not ordered after it
    step.synchronize()
    assert not backup.query()
    host.fence(backup)  # the slots are freed: a step writes them only after the backup read
    for layer in range(LAYERS):
        dev.k[layer][1:9].zero_()
    load_now(host, slots, torch.arange(9, 17), (backup,))  # reads what the backup wrote
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(dev.k[layer][9:17].cpu(), want[layer])
        assert not dev.k[layer][1:9].any()


def test_direct_copies_run_in_the_compute_streams_order() -> None:
    """``direct`` on a CPU pool: the copies run in place, with no events to fence or wait for
    (the kernel mode's waits are the gpu-marked tests')."""
    from radixserve.core.hicache_streams import CopyStreams

    streams = CopyStreams(torch.device("cpu"), "direct")
    ran = []
    with streams.backup():
        ran.append("backup")
    assert streams.backup_event() is None and streams.pending_backup is None
    with streams.load((None,)):
        ran.append("load")
    assert ran == ["backup", "load"] and streams.pending_load is None
    streams.fence(None)
    streams.wait()
    dev = device_pool()
    host = HostKVPool(dev, 64, 4, "page_first", "direct")
    assert host.backup(torch.arange(1, 5), torch.arange(8, 12)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_layer_loads_leave_the_compute_stream_free_and_order_each_layer(layout: str) -> None:
    """Per-layer loads (the Triton gather from pinned host memory) on a load stream held up by
    a sleep: the compute stream does not wait for them as a whole, and a read of a layer after
    ``wait_layer`` sees that layer's loaded KV (a missing wait reads zeros every time)."""
    from radixserve.plugins.hardware.host_kv_copy import copy_layer_rows

    dev = device_pool(device="cuda")
    host = HostKVPool(dev, 64, 4, layout, "kernel", layer_copy=copy_layer_rows)
    slots = torch.tensor([*range(8, 12), *range(20, 24)])
    want = [dev.k[layer][1:9].cpu() for layer in range(LAYERS)]
    host.backup(torch.arange(1, 9), slots)
    host.wait_copies()
    for t in [*dev.k, *dev.v]:
        t.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(host.streams.load_stream):
        torch.cuda._sleep(500_000_000)  # the load stream busy for ~0.3 s
    host.load(slots, torch.arange(9, 17))
    dev.prepare_loads(per_layer=True)
    assert dev.layer_loads is not None and len(dev.layer_loads) == LAYERS
    step = torch.cuda.Event()
    step.record()  # compute-stream work after the issue: not ordered after the load
    step.synchronize()
    assert not dev.layer_loads[0].query()
    dev.wait_layer(0)
    first = dev.k[0][9:17].clone()
    dev.wait_loads()
    last = dev.k[LAYERS - 1][9:17].clone()
    torch.cuda.synchronize()
    assert torch.equal(first.cpu(), want[0])
    assert torch.equal(last.cpu(), want[LAYERS - 1])
