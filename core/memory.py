"""KV memory: the req->token table, the token->KV-slot allocator and the per-layer KV pool.

One pool is shared by running requests and the radix cache. Slot 0 is reserved as a padding
slot (never handed out) so batched gathers can point padding at a valid row. Allocation
failure returns None: the scheduler handles it (evict, then retract), it is never a crash.
"""

from __future__ import annotations

import torch


class TokenAllocator:
    """Hands out KV slot indices 1..size from a free list (page size 1)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []

    def available(self) -> int:
        return len(self._free) + sum(len(t) for t in self._released)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` free slots, or None (and no change) when too few are free."""
        if num_tokens > len(self._free) and self._released:
            self._merge_released()
        if num_tokens > len(self._free):
            return None
        out, self._free = self._free[:num_tokens], self._free[num_tokens:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        # NOTE: freed slots are merged lazily so frequent small frees stay cheap.
        if slots.numel():
            self._released.append(slots.to(torch.int64))

    def _merge_released(self) -> None:
        self._free = torch.cat([self._free, *self._released])
        self._released.clear()


class ReqToTokenPool:
    """A row per running request: the KV slot of each of its token positions."""

    def __init__(self, max_requests: int, max_context: int) -> None:
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.max_context = max_context

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)


class KVPool:
    """Per-layer K and V buffers of shape [size + 1, num_kv_heads, head_dim] (row 0 = padding).

    Buffers are addressable per layer so a KV connector can register and send pages.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        self.size = size
        shape = (size + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer_id].index_copy_(0, slots, k)
        self.v[layer_id].index_copy_(0, slots, v)
