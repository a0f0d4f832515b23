"""EngineConfig's checks: each raises ConfigError naming the setting and what would work
(core/config.py calls them from ``EngineConfig.__post_init__``)."""

from __future__ import annotations

import json
from typing import Any

# NOTE: ``cfg`` is an EngineConfig (core/config.py), typed Any here: config.py imports this
# module, and importing it back, even for types, would make a cycle.
EngineConfig = Any


class ConfigError(ValueError):
    """A bad setting or model directory; the message names the setting and what would work."""


PAGE_SIZES = tuple(1 << i for i in range(9))  # 1 .. 256
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
LOG_LEVELS = ("debug", "info", "warning", "error")
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: the KV cache's: the model's dtypes, or FP8 e4m3 with a scale per layer (triton, torch_native)
KV_DTYPES = (*DTYPES, "fp8_e4m3")
# the hardware platform runs them (quantize_model)
QUANTIZATIONS = ("int8wo", "int4wo", "w8a8_int8", "gguf", "fp8")
DISAGGREGATION_MODES = ("null", "prefill", "decode")


def check_limits(cfg: EngineConfig) -> None:
    if not cfg.grammar_compile_timeout > 0:
        raise ConfigError(
            f"grammar_compile_timeout must be > 0 seconds, got {cfg.grammar_compile_timeout}"
        )
    if cfg.grammar_compile_memory < 64:
        raise ConfigError(
            f"grammar_compile_memory must be >= 64 MiB, got {cfg.grammar_compile_memory}"
        )
    if not cfg.watchdog_timeout > 0:
        raise ConfigError(f"watchdog_timeout must be > 0 seconds, got {cfg.watchdog_timeout}")
    if cfg.tp_size < 1:
        raise ConfigError(f"tp_size must be >= 1, got {cfg.tp_size}")
    if cfg.pp_size < 1:
        raise ConfigError(f"pp_size must be >= 1, got {cfg.pp_size}")
    check_pipeline(cfg)
    if cfg.cpu_threads is not None and cfg.cpu_threads < 1:
        raise ConfigError(f"cpu_threads must be >= 1, got {cfg.cpu_threads}")
    if cfg.cuda_graph_max_prefill_tokens < 0:
        raise ConfigError(
            "cuda_graph_max_prefill_tokens must be >= 0 (0: no prefill graphs), got "
            f"{cfg.cuda_graph_max_prefill_tokens}"
        )
    if cfg.torch_compile_max_bs < 1:
        raise ConfigError(f"torch_compile_max_bs must be >= 1, got {cfg.torch_compile_max_bs}")
    if cfg.max_running_requests is not None and cfg.max_running_requests < 1:
        raise ConfigError(f"max_running_requests must be >= 1, got {cfg.max_running_requests}")
    if cfg.max_total_tokens is not None and cfg.max_total_tokens < 16:
        raise ConfigError(f"max_total_tokens must be >= 16, got {cfg.max_total_tokens}")
    if cfg.page_size not in PAGE_SIZES:
        raise ConfigError(
            f"page_size must be a power of two from 1 to {PAGE_SIZES[-1]}, got {cfg.page_size}"
        )
    if cfg.max_total_tokens is not None and cfg.max_total_tokens < 2 * cfg.page_size:
        raise ConfigError(
            f"max_total_tokens={cfg.max_total_tokens} holds no page of page_size="
            f"{cfg.page_size} besides the reserved one; give at least {2 * cfg.page_size}"
        )


def check_choices(cfg: EngineConfig) -> None:
    shrink = cfg.prefill_shrink_after_decodes
    if shrink is not None and shrink < 0:
        raise ConfigError(f"prefill_shrink_after_decodes must be >= 0, got {shrink}")
    gather = cfg.prefill_gather_steps
    if gather is not None and gather < 0:
        raise ConfigError(f"prefill_gather_steps must be >= 0, got {gather}")
    chunk = cfg.chunked_prefill_size
    if chunk is not None and (chunk == 0 or chunk < -1):
        raise ConfigError(
            f"chunked_prefill_size must be positive or -1, got {cfg.chunked_prefill_size}"
        )
    if not cfg.schedule_conservativeness >= 0:
        raise ConfigError(
            f"schedule_conservativeness must be >= 0, got {cfg.schedule_conservativeness}"
        )
    if not 0.0 <= cfg.session_pin_ratio <= 1.0:
        raise ConfigError(f"session_pin_ratio must be in [0, 1], got {cfg.session_pin_ratio}")
    if cfg.priority_aging_steps < 1:
        raise ConfigError(f"priority_aging_steps must be >= 1, got {cfg.priority_aging_steps}")
    if cfg.schedule_policy not in SCHEDULE_POLICIES:
        raise ConfigError(
            f"unknown schedule policy '{cfg.schedule_policy}'; "
            f"choose one of {', '.join(SCHEDULE_POLICIES)}"
        )
    if cfg.log_level not in LOG_LEVELS:
        raise ConfigError(
            f"unknown log level '{cfg.log_level}'; choose one of {', '.join(LOG_LEVELS)}"
        )
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{cfg.dtype}'; choose one of {', '.join(DTYPES)}")
    if cfg.kv_cache_dtype not in KV_DTYPES:
        raise ConfigError(
            f"unknown kv_cache_dtype '{cfg.kv_cache_dtype}'; choose one of {', '.join(KV_DTYPES)}"
        )
    if cfg.quantization is not None and cfg.quantization not in QUANTIZATIONS:
        raise ConfigError(
            f"unknown quantization '{cfg.quantization}'; choose one of {', '.join(QUANTIZATIONS)}"
        )
    if cfg.mem_fraction_static is not None and not 0.0 < cfg.mem_fraction_static <= 1.0:
        raise ConfigError(f"mem_fraction_static must be in (0, 1], got {cfg.mem_fraction_static}")


def check_nodes(cfg: EngineConfig) -> None:
    """Multi-node launch and expert parallelism (docs/parallelism.md)."""
    if cfg.nnodes < 1 or not 0 <= cfg.node_rank < cfg.nnodes:
        raise ConfigError(
            f"need nnodes >= 1 and 0 <= node_rank < nnodes, got {cfg.nnodes} and {cfg.node_rank}"
        )
    if cfg.tp_size % cfg.nnodes:
        raise ConfigError(
            f"tp_size={cfg.tp_size} does not divide over nnodes={cfg.nnodes}: each node runs "
            "tp_size / nnodes ranks"
        )
    if cfg.nnodes > 1:
        host, _, port = (cfg.dist_init_addr or "").rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) < 65535:
            raise ConfigError(
                f"nnodes={cfg.nnodes} needs dist_init_addr host:port (node 0's address, a free "
                f"port and the next one), got {cfg.dist_init_addr!r}"
            )
    if cfg.ep_size not in (1, cfg.tp_size):
        raise ConfigError(
            f"ep_size={cfg.ep_size} must be 1 or equal tp_size={cfg.tp_size}: the experts are "
            "spread over the tensor-parallel ranks (give --tp-size and --ep-size the same N)"
        )


def check_disaggregation(cfg: EngineConfig) -> None:
    if cfg.disaggregation_mode not in DISAGGREGATION_MODES:
        raise ConfigError(
            f"unknown disaggregation mode '{cfg.disaggregation_mode}'; "
            f"choose one of {', '.join(DISAGGREGATION_MODES)}"
        )
    if not 1 <= cfg.disaggregation_bootstrap_port <= 65535:
        raise ConfigError(
            "disaggregation_bootstrap_port must be a TCP port (1-65535), got "
            f"{cfg.disaggregation_bootstrap_port}"
        )
    if not cfg.disaggregation_transfer_timeout > 0:
        raise ConfigError(
            "disaggregation_transfer_timeout must be > 0 seconds, got "
            f"{cfg.disaggregation_transfer_timeout}"
        )


def check_speculative(cfg: EngineConfig) -> None:
    for name in ("speculative_num_steps", "speculative_num_draft_tokens"):
        value = getattr(cfg, name)
        if value is not None and not 1 <= value - (name.endswith("tokens")) <= 64:
            raise ConfigError(f"{name} must give 1 to 64 draft tokens, got {value}")
    topk = cfg.speculative_eagle_topk
    if not 1 <= topk <= 16:
        raise ConfigError(f"speculative_eagle_topk must be 1 to 16, got {topk}")
    if topk > 1 and cfg.page_size != 1:
        raise ConfigError(
            f"speculative_eagle_topk {topk} (draft trees) needs --page-size 1: a tree's "
            f"nodes take single KV slots, got page_size {cfg.page_size}"
        )
    if topk > 1 and cfg.speculative_simulate_accept_len is not None:
        raise ConfigError(
            "speculative_simulate_accept_len simulates chains; use it with speculative_eagle_topk 1"
        )
    if cfg.speculative_disable_batch_size is not None and cfg.speculative_disable_batch_size < 1:
        raise ConfigError(
            f"speculative_disable_batch_size must be >= 1, got {cfg.speculative_disable_batch_size}"
        )
    lo = cfg.speculative_ngram_min_match_window_size
    hi = cfg.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        raise ConfigError(
            "need 1 <= speculative_ngram_min_match_window_size <= "
            f"speculative_ngram_max_match_window_size, got {lo} and {hi}"
        )
    acc = cfg.speculative_simulate_accept_len
    if acc is not None and not 1.0 <= acc <= cfg.num_draft_tokens + 1:
        raise ConfigError(
            f"speculative_simulate_accept_len must be in [1, {cfg.num_draft_tokens + 1}] "
            f"(draft tokens + 1), got {acc}"
        )


def check_pipeline(cfg: EngineConfig) -> None:
    """What pipeline parallelism does not run with, refused in one line each."""
    if cfg.pp_size == 1:
        return
    refused = {
        "speculative decoding": cfg.speculative_algorithm is not None,
        f"disaggregation_mode={cfg.disaggregation_mode}": cfg.disaggregation_mode != "null",
        f"--quantization {cfg.quantization}": cfg.quantization is not None,
        "--enable-torch-compile": cfg.enable_torch_compile,
        f"--nnodes {cfg.nnodes}": cfg.nnodes > 1,
        f"--ep-size {cfg.ep_size}": cfg.ep_size > 1,
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(f"{what} does not run with pp_size={cfg.pp_size} yet")


#: the projections LoRA adapters may adapt (PEFT's module names)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_BACKENDS = ("torch", "triton")


def check_lora(cfg: EngineConfig) -> None:
    """The LoRA flags; an empty --lora-target-modules becomes every module (the config is
    frozen: resolved here only)."""
    targets = tuple(cfg.lora_target_modules) or LORA_MODULES
    object.__setattr__(cfg, "lora_target_modules", targets)
    object.__setattr__(cfg, "lora_paths", tuple(cfg.lora_paths))
    unknown = [t for t in targets if t not in LORA_MODULES]
    if unknown:
        raise ConfigError(
            f"--lora-target-modules '{unknown[0]}' is unknown; choose from "
            f"{', '.join(LORA_MODULES)}"
        )
    if cfg.max_loras_per_batch < 1 or cfg.max_lora_rank < 1:
        raise ConfigError(
            "--max-loras-per-batch and --max-lora-rank must be >= 1, got "
            f"{cfg.max_loras_per_batch} and {cfg.max_lora_rank}"
        )
    if cfg.lora_backend is not None and cfg.lora_backend not in LORA_BACKENDS:
        raise ConfigError(
            f"--lora-backend '{cfg.lora_backend}' is unknown; choose {' or '.join(LORA_BACKENDS)}"
        )
    if cfg.lora_paths:  # as SGLang: adapters at start turn LoRA on
        object.__setattr__(cfg, "enable_lora", True)


HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_IO_BACKENDS = ("direct", "kernel")
HICACHE_MEM_LAYOUTS = ("layer_first", "page_first")
HICACHE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def check_hicache(cfg: EngineConfig) -> None:
    """The hierarchical cache's settings, and the combinations it does not serve."""
    for name, value, choices in (
        ("hicache_write_policy", cfg.hicache_write_policy, HICACHE_WRITE_POLICIES),
        ("hicache_io_backend", cfg.hicache_io_backend, HICACHE_IO_BACKENDS),
        ("hicache_mem_layout", cfg.hicache_mem_layout, HICACHE_MEM_LAYOUTS),
        ("hicache_storage_prefetch_policy", cfg.hicache_storage_prefetch_policy,
         HICACHE_PREFETCH_POLICIES),
    ):  # fmt: skip
        if value is not None and value not in choices:
            raise ConfigError(f"unknown {name} '{value}'; choose one of {', '.join(choices)}")
    if not cfg.hicache_ratio > 0:
        raise ConfigError(f"hicache_ratio must be > 0, got {cfg.hicache_ratio}")
    if cfg.hicache_size is not None and not cfg.hicache_size > 0:
        raise ConfigError(f"hicache_size must be > 0 GB, got {cfg.hicache_size}")
    extra = cfg.hicache_storage_backend_extra_config
    if extra is not None:
        try:
            parsed = json.loads(extra)
        except ValueError as e:
            raise ConfigError(f"hicache_storage_backend_extra_config is not JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise ConfigError("hicache_storage_backend_extra_config must be a JSON object")
    if not cfg.enable_hierarchical_cache:
        if cfg.enable_hicache_prefetch:
            raise ConfigError("--enable-hicache-prefetch needs --enable-hierarchical-cache")
        return
    refused = {
        "--disable-radix-cache": cfg.disable_radix_cache,
        "speculative decoding": any(
            p.replace(" ", "").startswith("speculative=") and not p.endswith("none")
            for p in cfg.plugins
        ),
        "--disaggregation-mode prefill|decode": cfg.disaggregation_mode != "null",
        "--tp-size > 1": cfg.tp_size > 1,
        "--pp-size > 1": cfg.pp_size > 1,
        # adapters given at start turn LoRA on (check_lora, which runs after this check)
        "--enable-lora": cfg.enable_lora or bool(cfg.lora_paths),
    }
    for flag, on in refused.items():
        if on:
            raise ConfigError(
                f"--enable-hierarchical-cache does not work with {flag} yet "
                "(docs/hicache.md lists what it serves); drop one of them"
            )


def check_deterministic(cfg: EngineConfig) -> None:
    """What --enable-deterministic-inference cannot make batch-invariant, refused in one line
    each (docs/deterministic.md)."""
    if not cfg.enable_deterministic_inference:
        return
    refused = {
        f"--tp-size {cfg.tp_size}": (cfg.tp_size > 1, "an all-reduce's order depends on its size"),
        f"--pp-size {cfg.pp_size}": (cfg.pp_size > 1, "not built for pipeline stages yet"),
        f"--quantization {cfg.quantization}": (
            cfg.quantization is not None,
            "the quantized kernels choose their tiling by row count",
        ),
        "--enable-lora": (cfg.enable_lora, "the adapter kernels group rows by adapter"),
        "--enable-torch-compile": (
            cfg.enable_torch_compile,
            "inductor generates different kernels per batch size",
        ),
    }
    for flag, (on, why) in refused.items():
        if on:
            raise ConfigError(f"--enable-deterministic-inference does not run with {flag}: {why}")
