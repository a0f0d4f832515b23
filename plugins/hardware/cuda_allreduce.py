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

    def self_test(self, rank: int, size: int) -> None:
        """Raise unless an all-reduce of known values gives their sum (peer mappings work)."""
        x = torch.full((64,), float(rank + 1), dtype=torch.float32, device=self.buffer.device)
        assert self(x)
        want = size * (size + 1) / 2
        if not bool((x == want).all()):
            raise RuntimeError(f"one-shot all-reduce self-test gave {x[0].item()}, not {want}")

    def close(self) -> None:
        torch.cuda.synchronize(self.buffer.device)
        self.handle = None
        self.buffer = None  # type: ignore[assignment]


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
