"""HiCache's host tier: a KV pool in host memory beside the device's, its page allocator and
the copies between the two.

The host pool has its own slots (and page 0 as padding, as the device pool); the radix tree
records, per node, its device slots and its host slots. Layouts (``--hicache-mem-layout``):
``layer_first`` keeps a K and a V buffer per layer, as the device pool; ``page_first`` keeps
one buffer [slots, layers, 2, heads, head_dim], so a storage page is one contiguous piece.
Copies (``--hicache-io-backend``): their order against the compute stream is
core/hicache_streams.py's.

Host slots come in pages, so a node's host slots are mostly long runs of consecutive slots:
the copies move whole runs between the (pinned, on CUDA) host buffers and a device staging
tensor, and the scatter or gather by device slot happens on the device. On CUDA they are
asynchronous: host-side readers and writers of the host buffers (``read_pages``,
``write_pages``) wait for them first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from radixserve.core.config_checks import ConfigError
from radixserve.core.hicache_streams import CopyStreams
from radixserve.core.memory import KVPool, TokenAllocator

#: layer_first loads (CUDA) with at most this many runs of host slots copy each run of each
#: layer to the device (runs x layers x 2 copies); with more, one CPU gather per layer's K and
#: V into pinned staging and one copy each (layers x 2 copies) cost fewer calls
RUN_COPY_MAX_RUNS = 8
#: the most bytes of device staging a copy holds at once (larger copies go in chunks): the
#: device pool fills the device, and on the CPU smaller blocks are reused by malloc instead
#: of being mapped and faulted in anew each time
STAGING_BYTES = {"cuda": 64 << 20, "cpu": 30 << 20}


class HostKVPool:
    def __init__(
        self,
        device_pool: KVPool,
        size: int,
        page_size: int,
        layout: str,
        io_backend: str,
        layer_copy: Callable[..., None] | None = None,
    ) -> None:
        """``layer_copy``: the platform's gather of one layer's rows from the host buffers
        (``CopiesHostKVLayers``; None: the copies by runs or gathers below)."""
        self.device_pool = device_pool
        self.allocator = TokenAllocator(size, page_size)
        self.size = self.allocator.size
        self.layout = layout
        k0 = device_pool.k[0]
        self.num_layers = len(device_pool.k)
        self.token_shape = tuple(k0.shape[1:])  # (heads, head_dim)
        self.dtype = k0.dtype
        on_cuda = k0.device.type == "cuda"
        if io_backend == "kernel" and not on_cuda:
            raise ConfigError(
                "--hicache-io-backend kernel needs a CUDA device pool; use direct on "
                f"{k0.device.type}"
            )
        self.streams = CopyStreams(k0.device, io_backend)
        self.layer_copy = layer_copy
        #: loads queued for the next forward (host slots, device slots, backups), and how many
        #: batches of them went out
        self._queued: list[tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]] = []
        self.batches_issued = 0
        device_pool.issue_loads = self.issue_loads
        self._pin = on_cuda  # host buffers pinned, copies asynchronous
        self.staging_bytes = STAGING_BYTES.get(k0.device.type, STAGING_BYTES["cpu"])
        #: loads with more runs of host slots than this gather on the host instead. On the CPU
        #: always: with no bus between the pools, staging runs would only add a copy; on CUDA
        #: a page_first run is one copy of every layer, so never
        self.run_copy_max_runs = (
            0 if not on_cuda else RUN_COPY_MAX_RUNS if layout == "layer_first" else 1 << 62
        )
        rows = size + 1
        opts: dict[str, Any] = {"dtype": self.dtype, "pin_memory": on_cuda}
        if layout == "page_first":
            self.buf = torch.zeros((rows, self.num_layers, 2, *self.token_shape), **opts)
        else:
            self.k = [torch.zeros((rows, *self.token_shape), **opts) for _ in device_pool.k]
            self.v = [torch.zeros((rows, *self.token_shape), **opts) for _ in device_pool.k]

    @staticmethod
    def bytes_per_token(device_pool: KVPool) -> int:
        k0 = device_pool.k[0]
        return 2 * len(device_pool.k) * k0[0].numel() * k0.element_size()

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> Any:
        """Copy the device pool's KV at ``device_slots`` to the host pool at ``host_slots``:
        a gather into device staging, then one copy per run of consecutive host slots (per
        layer's K and V in layer_first). Nothing here waits for the copies; host-side readers
        of the host buffers do (``wait_copies``). A CPU pool past ``run_copy_max_runs`` runs
        (by default always) scatters into the host buffers instead: its staging is host memory.
        Returns the event to ``fence`` with before ``device_slots`` are freed and to pass to
        ``load`` of ``host_slots``: on a copy stream; None when the copies are in the compute
        stream's order (``direct``)."""
        runs = slot_runs(host_slots)
        if not runs:
            return None
        with self.streams.backup():
            index = self._on_device(device_slots)
            if not self._pin and len(runs) > self.run_copy_max_runs:
                self._backup_scattered(host_slots, index)
            else:
                self._backup_runs(runs, index)
        return self.streams.backup_event()

    def fence(self, backup: Any) -> None:
        """Before the device slots a backup read are freed for a step to write: the compute
        stream waits (on the device) for ``backup`` (``backup``'s event; None: nothing)."""
        self.streams.fence(backup)

    def _backup_runs(self, runs: list[tuple[int, int]], index: torch.Tensor) -> None:
        dev = self.device_pool
        # NOTE: staging is allocated on the stream that copies out of it, so the caching
        # allocator does not hand its memory out again before those copies ran
        for at, count, chunk in _chunks(runs, self._chunk_tokens()):
            rows = index[at : at + count]
            if self.layout == "page_first":
                staging = self._device_empty(count, self.num_layers, 2)
                for layer in range(self.num_layers):
                    torch.index_select(dev.k[layer], 0, rows, out=staging[:, layer, 0])
                    torch.index_select(dev.v[layer], 0, rows, out=staging[:, layer, 1])
                _copy_runs(chunk, staging, self.buf, to_host=True)
                continue
            for layer in range(self.num_layers):
                for host, pool in self._layer_pairs(layer):
                    _copy_runs(chunk, torch.index_select(pool, 0, rows), host, to_host=True)

    def _backup_scattered(self, host_slots: torch.Tensor, index: torch.Tensor) -> None:
        for layer in range(self.num_layers):
            for host, pool in self._layer_pairs(layer):
                host.index_copy_(0, host_slots, pool.index_select(0, index))

    def load(
        self, host_slots: torch.Tensor, device_slots: torch.Tensor, backups: tuple[Any, ...] = ()
    ) -> int:
        """Queue a copy of the host pool's KV at ``host_slots`` into the device pool at
        ``device_slots``, after the backups ``backups`` (``backup``'s events) that wrote
        ``host_slots``. The queued loads go out together before the next forward
        (``issue_loads``, which the device pool calls) or sooner, when the cache frees device
        slots a queued load writes (``queued``). Returns the batch the load joined."""
        if len(host_slots):
            self._queued.append((host_slots, device_slots, backups))
        return self.batches_issued

    def queued(self, batch: int) -> bool:
        """Whether the loads of ``batch`` (``load``'s return) are still queued."""
        return batch == self.batches_issued and bool(self._queued)

    def issue_loads(self) -> None:
        """Issue the queued loads as one: with the platform's per-layer kernel, a launch per
        layer, each followed by an event the forward waits on before that layer
        (``KVPool.layer_loads``); else the copies below, which the compute stream waits for
        as a whole."""
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        self.batches_issued += 1
        host_slots = torch.cat([q[0] for q in queued])
        device_slots = torch.cat([q[1] for q in queued])
        backups = tuple(b for q in queued for b in q[2])
        if self.layer_copy is not None:
            self._load_layers(host_slots, device_slots, backups)
            return
        runs = slot_runs(host_slots)
        with self.streams.load(backups):
            index = self._on_device(device_slots)
            if len(runs) > self.run_copy_max_runs:
                self._load_gathered(host_slots, index)
            else:
                self._load_runs(runs, index)

    def _load_layers(
        self, host_slots: torch.Tensor, device_slots: torch.Tensor, backups: tuple[Any, ...]
    ) -> None:
        """Layer by layer, each layer's K and V rows gathered from the host buffers by the
        platform's kernel (reading pinned host memory): no staging, and the forward's first
        layers run while the later ones copy."""
        assert self.layer_copy is not None
        events = []
        with self.streams.load_layers(backups) as mark:
            src_rows, dst_rows = self._on_device(host_slots), self._on_device(device_slots)
            for layer in range(self.num_layers):
                (src_k, dst_k), (src_v, dst_v) = self._layer_pairs(layer)
                self.layer_copy(src_k, src_v, src_rows, dst_k, dst_v, dst_rows)
                events.append(mark())
        if events[-1] is not None:
            self.device_pool.layer_loads = events

    def _load_runs(self, runs: list[tuple[int, int]], index: torch.Tensor) -> None:
        dev = self.device_pool
        for at, count, chunk in _chunks(runs, self._chunk_tokens()):
            rows = index[at : at + count]
            if self.layout == "page_first":
                staging = self._device_empty(count, self.num_layers, 2)
                _copy_runs(chunk, self.buf, staging, to_host=False)
                for layer in range(self.num_layers):
                    dev.k[layer].index_copy_(0, rows, staging[:, layer, 0])
                    dev.v[layer].index_copy_(0, rows, staging[:, layer, 1])
                continue
            for layer in range(self.num_layers):
                for host, pool in self._layer_pairs(layer):
                    staging = self._device_empty(count)
                    _copy_runs(chunk, host, staging, to_host=False)
                    pool.index_copy_(0, rows, staging)

    def _load_gathered(self, host_slots: torch.Tensor, index: torch.Tensor) -> None:
        self.wait_copies()  # the gather reads the host buffers on the host
        for layer in range(self.num_layers):
            for host, pool in self._layer_pairs(layer):
                # NOTE: a pinned block from torch's caching host allocator, which does not
                # hand it out again before the asynchronous copy out of it ran
                staging = torch.empty(
                    (len(host_slots), *self.token_shape), dtype=self.dtype, pin_memory=self._pin
                )
                torch.index_select(host, 0, host_slots, out=staging)
                pool.index_copy_(0, index, staging.to(index.device, non_blocking=True))

    def _layer_pairs(self, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(host buffer, device buffer) of ``layer``'s K and of its V, indexed by slot."""
        dev = self.device_pool
        if self.layout == "page_first":
            return (self.buf[:, layer, 0], dev.k[layer]), (self.buf[:, layer, 1], dev.v[layer])
        return (self.k[layer], dev.k[layer]), (self.v[layer], dev.v[layer])

    def read_pages(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The KV at ``host_slots`` as one contiguous [n, layers, 2, heads, head_dim] tensor
        (a storage page)."""
        self.wait_copies()
        if self.layout == "page_first":
            return self.buf[host_slots].contiguous()
        k = torch.stack([t[host_slots] for t in self.k], dim=1)
        v = torch.stack([t[host_slots] for t in self.v], dim=1)
        return torch.stack([k, v], dim=2).contiguous()

    def write_pages(self, host_slots: torch.Tensor, data: torch.Tensor) -> None:
        """Put ``read_pages``' form of KV at ``host_slots``."""
        self.wait_copies()
        if self.layout == "page_first":
            self.buf[host_slots] = data
            return
        for layer in range(self.num_layers):
            self.k[layer][host_slots] = data[:, layer, 0]
            self.v[layer][host_slots] = data[:, layer, 1]

    def page_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.num_layers, 2, *self.token_shape)

    def wait_copies(self) -> None:
        """Block until the copies queued so far (backups and loads) ran: any host-side read or
        write of the host buffers calls this first. Queued loads go out first."""
        self.issue_loads()
        self.streams.wait()

    def _on_device(self, slots: torch.Tensor) -> torch.Tensor:
        device = self.device_pool.k[0].device
        if slots.device == device:
            return slots
        # a pageable copy would wait for the copy stream (all queued work) before returning
        return (slots.pin_memory() if self._pin else slots).to(device, non_blocking=True)

    def _chunk_tokens(self) -> int:
        """Tokens per chunk of staging: all layers' K and V of a token in page_first, one
        layer's K or V in layer_first."""
        per_token = self.device_pool.k[0][0].numel() * self.device_pool.k[0].element_size()
        if self.layout == "page_first":
            per_token *= 2 * self.num_layers
        return max(1, self.staging_bytes // per_token)

    def _device_empty(self, *lead: int) -> torch.Tensor:
        device = self.device_pool.k[0].device
        return torch.empty((*lead, *self.token_shape), dtype=self.dtype, device=device)


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int]]:
    """A CPU int64 slot tensor as its runs of consecutive slots, (first slot, length) each in
    order, found in one vectorized pass (host slots come in pages, so runs are long)."""
    n = len(slots)
    if n == 0:
        return []
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *breaks, n]
    firsts = slots[bounds[:-1]].tolist()
    return [(first, bounds[i + 1] - bounds[i]) for i, first in enumerate(firsts)]


def _chunks(
    runs: list[tuple[int, int]], limit: int
) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
    """``runs`` regrouped into chunks of at most ``limit`` slots (a run may be split): each
    as (position of its first slot among all, its slot count, its runs)."""
    at, count, chunk = 0, 0, []
    for first, length in runs:
        while length:
            take = min(length, limit - count)
            chunk.append((first, take))
            count, first, length = count + take, first + take, length - take
            if count == limit:
                yield at, count, chunk
                at, count, chunk = at + count, 0, []
    if chunk:
        yield at, count, chunk


def _copy_runs(
    runs: list[tuple[int, int]], src: torch.Tensor, dst: torch.Tensor, to_host: bool
) -> None:
    """One copy per run between a host buffer indexed by slot and a staging tensor holding the
    runs back to back (``to_host``: staging -> host buffer)."""
    at = 0
    for first, length in runs:
        if to_host:
            dst[first : first + length].copy_(src[at : at + length], non_blocking=True)
        else:
            dst[at : at + length].copy_(src[first : first + length], non_blocking=True)
        at += length
