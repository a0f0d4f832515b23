"""The ``cuda`` hardware platform (NVIDIA GPUs): bfloat16, Triton attention, CUDA graphs.

ROCm builds of torch expose the same ``torch.cuda`` API; ``rocm.py`` reuses this class.

Device memory (``mem_fraction_static`` of the card): weights first, then the KV pool takes the
rest of that fraction; the remaining ``1 - mem_fraction_static`` is left for activations and
CUDA graphs. The pool never takes memory that is not free now (other processes count).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import HardwarePlatform, StepExecutor
from radixserve.plugins.hardware.cpu import CpuPlatform

logger = logging.getLogger(__name__)


def set_blas_library() -> None:
    """torch's BLAS path for the model's products: cuBLASLt on NVIDIA GPUs, unless
    RADIXSERVE_CUDA_BLAS names another ("cublas", "cublaslt"; "default": torch's own choice).

    At 64 rows on the 8B shape, cuBLASLt reads down_proj's weights at 0.90 of the copy
    bandwidth against 0.72 through torch's default path (31.3 against 39.1 us) and gate_up's at
    0.97 against 0.93; qkv and o are the same (bench/decode_gemms.py, H200). In the engine
    (bench/experiments/gpu_env_ab.py, one machine, two rounds each): 64 x (1,024 + 256) at 4,761 /
    4,728 tok/s against 4,643 / 4,649, decode steps 7.07 against 7.27 ms; 512 x (1,024 + 1,024)
    unchanged within noise (bench/HISTORY.md, 2026-12-03). The setting is torch's, for the
    whole process. ROCm builds keep torch's choice unless the variable names one."""
    blas = os.environ.get("RADIXSERVE_CUDA_BLAS") or (
        "default" if torch.version.hip else "cublaslt"
    )
    if blas != "default":
        with _quiet_stderr():  # torch's C++ "experimental feature" warning, on every start
            torch.backends.cuda.preferred_blas_library(blas)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silences file descriptor 2 (C++ code writes there, past Python's sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


#: Speculation turns off above this many decodes a step for a model whose weights take under
#: LAUNCH_BOUND_WEIGHTS bytes: its steps cost their launches and the host's work, not their
#: weight reads (SmolLM2-135M on an H200: ~1 ms a decode step for 0.27 GB of weights), so a
#: verify step's host work (drafting, accepting) is what speculation adds. The default model
#: on an H200, every batch size forced to speculate (2026-12-03, bench/HISTORY.md): n-gram
#: gained at 2 (1.08-2.24x) and at 4 on three workloads of four (1.42-1.79x; code edits
#: 0.62x), and lost at 8 on all four (0.73-0.93x); EAGLE-3 lost at every size (0.61-0.89x).
#: Larger models keep the core's cut-off: the Llama-3.1-8B shape (16 GB) gained 1.67x at
#: batch 8 with EAGLE-3 at a simulated accept length of 3.0 (2026-12-01). Where between the two
#: sizes the turn lies was not measured; 2 GiB reads in ~0.5 ms at an H200's bandwidth.
SMALL_MODEL_SPECULATION_CUTOFF = 4
LAUNCH_BOUND_WEIGHTS = 2 << 30


class CudaPlatform(HardwarePlatform):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        self.device = f"cuda:{index}"
        torch.cuda.set_device(index)
        set_blas_library()

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def default_plugins(self) -> dict[str, str]:
        return {**CpuPlatform().default_plugins(), "attention": "triton"}

    def engine_defaults(self, model: ModelConfig, weight_bytes: int) -> dict[str, Any]:
        """Sized from the card: a larger prefill chunk and more graph-captured decodes on
        larger cards, and most of the memory for weights + KV. What is left is room for one
        chunk's activations, the sampler's buffers over a full decode batch, CUDA graphs and
        cuBLAS workspaces: twice an estimate of those, and at least 8% of the card."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        gib = total / (1 << 30)
        chunk = 8192 if gib >= 60 else 4096 if gib >= 30 else 2048
        graph_bs = 256 if gib >= 30 else 128
        itemsize = self.default_dtype().itemsize
        intermediate = int(model.raw.get("intermediate_size") or 4 * model.hidden_size)
        activations = chunk * (4 * model.hidden_size + 3 * intermediate) * itemsize
        sampler = graph_bs * model.vocab_size * 4 * 3  # float32 logits and two temporaries
        reserve = max(2 * (activations + sampler + (2 << 30)), int(0.08 * total))
        chosen = {
            "chunked_prefill_size": chunk,
            "cuda_graph_max_bs": graph_bs,
            "max_running_requests": graph_bs,
            "mem_fraction_static": round(1 - reserve / total, 3),
        }
        if weight_bytes < LAUNCH_BOUND_WEIGHTS:
            chosen["speculative_disable_batch_size"] = SMALL_MODEL_SPECULATION_CUTOFF
        return chosen

    def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * mem_fraction) - weight_bytes
        headroom = free - weight_bytes - int(total * (1 - mem_fraction))
        return max(min(budget, headroom), 0)

    asynchronous = True

    def limit_host_threads(self, cpu_threads: int | None) -> None:
        """The engine's host work is Python and small tensor ops, which torch's intra-op pool
        (a thread per core) does not speed up but slows: with 16 threads, steps took 15.9 ms
        against 8.5 ms with one under `serve` (14,194 vs 26,366 tok/s), and the offline Engine
        ran at 16,295 and 23,204 tok/s against 28,896 with OMP_NUM_THREADS=1 (H200, SmolLM2
        shape, 512 x (1,024 + 256); bench/HISTORY.md). So the engine runs one thread, in the
        offline Engine's process too (``release`` restores the count), unless --cpu-threads or
        OMP_NUM_THREADS says otherwise."""
        if cpu_threads is None and "OMP_NUM_THREADS" in os.environ:
            return
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(cpu_threads or 1)

    _threads_before: int | None = None

    def release(self) -> None:
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def copy_to_host_async(self, tensor: torch.Tensor) -> Callable[[], list[int]]:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def wait() -> list[int]:
            copied.synchronize()
            return host.tolist()

        return wait

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds every CUDA device too

    def distributed_backend(self) -> str:
        return "nccl"  # RCCL on ROCm builds, behind the same name

    def bind_rank(self, rank: int, size: int) -> None:
        if rank >= torch.cuda.device_count():
            raise ConfigError(
                f"tensor-parallel rank {rank} needs GPU {rank}; "
                f"{torch.cuda.device_count()} visible: lower --tp-size"
            )
        self.device = f"cuda:{rank}"
        torch.cuda.set_device(rank)

    def fast_all_reduce(self, group: Any, size: int) -> Any:
        """One-shot all-reduce over NVLink peer-to-peer for small messages (decode steps),
        where torch's symmetric memory has it and every GPU reaches every other; None
        elsewhere (NCCL for all). See cuda_allreduce.py."""
        from radixserve.plugins.hardware.cuda_allreduce import build

        return build(group, size, self.device)

    def empty_cache(self) -> None:
        # torch keeps a cuBLAS workspace per stream it ran a matmul on, and each engine's CUDA
        # graph capture adds streams: ~32 MiB each on H200 that nothing else frees.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()  # freed blocks stay reserved (not free) until this

    def resolve_config(self, config: Any, model_dir: str) -> Any:
        """An FP8 checkpoint with no --quantization runs as stored (``fp8``): its codes on the
        tensor cores, not dequantized to bfloat16."""
        import dataclasses

        from radixserve.core.model_config import ModelConfig as _Config
        from radixserve.plugins.models.fp8_loading import checkpoint_scheme

        if config.quantization is None and not torch.version.hip:
            raw = _Config.from_dir(model_dir).raw
            if checkpoint_scheme(raw) is not None:
                logger.info("an FP8 checkpoint: --quantization fp8")
                return dataclasses.replace(config, quantization="fp8")
        return config

    def quantize_model(self, model: Any, method: str) -> None:
        """``fp8``: FP8 weights on the tensor cores (plugins/models/fp8.py), on NVIDIA GPUs
        of compute capability 8.9 or more (Ada, Hopper, Blackwell); every other method is
        the CPU's (refused here)."""
        if method != "fp8" or torch.version.hip:
            super().quantize_model(model, method)
            return
        major, minor = torch.cuda.get_device_capability(self.device)
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"--quantization fp8 needs FP8 tensor cores (compute capability 8.9 or more); "
                f"{torch.cuda.get_device_name(self.device)} has {major}.{minor}"
            )
        from radixserve.plugins.models.fp8_loading import quantize_model

        logger.info("fp8: %d linear layers", quantize_model(model))

    def prepare_draft_head(self, head: torch.nn.Module, config: Any) -> None:
        """A head that says its norms and RoPE see token-major tensors
        (``supports_fused_ops``: the EAGLE heads) runs them on the target's Triton kernels:
        eagerly, each RMSNorm is ~7 kernels and each RoPE ~6, and an EAGLE-3 head step took
        ~0.14 ms of device time at batch 1 on the H200 (launch-bound; bench/HISTORY.md)."""
        from radixserve.plugins.models.kernel_choice import attach_fused_ops, fused_ops_for

        fused = fused_ops_for(self.device)
        if fused is not None and getattr(head, "supports_fused_ops", False):
            attach_fused_ops(head, fused)

    def host_kv_layer_copy(self) -> Callable[..., None] | None:
        """HiCache's per-layer loads (``CopiesHostKVLayers``): a Triton kernel reading pinned
        host memory, with ``RADIXSERVE_HICACHE_LAYER_LOADS=1``. Off by default until its
        figures on a GPU are in (loads go whole, by the copy engine)."""
        if os.environ.get("RADIXSERVE_HICACHE_LAYER_LOADS", "0") != "1":
            return None
        try:
            from radixserve.plugins.hardware.host_kv_copy import (
                copy_layer_rows,
                reads_host_memory,
            )
        except ImportError:  # no Triton (the gpu extra)
            return None
        if not reads_host_memory(self.device):
            logger.warning("HiCache: this GPU cannot read pinned host memory from a kernel; "
                           "loads go whole, by copy engine")  # fmt: skip
            return None
        return copy_layer_rows

    def step_executor(self, model: Any, attention: Any, kv_pool: Any, req_to_token: Any,
                      config: Any) -> StepExecutor:  # fmt: skip
        """CUDA graphs for decode-only batches up to ``cuda_graph_max_bs`` and for short
        prefill steps (``cuda_graph_max_prefill_tokens``), unless disabled or the attention
        backend cannot prepare a decode step from device tensors alone."""
        self.limit_host_threads(config.cpu_threads)
        eager = super().step_executor(model, attention, kv_pool, req_to_token, config)
        if config.disable_cuda_graph or config.cuda_graph_max_bs < 1:
            return eager
        if not attention.prepares_decode_on_device:  # declared (core/interfaces.py)
            logger.info("CUDA graphs off: attention %s cannot be captured", type(attention))
            return eager
        from radixserve.plugins.hardware.cuda_graph import CudaGraphRunner

        max_bs = min(config.cuda_graph_max_bs, config.max_running_requests)
        return CudaGraphRunner(
            model, attention, kv_pool, req_to_token, max_bs, self.device,
            verify_shapes=verify_graph_shapes(config, max_bs),
            prefill_tokens=prefill_graph_tokens(config),
        )  # fmt: skip


def prefill_graph_tokens(config: Any) -> int:
    """The most new tokens a prefill graph takes: no more than a prefill step holds, and none
    with tensor parallelism (not tried there yet)."""
    if config.tp_size > 1:
        return 0
    chunk = config.chunked_prefill_size
    limit = config.cuda_graph_max_prefill_tokens
    return min(limit, chunk) if chunk and chunk > 0 else limit


def verify_graph_shapes(config: Any, max_bs: int) -> dict[int, int]:
    """{batch size: tokens per request} of the verify steps speculation will run with full
    drafts (the draft shrinks past 8 requests: core.speculative.Speculator.draft_length)."""
    from radixserve.core.speculative import FULL_DRAFT_BATCH
    from radixserve.plugins.hardware.cuda_graph import capture_sizes

    speculating = any(
        p.startswith("speculative=") and not p.endswith("=none") for p in config.plugins
    )
    if not speculating:
        return {}
    k = config.draft_depth
    limit = min(config.speculative_disable_batch_size, max_bs)
    shapes = {}
    for bs in capture_sizes(limit):
        shapes[bs] = 1 + (k if bs <= FULL_DRAFT_BATCH else max(1, k * FULL_DRAFT_BATCH // bs))
    return shapes


def cuda_unavailable_reason() -> str | None:
    if torch.version.hip:
        return "this torch is a ROCm build; use the 'rocm' platform"
    if torch.version.cuda is None:
        return "this torch has no CUDA support (a CPU build)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


@hookimpl
def register_hardware_platforms(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "cuda",
        CudaPlatform,
        available=cuda_unavailable_reason,
        description="NVIDIA GPU (bfloat16, Triton attention, CUDA graphs)",
        priority=100,
    )
