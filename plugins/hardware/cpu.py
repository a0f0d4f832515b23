"""The ``cpu`` hardware platform: float32, cpu_paged attention, KV sized from host memory,
weight-only quantization on torch's CPU kernels, and a core left to the server's HTTP process."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from radixserve.core.config import ConfigError, EngineConfig, ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import CausalLM, HardwarePlatform

logger = logging.getLogger(__name__)


class CpuPlatform(HardwarePlatform):
    name = "cpu"
    device = "cpu"

    def default_dtype(self) -> torch.dtype:
        return torch.float32

    def default_plugins(self) -> dict[str, str]:
        # deterministic mode: torch_native's fixed-split attention (cpu_paged has none)
        paged = _cpu_paged_reason() is None and not self._deterministic
        return {
            "attention": "cpu_paged" if paged else "torch_native",
            "grammar": "xgrammar" if importlib.util.find_spec("xgrammar") else "none",
            "speculative": "none",
            "kv_transfer": "none",
            "hicache_storage": "none",
        }

    def engine_defaults(self, model: ModelConfig, weight_bytes: int) -> dict[str, Any]:
        # A CPU step's time grows with its tokens, so the decodes sharing a step with a
        # 1,024-token chunk wait for all of it (SmolLM2, 32 streams: ITL p99 7x p50). Past 4
        # decodes the chunk shrinks in proportion; fewer decodes still get a full chunk. 4
        # rather than 8 once the engine ran on every core: 64 requests at once, 32 streams,
        # alternating, ITL p99/p50 2.3-3.0 against 3.8-5.2 at the same throughput
        # (bench/HISTORY.md, CPU serving, chunk size and inter-token latency). 2 once the C++
        # kernels made decode steps ~1.5x faster while a chunk's cost stayed: at 4, ITL p99/p50
        # rose to 3.2x (p50 245-282 ms, p99 794-901), at 2 it was 2.3x (288 / 674 ms) at
        # 63.7 tok/s, against 51.9 before the kernels (same VM, same hour; issue 19). 1 once
        # the AVX2 float32 linears made decode steps faster again: at 2, ITL p99/p50 was
        # 1.8-3.2 over three runs (114-153 ms / 275-362), at 1 it was 1.3-1.5 (147-156 /
        # 186-239) at 136-149 against 147-151 tok/s (64 x 256 -> 128, 2026-12-03).
        #
        # Speculation off above 2 decodes: EAGLE-3 on the default model gained at batch 2
        # (JSON 1.61x, code and extraction 1.06x) and lost at batch 4 on every workload
        # (0.80-0.93x) and at 8 (0.76-1.04x): a verify step's rows multiply the linears' work,
        # which 2 cores feel at once (2026-12-03, bench/HISTORY.md).
        return {"prefill_shrink_after_decodes": 1, "speculative_disable_batch_size": 2}

    # A host has far more memory than a CPU-served model's traffic needs; reserving all of
    # --mem-fraction-static of it would starve the machine.
    max_kv_tokens = 1 << 18

    def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return max(int(total * mem_fraction) - weight_bytes, 0)

    def resolve_config(self, config: EngineConfig, model_dir: str) -> EngineConfig:
        # A GGUF model with no --dtype/--quantization: the fast mode (cpu_fast.py)
        from radixserve.plugins.hardware.cpu_fast import fast_mode

        self._deterministic = config.enable_deterministic_inference
        refuse_fp8(self.name, config.quantization)
        return fast_mode(config, model_dir)

    def prepare_model(self, model: CausalLM, config: EngineConfig) -> None:
        # float32 linears multiply by packed copies of their weights (cpu_linear.py)
        from radixserve.plugins.hardware.cpu_linear import (
            default_packing,
            pack_linears,
            packed_linears_unavailable,
        )

        reason = packed_linears_unavailable(model, config)
        if reason is None:
            packing = default_packing()
            assert packing is not None
            logger.debug("packed %d linear layers (%s)", pack_linears(model), packing.name)
        else:
            logger.debug("linear layers stay on MKL: %s", reason)

    def prepare_draft_head(self, head: torch.nn.Module, config: EngineConfig) -> None:
        # A draft head's linears packed as the target's (cpu_linear.py): at one row MKL's
        # matrix-vector product is the slower one. SmolLM2's EAGLE-3 head is small (a 4,096-
        # token draft vocabulary): no gain showed through the noise of an A-B (BENCHMARKS).
        from radixserve.plugins.hardware.cpu_linear import (
            default_packing,
            is_batch_invariant,
            pack_module_linears,
        )

        if config.enable_torch_compile or default_packing() is None:
            return
        # deterministic: rejection sampling reads the draft's probabilities
        if config.enable_deterministic_inference and not is_batch_invariant(default_packing()):
            return
        logger.debug("packed %d linear layers of the draft head", pack_module_linears(head))

    def quantize_model(self, model: CausalLM, method: str) -> None:
        # torch's own CPU weight-only kernels (int8 per row, int4 in groups of 32)
        from radixserve.plugins.models.quant import quantize_model

        refuse_fp8(self.name, method)

        quantize_model(model, method)  # type: ignore[arg-type]

    def step_executor(self, model: Any, attention: Any, kv_pool: Any, req_to_token: Any,
                      config: Any) -> Any:  # fmt: skip
        """Eager steps, or with --enable-torch-compile compiled decode steps of up to
        --torch-compile-max-bs requests (plugins/hardware/cpu_compile.py)."""
        if config.cpu_threads is not None:  # before any compile: kernels keep their count
            self._threads = config.cpu_threads
            if config.cpu_threads != torch.get_num_threads():
                torch.set_num_threads(config.cpu_threads)
        if not config.enable_torch_compile:
            return super().step_executor(model, attention, kv_pool, req_to_token, config)
        from radixserve.plugins.hardware.cpu_compile import CompiledDecode

        max_bs = min(config.torch_compile_max_bs, config.max_running_requests)
        self._compiled = CompiledDecode(model, attention, kv_pool, req_to_token, max_bs)
        return self._compiled

    _compiled: Any = None  # the compiled step executor, when --enable-torch-compile
    _deterministic = False  # --enable-deterministic-inference (resolve_config)
    _threads: int | None = None  # --cpu-threads

    def host_kv_layer_copy(self) -> Callable[..., None]:
        """HiCache's per-layer loads (``CopiesHostKVLayers``): index gathers on the host."""
        return gather_layer_rows

    def seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)

    def bind_rank(self, rank: int, size: int) -> None:
        # Tensor-parallel ranks share the host's cores: each takes its share of the threads,
        # since more threads than cores make every collective wait on a descheduled rank.
        self._ranks = size
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))

    _ranks = 1

    def bind_server_engine(self) -> None:
        # Every core, as offline: leaving one to the HTTP process (the earlier default) cost
        # more than it gave. Same quiet 2-core Intel VM, alternating servers, concurrency 32:
        # 39.2 / 35.7 tok/s with one engine thread against 63.6 / 66.5 with two, ITL and TTFT
        # lower too; at concurrency 1 (int4wo + compile) 44.2 against 46-47.6 tok/s
        # (bench/HISTORY.md, issue 19). --cpu-threads chooses another count.
        if self._ranks == 1:
            threads = self._threads or len(os.sched_getaffinity(0))
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
                if self._compiled is not None:
                    # inductor's C++ kernels keep the thread count they were generated with
                    # (2 threads run on 1 were 10% slower than eager): compile them again
                    self._compiled.recompile()


def gather_layer_rows(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    src_rows: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """``dst_k[dst_rows] = src_k[src_rows]``, the same for V (``CopiesHostKVLayers``)."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        if dst.element_size() == 1:  # FP8: as bytes (torch's CPU index_copy_ takes no FP8)
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)
        dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))


def refuse_fp8(platform: str, method: str | None) -> None:
    """The CPU has no FP8 kernels: say so before anything is loaded (an FP8 checkpoint still
    loads without --quantization, dequantized to the model's dtype)."""
    if method == "fp8":
        raise ConfigError(
            f"--quantization fp8 is not supported on the {platform} platform (FP8 runs on CUDA); "
            "on the CPU choose int8wo, int4wo, w8a8_int8 or gguf"
        )


def _cpu_paged_reason() -> str | None:
    """Why the cpu_paged attention (a C++ decode kernel, built on first use) cannot be the
    default here; torch_native is then."""
    from radixserve.plugins.hardware.cpu_kernels import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        logger.debug("attention defaults to torch_native: cpu_paged unavailable (%s)", reason)
    return reason


@hookimpl
def register_hardware_platforms(register) -> None:  # type: ignore[no-untyped-def]
    # Lowest priority: any accelerator platform that is available wins over the CPU.
    register("cpu", CpuPlatform, description="host CPU (float32)", priority=0)
