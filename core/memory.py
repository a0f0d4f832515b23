"""KV memory: the req->token table, the paged token->KV-slot allocator and the per-layer KV pool.

One pool is shared by running requests and the radix cache. It is cut into pages of
``page_size`` tokens: page ``p`` holds slots ``p * page_size + (0 .. page_size - 1)``, and the
positions ``[k * P, (k + 1) * P)`` of one request always live in one page, in order. Slot 0 is
reserved as a padding slot (never handed out) so batched gathers can point padding at a valid
row; with pages, page 0 is reserved with it. The req->token table stays token-level (a slot per
position), so attention backends that ignore pages read it as with page size 1.
Allocation failure returns None and changes nothing: the scheduler handles it (evict, then
retract), it is never a crash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without waiting for the work queued there: a plain copy
    blocks the host until the device is idle, which would undo overlap scheduling."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class TokenAllocator:
    """Hands out KV slots in whole pages from a free list of pages 1..num_pages.

    Sizes and ``available()`` are in tokens (free pages * page_size). ``free`` gives back the
    pages holding the slots passed, whole: pass a request's slots in position order from a page
    boundary (its partial last page goes back with them).
    """

    def __init__(self, size: int, page_size: int = 1) -> None:
        # The KV pool has rows 0..size; only pages that fit entirely are used.
        num_pages = (size + 1) // page_size - 1
        if num_pages < 1:
            raise ValueError(f"a KV pool of {size} tokens holds no page of {page_size} tokens")
        self.page_size = page_size
        self.size = num_pages * page_size
        self._free = torch.arange(1, num_pages + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        # How often each page went back to the free list: KV that a drafter wrote at a slot is
        # still there, for the same tokens, while its page's count has not moved.
        self._page_frees = torch.zeros(num_pages + 1, dtype=torch.int64)

    def available(self) -> int:
        return (len(self._free) + sum(len(t) for t in self._released)) * self.page_size

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for positions 0..num_tokens-1 of a new sequence (fresh pages), or None."""
        if self.page_size == 1:
            return self._take_pages(num_tokens)
        pages = self._take_pages(-(-num_tokens // self.page_size))
        return None if pages is None else self._page_slots(pages)[:num_tokens]

    def alloc_extend(self, row: torch.Tensor, kv_len: int, num_tokens: int) -> torch.Tensor | None:
        """Slots for positions kv_len..kv_len+num_tokens-1 of the table ``row`` (whose first
        kv_len positions are filled): the rest of its partial last page, then fresh pages."""
        p = self.page_size
        if p == 1:
            return self._take_pages(num_tokens)
        pages = self._take_pages(self.tokens_needed(kv_len, num_tokens) // p)
        if pages is None:
            return None
        fill = min(num_tokens, -kv_len % p)  # the free rest of the last page
        fresh = self._page_slots(pages)[: num_tokens - fill]
        if not fill:
            return fresh
        last = int(row[kv_len - 1])
        return torch.cat([torch.arange(last + 1, last + 1 + fill, dtype=torch.int64), fresh])

    def alloc_decode(
        self, table: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor
    ) -> torch.Tensor | None:
        """One slot each for position kv_lens[i] of table row rows[i] (kv_lens >= 1): the next
        slot of the row's last page, or the first slot of a fresh page at a page boundary."""
        p = self.page_size
        if p == 1:
            return self._take_pages(len(rows))
        new_page = kv_lens % p == 0
        pages = self._take_pages(int(new_page.sum()))
        if pages is None:
            return None
        slots = table[rows, kv_lens - 1] + 1
        if len(pages):
            slots.masked_scatter_(new_page, pages * p)
        return slots

    def tokens_needed(self, kv_len: int, num_tokens: int) -> int:
        """Tokens of fresh pages that extending a request from kv_len by num_tokens takes."""
        p = self.page_size
        return -(-(num_tokens - min(num_tokens, -kv_len % p)) // p) * p

    def tokens_needed_decode(self, kv_lens: torch.Tensor) -> int:
        """Tokens of fresh pages that one decode step of requests at ``kv_lens`` takes."""
        p = self.page_size
        return len(kv_lens) if p == 1 else p * int((kv_lens % p == 0).sum())

    def free(self, slots: torch.Tensor) -> None:
        # NOTE: freed pages are merged lazily so frequent small frees stay cheap.
        if not slots.numel():
            return
        pages = slots.to(torch.int64)
        if self.page_size > 1:
            pages = torch.unique_consecutive(pages // self.page_size)
        self._page_frees[pages] += 1
        self._released.append(pages)

    def free_counts(self, slots: torch.Tensor) -> torch.Tensor:
        """How often the pages of ``slots`` were freed so far (one count per slot)."""
        return self._page_frees[slots // self.page_size]

    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > len(self._free) and self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released.clear()
        if num_pages > len(self._free):
            return None
        out, self._free = self._free[:num_pages], self._free[num_pages:]
        return out

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + self._offsets).flatten()


class ReqToTokenPool:
    """A row per running request: the KV slot of each of its token positions.

    The host ``table`` is the scheduler's source of truth. Kernels on a device read a mirror
    (``device_table``) that this pool keeps up to date: every write goes through ``write`` or
    ``write_points``, which log the positions they change, and ``sync`` copies those positions
    to the mirror in one host->device copy and one scatter. The model runner syncs before every
    step, and ``device_table`` syncs before it returns, so no kernel can read a stale row. Write
    the host table only through these methods (a direct write would never reach the mirror).

    The mirror is int32 with one extra all-zero row at ``pad_row`` (slot 0 is the KV pool's
    padding slot) for padded batch entries, e.g. in CUDA graphs.
    """

    def __init__(self, max_requests: int, max_context: int) -> None:
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64)
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self.max_context = max_context
        self.pad_row = max_requests
        self._mirror: torch.Tensor | None = None
        self._dirty: list[torch.Tensor] = []  # flat table positions written since the last sync
        self._flat = self.table.view(-1)
        # Tensor parallelism: every write since the last step, for the other ranks' tables.
        self._journal: list[torch.Tensor] | None = None

    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def reserve(self, n: int) -> list[int]:
        """``n`` rows taken for good, as scratch (draft trees' rows, core/spec_tree.py)."""
        if n > len(self._free_rows):
            raise ValueError(f"{n} scratch rows asked, {len(self._free_rows)} free")
        return [self._free_rows.pop(0) for _ in range(n)]

    # -- writes (host table + mirror log) ---------------------------------------------------

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Positions ``start .. start + len(slots) - 1`` of ``row`` get ``slots``."""
        n = len(slots)
        if not n:
            return
        self.table[row, start : start + n] = slots
        if self._mirror is not None or self._journal is not None:
            first = row * self.max_context + start
            self._log(torch.arange(first, first + n, dtype=torch.int64))

    def write_points(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """``table[rows[i], cols[i]] = slots[i]`` for every i, in one indexed write."""
        self.table[rows, cols] = slots
        if self._mirror is not None or self._journal is not None:
            self._log(rows * self.max_context + cols)

    def _log(self, where: torch.Tensor) -> None:
        if self._mirror is not None:
            self._dirty.append(where)
        if self._journal is not None:
            self._journal.append(where)

    # -- tensor parallelism: the leader's writes replayed on the other ranks' tables ---------

    def record_writes(self) -> None:
        """From now on, keep every write for ``take_writes``."""
        self._journal = []

    def take_writes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, their values now) written since the last call. A position written
        twice has its last value in both entries, so the order of replay does not matter."""
        assert self._journal is not None, "record_writes() first"
        if not self._journal:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        where = self._journal[0] if len(self._journal) == 1 else torch.cat(self._journal)
        self._journal.clear()
        return where, self._flat[where]

    def apply_writes(self, where: torch.Tensor, values: torch.Tensor) -> None:
        """Apply another table's ``take_writes`` to this one (and to its mirror at sync)."""
        if not where.numel():
            return
        self._flat[where] = values
        if self._mirror is not None:
            self._dirty.append(where.clone())

    # -- the device mirror ------------------------------------------------------------------

    def device_table(self, device: str | torch.device) -> torch.Tensor:
        """The mirror on ``device`` (created on first use), with every write so far applied.
        The tensor is allocated once, so a captured CUDA graph may keep reading it."""
        if self._mirror is None:
            rows, cols = self.table.shape
            self._mirror = torch.zeros((rows + 1, cols), dtype=torch.int32, device=device)
            self._mirror[:rows] = to_device(self.table.to(torch.int32), device)
            self._dirty.clear()
        elif not _same_device(self._mirror.device, torch.device(device)):
            raise ValueError(
                f"the req->token mirror lives on {self._mirror.device}, not on {device}"
            )
        self.sync()
        return self._mirror

    def sync(self) -> None:
        """Apply the logged writes to the mirror (no-op without one or without writes). Values
        come from the host table now, so a position written twice gets its last value."""
        if not self._dirty:
            return
        assert self._mirror is not None
        where = self._dirty[0] if len(self._dirty) == 1 else torch.cat(self._dirty)
        self._dirty.clear()
        packed = torch.stack([where, self._flat[where]])
        dev = to_device(packed, self._mirror.device)
        self._mirror.view(-1).scatter_(0, dev[0], dev[1].to(torch.int32))


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
        page_size: int = 1,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.size = size
        self.page_size = page_size  # read by paged attention kernels
        #: the dtype of the K/V the model stores and of its queries (``dtype`` unless the cache
        #: is kept narrower, --kv-cache-dtype): stores round to ``dtype``, reads widen to this
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype
        shape = (size + 1, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        #: an FP8 cache's scales per layer (K ~= stored * k_scale): stores divide by them,
        #: reads multiply; 1.0 unless the checkpoint gives k_scale/v_scale (set_scales)
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        self.saturate = dtype.itemsize == 1  # FP8: stores clamp to the format's range
        #: HiCache (core/hicache_pool.py): issues the host->device loads queued for the next
        #: forward; and the events after each layer of the last ones issued, on a copy stream
        #: (None: nothing to wait for)
        self.issue_loads: Callable[[], None] | None = None
        self.layer_loads: list[Any] | None = None

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def prepare_loads(self, per_layer: bool) -> None:
        """Before a forward: issue the queued loads. ``per_layer``: the forward waits for each
        layer's with ``wait_layer`` (a ``WaitsForKVLayers`` model run eagerly), so its first
        layers overlap the copies of the later ones; else the device waits for all now."""
        if self.issue_loads is not None:
            self.issue_loads()
        if not per_layer:
            self.wait_loads()

    def wait_layer(self, layer_id: int) -> None:
        """The device waits (in stream order, not the host) until layer ``layer_id``'s KV of
        the issued loads is in place."""
        if self.layer_loads is not None:
            self.layer_loads[layer_id].wait()

    def wait_loads(self) -> None:
        """The device waits until every issued load is in place (the last layer's event comes
        after all others on its stream); nothing is pending afterwards."""
        if self.layer_loads is not None:
            self.layer_loads[-1].wait()
            self.layer_loads = None

    def set_scales(self, layer_id: int, k_scale: float, v_scale: float) -> None:
        self.k_scales[layer_id], self.v_scales[layer_id] = float(k_scale), float(v_scale)

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = self.k[layer_id], self.v[layer_id]
        if self.saturate:  # FP8: copied as bytes (torch's CPU index_copy_ takes no FP8)
            k, v = self._narrowed(layer_id, k, v)
            k, v = k.to(k_buf.dtype).view(torch.uint8), v.to(v_buf.dtype).view(torch.uint8)
            k_buf, v_buf = k_buf.view(torch.uint8), v_buf.view(torch.uint8)
        k_buf.index_copy_(0, slots, k.to(k_buf.dtype))  # .to: no copy when the dtypes agree
        v_buf.index_copy_(0, slots, v.to(v_buf.dtype))

    def _narrowed(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V divided by the layer's scales and clamped to the FP8 range (a cast alone
        would make NaN of what overflows)."""
        top = torch.finfo(self.k[layer_id].dtype).max
        k = (k.float() * (1.0 / self.k_scales[layer_id])).clamp_(-top, top)
        v = (v.float() * (1.0 / self.v_scales[layer_id])).clamp_(-top, top)
        return k, v


def _same_device(have: torch.device, want: torch.device) -> bool:
    """``want`` without an index ("cuda") means the current device of its type."""
    return have.type == want.type and want.index in (None, have.index)
