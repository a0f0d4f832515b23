"""HiCache's host tier: a KV pool in host memory beside the device's, its page allocator and
the copies between the two.

The host pool has its own slots (and page 0 as padding, as the device pool); the radix tree
records, per node, its device slots and its host slots. Layouts (``--hicache-mem-layout``):
``layer_first`` keeps a K and a V buffer per layer, as the device pool; ``page_first`` keeps
one buffer [slots, layers, 2, heads, head_dim], so a storage page is one contiguous piece.
Copies (``--hicache-io-backend``): ``direct`` copies on the compute stream; ``kernel`` (CUDA)
queues them on a copy stream that first waits for the compute stream, and the compute stream
waits for the copies before its next kernels, so a loaded page is there before a step reads
it, and a page freed after its backup is not overwritten before it was read.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.core.config_checks import ConfigError
from radixserve.core.memory import KVPool, TokenAllocator


class HostKVPool:
    def __init__(
        self, device_pool: KVPool, size: int, page_size: int, layout: str, io_backend: str
    ) -> None:
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
        self._stream: Any = torch.cuda.Stream(k0.device) if io_backend == "kernel" else None
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

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the device pool's KV at ``device_slots`` to the host pool at ``host_slots``."""
        dev = self.device_pool
        with self._on_copy_stream():
            index = device_slots.to(dev.k[0].device)
            for layer in range(self.num_layers):
                # NOTE: a blocking copy: the host buffer is written from host code next.
                k = dev.k[layer].index_select(0, index).cpu()
                v = dev.v[layer].index_select(0, index).cpu()
                # index_copy_ / index_select: several times faster than indexed assignment
                if self.layout == "page_first":
                    self.buf[:, layer, 0].index_copy_(0, host_slots, k)
                    self.buf[:, layer, 1].index_copy_(0, host_slots, v)
                else:
                    self.k[layer].index_copy_(0, host_slots, k)
                    self.v[layer].index_copy_(0, host_slots, v)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy the host pool's KV at ``host_slots`` into the device pool at ``device_slots``."""
        dev = self.device_pool
        device = dev.k[0].device
        with self._on_copy_stream():
            index = device_slots.to(device)
            for layer in range(self.num_layers):
                if self.layout == "page_first":
                    k = self.buf[:, layer, 0].index_select(0, host_slots)
                    v = self.buf[:, layer, 1].index_select(0, host_slots)
                else:
                    k = self.k[layer].index_select(0, host_slots)
                    v = self.v[layer].index_select(0, host_slots)
                dev.k[layer].index_copy_(0, index, k.to(device, non_blocking=True))
                dev.v[layer].index_copy_(0, index, v.to(device, non_blocking=True))

    def read_pages(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The KV at ``host_slots`` as one contiguous [n, layers, 2, heads, head_dim] tensor
        (a storage page)."""
        if self.layout == "page_first":
            return self.buf[host_slots].contiguous()
        k = torch.stack([t[host_slots] for t in self.k], dim=1)
        v = torch.stack([t[host_slots] for t in self.v], dim=1)
        return torch.stack([k, v], dim=2).contiguous()

    def write_pages(self, host_slots: torch.Tensor, data: torch.Tensor) -> None:
        """Put ``read_pages``' form of KV at ``host_slots``."""
        if self.layout == "page_first":
            self.buf[host_slots] = data
            return
        for layer in range(self.num_layers):
            self.k[layer][host_slots] = data[:, layer, 0]
            self.v[layer][host_slots] = data[:, layer, 1]

    def page_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.num_layers, 2, *self.token_shape)

    def _on_copy_stream(self) -> Any:
        return _CopyStream(self._stream)


class _CopyStream:
    """With a copy stream: run the block on it after the compute stream's queued work, and
    make the compute stream wait for it afterwards. Without one: nothing."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._ctx: Any = None

    def __enter__(self) -> None:
        if self.stream is None:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self._ctx = torch.cuda.stream(self.stream)
        self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.stream is None:
            return
        self._ctx.__exit__(*exc)
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
