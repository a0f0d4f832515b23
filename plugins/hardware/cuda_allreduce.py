"""Tensor parallelism on CUDA: a one-shot all-reduce over NVLink peer-to-peer for small messages.

NCCL's all-reduce of one decode row costs ~11 us inside a CUDA graph on two H200s, and a decode
step of an 8B model runs 65 of them (two per layer and the embedding): ~0.7 ms of a ~3 ms step.
One-shot instead: every rank's input goes into a buffer all ranks mapped (PyTorch symmetric
memory), a barrier in device memory, then each rank sums the peers' buffers with direct loads
over NVLink: one kernel, no proxy thread, capturable in a CUDA graph. Larger messages (prefill
chunks) stay with NCCL, whose ring moves less data per rank.

``torch.ops.symm_mem.one_shot_all_reduce*`` reads the peers through their buffers' peer-to-peer
addresses, never through a multicast object (the ``multimem_*`` ops are the ones that need
multicast). Multicast is switched off before anything is allocated
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1): the shared machines this runs on require it, and the
one-shot never needs it.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: largest message (bytes) summed by the one-shot kernel: a decode batch of 256 rows of hidden
#: 4,096 in bfloat16 (2 MiB); larger ones go to NCCL
MAX_BYTES = 2 << 20
_DTYPES = (torch.bfloat16, torch.float32)
_WORLD_SIZES = (2, 4, 8)  # the sizes torch's kernel is specialised for


def unavailable_reason(size: int) -> str | None:
    """Why the one-shot all-reduce cannot run here (None: it can). The same answer on every
    rank of one host."""
    if torch.version.cuda is None:
        return "not a CUDA build of torch"
    if size not in _WORLD_SIZES:
        return f"tp_size {size} (the kernel takes {_WORLD_SIZES})"
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_out"
    for a in range(size):
        for b in range(size):
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b} peer-to-peer"
    return None


class OneShotAllReduce:
    """``f(x) -> bool`` (``core.parallel.FastAllReduce``): sums contiguous bfloat16/float32
    tensors of at most ``max_bytes`` in place; returns False for any other tensor."""

    def __init__(self, group: Any, device: str, max_bytes: int = MAX_BYTES) -> None:
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # never needed, see above
        from torch.distributed import _symmetric_memory as symm_mem

        set_backend = getattr(symm_mem, "set_backend", None)
        if set_backend is not None:  # NVSHMEM may be the default where it is installed
            try:
                set_backend("CUDA")
            except RuntimeError as e:  # e.g. chosen already in this process: keep it
                logger.info("symmetric memory backend not set: %s", e)
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch, deprecated by later ones
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group_name)
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        # a collective over the group's store: every rank maps every other's buffer
        self.handle = symm_mem.rendezvous(self.buffer, self.group_name)
        ops = torch.ops.symm_mem
        self._copy_in = getattr(ops, "one_shot_all_reduce_copy_out", None)
        self._reduce = ops.one_shot_all_reduce_out
        self.rank, self.size = group.rank(), group.size()
        self._norm: _NormBuffers | None = None
        if os.environ.get("RADIXSERVE_TP_FUSED_NORM", "1") != "0":
            self._norm = _NormBuffers(self.group_name, self.size, device)
        #: the fused kernel: "push" rows into the peers' buffers, or let them "pull" (H200 x2,
        #: 64 calls in a graph: 5.3 against 5.9 us a call), or "lamport" (no flags: bfloat16
        #: rows polled against a mark; others go through "push"). RADIXSERVE_TP_FUSED_MODE.
        self.mode = os.environ.get("RADIXSERVE_TP_FUSED_MODE", "push")
        if self.mode not in ("push", "pull", "lamport"):
            raise ValueError(f"RADIXSERVE_TP_FUSED_MODE={self.mode}: push, pull or lamport")
        self._lamport: _LamportBuffers | None = None
        if self._norm is not None:  # whatever the mode (a benchmark may switch it)
            self._lamport = _LamportBuffers(self.group_name, self.size, device)

    def __call__(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        # 16-byte multiples keep the kernel's vector loads whole (and its alignment check
        # passes for every dtype); odd sizes are rare (hidden sizes are multiples of 64)
        if x.dtype not in _DTYPES or nbytes > self.max_bytes or nbytes % 16 or nbytes == 0:
            return False
        # the kernel wants x and the buffer equally aligned (the buffer's start: 16 bytes)
        if not x.is_contiguous() or (x.storage_offset() * x.element_size()) % 16:
            return False
        staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)
        if self._copy_in is not None:  # the kernel copies x into the buffer itself
            self._copy_in(staged, x, "sum", self.group_name, x)
        else:
            staged.copy_(x)
            self._reduce(staged, "sum", self.group_name, x)
        return True

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, site: int,
        spin_limit: int = -1,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """``core.parallel.FastAllReduce.add_rms_norm``: (rms_norm(sum + residual), sum +
        residual) in one kernel (allreduce_norm.py), or None for a tensor it does not take
        (the same answer on every rank: it depends on shapes and dtypes only)."""
        norm = self._norm
        if norm is None or x.dim() != 2 or x.dtype not in _DTYPES:
            return None
        rows, n = x.shape
        if rows > NORM_ROWS or self.size * rows * n * x.element_size() > norm.site_bytes:
            return None
        if n > 16384:
            return None
        if residual.shape != x.shape or residual.dtype != x.dtype or weight.numel() != n:
            return None
        if x.stride(-1) != 1 or residual.stride(-1) != 1 or not weight.is_contiguous():
            return None
        from radixserve.plugins.hardware import allreduce_norm

        lamport = self._lamport
        if self.mode == "lamport" and lamport is not None and lamport.takes(x):
            return allreduce_norm.lamport_add_rms_norm(
                x, residual, weight, eps, lamport.data_ptrs, lamport.counters, self.rank,
                self.size, NORM_ROWS, spin_limit,
            )  # fmt: skip
        return allreduce_norm.allreduce_add_rms_norm(
            x, residual, weight, eps, norm.data_ptrs, norm.flag_ptrs, self.rank, self.size,
            site * norm.site_bytes // x.element_size(), site * NORM_ROWS * self.size, spin_limit,
            self.mode != "pull",
        )  # fmt: skip

    def self_test(self, rank: int, size: int) -> None:
        """Raise unless an all-reduce of known values gives their sum (peer mappings work)."""
        x = torch.full((64,), float(rank + 1), dtype=torch.float32, device=self.buffer.device)
        assert self(x)
        want = size * (size + 1) / 2
        if not bool((x == want).all()):
            raise RuntimeError(f"one-shot all-reduce self-test gave {x[0].item()}, not {want}")

        if self._norm is None:
            return
        # the fused kernel: rows of known values, twice per site, in both dtypes (bfloat16
        # goes through the flagless kernel in lamport mode)
        for dtype in (torch.float32, torch.bfloat16):
            r = torch.full((2, 256), float(rank + 1), device=x.device, dtype=dtype)
            for site in (0, 1, 0, 1):
                # bounded waits: a kernel whose barrier never completes must not hang start-up
                out = self.add_rms_norm(r, torch.ones_like(r), torch.ones_like(r[0]), 1e-6, site,
                                        spin_limit=SELF_TEST_SPINS)  # fmt: skip
                assert out is not None
                if not bool((out[1] == want + 1).all()):
                    raise RuntimeError(
                        f"fused all-reduce + RMSNorm self-test ({self.mode}, {dtype}) gave "
                        f"{out[1][0, 0].item()}, not {want + 1}"
                    )

    def close(self) -> None:
        torch.cuda.synchronize(self.buffer.device)
        self.handle = None
        self.buffer = None  # type: ignore[assignment]
        self._norm = None
        self._lamport = None


#: tries at each flag before the start-up self-test gives up (seconds over NVLink)
SELF_TEST_SPINS = 1 << 22
#: most rows the fused all-reduce + RMSNorm takes (a decode batch); more go to NCCL
NORM_ROWS = 256
#: bytes of one call site's slot of the fused kernel's buffer per rank (NORM_ROWS rows of
#: 4,096 bf16: a rank's rows, or in push mode each peer's rows)
NORM_SITE_BYTES = 2 << 20


class _NormBuffers:
    """The fused all-reduce + RMSNorm's symmetric memory: per call site (2) a slot of rows and
    a flag array of NORM_ROWS x ranks int32s, zeroed; every rank's addresses on the device."""

    def __init__(self, group_name: str, size: int, device: str) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.site_bytes = size * NORM_SITE_BYTES
        flag_bytes = 2 * NORM_ROWS * size * 4
        self.flags = symm_mem.empty(flag_bytes // 4, dtype=torch.int32, device=device).zero_()
        self.data = symm_mem.empty(2 * self.site_bytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)  # the flags are zero before any peer can set one
        self.flag_handle = symm_mem.rendezvous(self.flags, group_name)
        self.data_handle = symm_mem.rendezvous(self.data, group_name)
        self.flag_ptrs = _peer_addresses(self.flags, self.flag_handle, device)
        self.data_ptrs = _peer_addresses(self.data, self.data_handle, device)


#: widest row (hidden size) the flagless kernel's buffer holds
LAMPORT_MAX_N = 8192


class _LamportBuffers:
    """The flagless kernel's receive buffer (3 stages x ranks x NORM_ROWS rows of up to
    LAMPORT_MAX_N bfloat16, every element the empty mark) and this rank's call count per row."""

    def __init__(self, group_name: str, size: int, device: str) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        from radixserve.plugins.hardware.allreduce_norm import SENTINEL_BF16

        self.data = symm_mem.empty(3 * size * NORM_ROWS * LAMPORT_MAX_N, dtype=torch.int16,
                                   device=device).fill_(SENTINEL_BF16)  # fmt: skip
        self.counters = torch.zeros(NORM_ROWS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)  # marked before any peer can write
        self.handle = symm_mem.rendezvous(self.data, group_name)
        self.data_ptrs = _peer_addresses(self.data, self.handle, device)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.shape[1] <= LAMPORT_MAX_N


def _peer_addresses(t: torch.Tensor, handle: Any, device: str) -> torch.Tensor:
    """Every rank's address of ``t`` (the allocation's base plus t's offset in it, the same on
    every rank), as an int64 device tensor the kernel reads."""
    offset = t.data_ptr() - handle.buffer_ptrs[handle.rank]
    return torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)


def build(group: Any, size: int, device: str) -> OneShotAllReduce | None:
    """The one-shot all-reduce for ``group`` (this rank on ``device``), tested, or None where
    it cannot run (logged)."""
    why = unavailable_reason(size)
    if why is not None:
        logger.info("custom all-reduce off: %s", why)
        return None
    ar = OneShotAllReduce(group, device)
    ar.self_test(group.rank(), size)
    return ar
