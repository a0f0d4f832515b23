"""core/config_checks.py: each EngineConfig setting refused with the message that names it and
what would work, and the values on each bound accepted (no engine: a config only)."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.core.config import EngineConfig
from radixserve.core.config_checks import (
    HICACHE_IO_BACKENDS,
    HICACHE_MEM_LAYOUTS,
    HICACHE_PREFETCH_POLICIES,
    HICACHE_WRITE_POLICIES,
    KV_DTYPES,
    LORA_BACKENDS,
    LORA_MODULES,
    PAGE_SIZES,
    QUANTIZATIONS,
    ConfigError,
)

PP = {"pp_size": 2}
HI = {"enable_hierarchical_cache": True}
DET = {"enable_deterministic_inference": True}
NOT_HI = "(docs/hicache.md lists what it serves); drop one of them"

REFUSED: list[tuple[dict[str, Any], str]] = [
    # limits
    ({"grammar_compile_timeout": 0}, "grammar_compile_timeout must be > 0 seconds, got 0"),
    ({"grammar_compile_memory": 63}, "grammar_compile_memory must be >= 64 MiB, got 63"),
    ({"watchdog_timeout": 0}, "watchdog_timeout must be > 0 seconds, got 0"),
    ({"watchdog_timeout": float("nan")}, "watchdog_timeout must be > 0 seconds, got nan"),
    ({"tp_size": 0}, "tp_size must be >= 1, got 0"),
    ({"pp_size": 0}, "pp_size must be >= 1, got 0"),
    ({"cpu_threads": 0}, "cpu_threads must be >= 1, got 0"),
    (
        {"cuda_graph_max_prefill_tokens": -1},
        "cuda_graph_max_prefill_tokens must be >= 0 (0: no prefill graphs), got -1",
    ),
    ({"torch_compile_max_bs": 0}, "torch_compile_max_bs must be >= 1, got 0"),
    ({"max_running_requests": 0}, "max_running_requests must be >= 1, got 0"),
    ({"max_total_tokens": 15}, "max_total_tokens must be >= 16, got 15"),
    ({"page_size": 3}, "page_size must be a power of two from 1 to 256, got 3"),
    ({"page_size": 512}, "page_size must be a power of two from 1 to 256, got 512"),
    (
        {"page_size": 16, "max_total_tokens": 31},
        "max_total_tokens=31 holds no page of page_size=16 besides the reserved one; "
        "give at least 32",
    ),
    # choices
    ({"prefill_shrink_after_decodes": -1}, "prefill_shrink_after_decodes must be >= 0, got -1"),
    ({"prefill_gather_steps": -1}, "prefill_gather_steps must be >= 0, got -1"),
    ({"chunked_prefill_size": 0}, "chunked_prefill_size must be positive or -1, got 0"),
    ({"chunked_prefill_size": -2}, "chunked_prefill_size must be positive or -1, got -2"),
    ({"schedule_conservativeness": -0.1}, "schedule_conservativeness must be >= 0, got -0.1"),
    (
        {"schedule_conservativeness": float("nan")},
        "schedule_conservativeness must be >= 0, got nan",
    ),
    ({"session_pin_ratio": -0.1}, "session_pin_ratio must be in [0, 1], got -0.1"),
    ({"session_pin_ratio": 1.1}, "session_pin_ratio must be in [0, 1], got 1.1"),
    ({"priority_aging_steps": 0}, "priority_aging_steps must be >= 1, got 0"),
    (
        {"schedule_policy": "lifo"},
        "unknown schedule policy 'lifo'; choose one of lpm, dfs-weight, fcfs, random",
    ),
    (
        {"log_level": "trace"},
        "unknown log level 'trace'; choose one of debug, info, warning, error",
    ),
    ({"dtype": "int8"}, "unknown dtype 'int8'; choose one of auto, float32, bfloat16, float16"),
    (
        {"kv_cache_dtype": "fp8_e5m2"},
        "unknown kv_cache_dtype 'fp8_e5m2'; choose one of auto, float32, bfloat16, float16, "
        "fp8_e4m3",
    ),
    (
        {"quantization": "awq"},
        "unknown quantization 'awq'; choose one of int8wo, int4wo, w8a8_int8, gguf, fp8",
    ),
    ({"mem_fraction_static": 0.0}, "mem_fraction_static must be in (0, 1], got 0.0"),
    ({"mem_fraction_static": 1.01}, "mem_fraction_static must be in (0, 1], got 1.01"),
    # nodes
    ({"nnodes": 0}, "need nnodes >= 1 and 0 <= node_rank < nnodes, got 0 and 0"),
    ({"node_rank": -1}, "need nnodes >= 1 and 0 <= node_rank < nnodes, got 1 and -1"),
    ({"node_rank": 1}, "need nnodes >= 1 and 0 <= node_rank < nnodes, got 1 and 1"),
    (
        {"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:5000"},
        "tp_size=3 does not divide over nnodes=2: each node runs tp_size / nnodes ranks",
    ),
    (
        {"nnodes": 2, "tp_size": 2},
        "nnodes=2 needs dist_init_addr host:port (node 0's address, a free port and the next "
        "one), got None",
    ),
    (
        {"nnodes": 2, "tp_size": 2, "dist_init_addr": ":5000"},
        "nnodes=2 needs dist_init_addr host:port (node 0's address, a free port and the next "
        "one), got ':5000'",
    ),
    ({"nnodes": 2, "tp_size": 2, "dist_init_addr": "h:"}, "got 'h:'"),
    ({"nnodes": 2, "tp_size": 2, "dist_init_addr": "h:x1"}, "got 'h:x1'"),
    ({"nnodes": 2, "tp_size": 2, "dist_init_addr": "h:0"}, "got 'h:0'"),
    ({"nnodes": 2, "tp_size": 2, "dist_init_addr": "h:65535"}, "got 'h:65535'"),
    ({"nnodes": 2, "tp_size": 2, "dist_init_addr": "h"}, "got 'h'"),
    (
        {"ep_size": 2},
        "ep_size=2 must be 1 or equal tp_size=1: the experts are spread over the "
        "tensor-parallel ranks (give --tp-size and --ep-size the same N)",
    ),
    # disaggregation
    (
        {"disaggregation_mode": "both"},
        "unknown disaggregation mode 'both'; choose one of null, prefill, decode",
    ),
    (
        {"disaggregation_bootstrap_port": 0},
        "disaggregation_bootstrap_port must be a TCP port (1-65535), got 0",
    ),
    (
        {"disaggregation_bootstrap_port": 65536},
        "disaggregation_bootstrap_port must be a TCP port (1-65535), got 65536",
    ),
    (
        {"disaggregation_transfer_timeout": 0},
        "disaggregation_transfer_timeout must be > 0 seconds, got 0",
    ),
    # speculative decoding
    ({"speculative_num_steps": 0}, "speculative_num_steps must give 1 to 64 draft tokens, got 0"),
    (
        {"speculative_num_steps": 65},
        "speculative_num_steps must give 1 to 64 draft tokens, got 65",
    ),
    (
        {"speculative_num_draft_tokens": 1},
        "speculative_num_draft_tokens must give 1 to 64 draft tokens, got 1",
    ),
    (
        {"speculative_num_draft_tokens": 66},
        "speculative_num_draft_tokens must give 1 to 64 draft tokens, got 66",
    ),
    ({"speculative_eagle_topk": 0}, "speculative_eagle_topk must be 1 to 16, got 0"),
    ({"speculative_eagle_topk": 17}, "speculative_eagle_topk must be 1 to 16, got 17"),
    (
        {"speculative_eagle_topk": 2, "page_size": 16},
        "speculative_eagle_topk 2 (draft trees) needs --page-size 1: a tree's nodes take "
        "single KV slots, got page_size 16",
    ),
    (
        {"speculative_eagle_topk": 2, "speculative_simulate_accept_len": 2.0},
        "speculative_simulate_accept_len simulates chains; use it with speculative_eagle_topk 1",
    ),
    (
        {"speculative_disable_batch_size": 0},
        "speculative_disable_batch_size must be >= 1, got 0",
    ),
    (
        {"speculative_ngram_min_match_window_size": 0},
        "need 1 <= speculative_ngram_min_match_window_size <= "
        "speculative_ngram_max_match_window_size, got 0 and 12",
    ),
    (
        {"speculative_ngram_min_match_window_size": 13},
        "need 1 <= speculative_ngram_min_match_window_size <= "
        "speculative_ngram_max_match_window_size, got 13 and 12",
    ),
    (
        {"speculative_simulate_accept_len": 0.9},
        "speculative_simulate_accept_len must be in [1, 5] (draft tokens + 1), got 0.9",
    ),
    (
        {"speculative_simulate_accept_len": 5.5},
        "speculative_simulate_accept_len must be in [1, 5] (draft tokens + 1), got 5.5",
    ),
    (
        {"speculative_simulate_accept_len": 3.5, "speculative_num_steps": 2},
        "speculative_simulate_accept_len must be in [1, 3] (draft tokens + 1), got 3.5",
    ),
    # pipeline parallelism
    (
        {**PP, "speculative_algorithm": "ngram"},
        "speculative decoding does not run with pp_size=2 yet",
    ),
    (
        {**PP, "disaggregation_mode": "prefill"},
        "disaggregation_mode=prefill does not run with pp_size=2 yet",
    ),
    ({**PP, "quantization": "int8wo"}, "--quantization int8wo does not run with pp_size=2 yet"),
    (
        {**PP, "enable_torch_compile": True},
        "--enable-torch-compile does not run with pp_size=2 yet",
    ),
    (
        {**PP, "nnodes": 2, "tp_size": 2, "dist_init_addr": "h:1"},
        "--nnodes 2 does not run with pp_size=2 yet",
    ),
    ({**PP, "ep_size": 2, "tp_size": 2}, "--ep-size 2 does not run with pp_size=2 yet"),
    # LoRA
    (
        {"lora_target_modules": ("q_proj", "lm_head", "wte")},
        "--lora-target-modules 'lm_head' is unknown; choose from q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj",
    ),
    (
        {"max_loras_per_batch": 0},
        "--max-loras-per-batch and --max-lora-rank must be >= 1, got 0 and 64",
    ),
    ({"max_lora_rank": 0}, "--max-loras-per-batch and --max-lora-rank must be >= 1, got 8 and 0"),
    ({"lora_backend": "cuda"}, "--lora-backend 'cuda' is unknown; choose torch or triton"),
    # hierarchical cache
    (
        {"hicache_write_policy": "x"},
        "unknown hicache_write_policy 'x'; choose one of write_through, "
        "write_through_selective, write_back",
    ),
    ({"hicache_io_backend": "x"}, "unknown hicache_io_backend 'x'; choose one of direct, kernel"),
    (
        {"hicache_mem_layout": "x"},
        "unknown hicache_mem_layout 'x'; choose one of layer_first, page_first",
    ),
    (
        {"hicache_storage_prefetch_policy": "x"},
        "unknown hicache_storage_prefetch_policy 'x'; choose one of best_effort, "
        "wait_complete, timeout",
    ),
    ({"hicache_ratio": 0}, "hicache_ratio must be > 0, got 0"),
    ({"hicache_ratio": float("nan")}, "hicache_ratio must be > 0, got nan"),
    ({"hicache_size": 0}, "hicache_size must be > 0 GB, got 0"),
    (
        {"hicache_storage_backend_extra_config": "{"},
        "hicache_storage_backend_extra_config is not JSON: Expecting property name enclosed "
        "in double quotes: line 1 column 2 (char 1)",
    ),
    (
        {"hicache_storage_backend_extra_config": "[1]"},
        "hicache_storage_backend_extra_config must be a JSON object",
    ),
    (
        {"enable_hicache_prefetch": True},
        "--enable-hicache-prefetch needs --enable-hierarchical-cache",
    ),
    (
        {**HI, "disable_radix_cache": True},
        f"--enable-hierarchical-cache does not work with --disable-radix-cache yet {NOT_HI}",
    ),
    (
        {**HI, "plugins": ("grammar=none", "speculative=ngram")},
        f"--enable-hierarchical-cache does not work with speculative decoding yet {NOT_HI}",
    ),
    (
        {**HI, "plugins": ("speculative = ngram",)},
        f"--enable-hierarchical-cache does not work with speculative decoding yet {NOT_HI}",
    ),
    (
        {**HI, "disaggregation_mode": "decode"},
        "--enable-hierarchical-cache does not work with --disaggregation-mode prefill|decode "
        f"yet {NOT_HI}",
    ),
    (
        {**HI, "tp_size": 2},
        f"--enable-hierarchical-cache does not work with --tp-size > 1 yet {NOT_HI}",
    ),
    (
        {**HI, "pp_size": 2},
        f"--enable-hierarchical-cache does not work with --pp-size > 1 yet {NOT_HI}",
    ),
    (
        {**HI, "enable_lora": True},
        f"--enable-hierarchical-cache does not work with --enable-lora yet {NOT_HI}",
    ),
    (
        {**HI, "lora_paths": ("a=/x",)},
        f"--enable-hierarchical-cache does not work with --enable-lora yet {NOT_HI}",
    ),
    # deterministic inference
    (
        {**DET, "tp_size": 2},
        "--enable-deterministic-inference does not run with --tp-size 2: an all-reduce's "
        "order depends on its size",
    ),
    (
        {**DET, "pp_size": 2},
        "--enable-deterministic-inference does not run with --pp-size 2: not built for "
        "pipeline stages yet",
    ),
    (
        {**DET, "quantization": "int4wo"},
        "--enable-deterministic-inference does not run with --quantization int4wo: the "
        "quantized kernels choose their tiling by row count",
    ),
    (
        {**DET, "enable_lora": True},
        "--enable-deterministic-inference does not run with --enable-lora: the adapter "
        "kernels group rows by adapter",
    ),
    (
        {**DET, "enable_torch_compile": True},
        "--enable-deterministic-inference does not run with --enable-torch-compile: inductor "
        "generates different kernels per batch size",
    ),
]


@pytest.mark.parametrize(("settings", "message"), REFUSED)
def test_a_bad_setting_is_named(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        EngineConfig(**settings)
    text = str(err.value)
    assert text == message if not message.startswith("got ") else text.endswith(message)


ACCEPTED: list[dict[str, Any]] = [
    {"grammar_compile_timeout": 0.001, "grammar_compile_memory": 64, "watchdog_timeout": 0.01},
    {"cpu_threads": 1, "cuda_graph_max_prefill_tokens": 0, "torch_compile_max_bs": 1},
    {"max_running_requests": 1, "max_total_tokens": 16},
    {"page_size": 8, "max_total_tokens": 16},
    {"page_size": 256, "max_total_tokens": 512},
    {"prefill_shrink_after_decodes": 0, "prefill_gather_steps": 0},
    {"chunked_prefill_size": -1},
    {"chunked_prefill_size": 1},
    {"schedule_conservativeness": 0, "session_pin_ratio": 0.0, "priority_aging_steps": 1},
    {"session_pin_ratio": 1.0},
    {"mem_fraction_static": 1.0},
    {"mem_fraction_static": 1e-6},
    {"quantization": "gguf", "kv_cache_dtype": "fp8_e4m3", "dtype": "float16"},
    {"schedule_policy": "random", "log_level": "debug"},
    {"nnodes": 2, "node_rank": 1, "tp_size": 4, "ep_size": 4, "dist_init_addr": "[::1]:1"},
    {"nnodes": 2, "tp_size": 2, "dist_init_addr": "node0:65534"},
    {"disaggregation_bootstrap_port": 1, "disaggregation_transfer_timeout": 0.1},
    {"disaggregation_bootstrap_port": 65535},
    {"speculative_num_steps": 1, "speculative_num_draft_tokens": 2},
    {"speculative_num_steps": 64, "speculative_num_draft_tokens": 65},
    {"speculative_eagle_topk": 16, "speculative_disable_batch_size": 1},
    {
        "speculative_ngram_min_match_window_size": 12,
        "speculative_ngram_max_match_window_size": 12,
    },
    {"speculative_ngram_min_match_window_size": 1},
    {"speculative_simulate_accept_len": 1.0},
    {"speculative_simulate_accept_len": 5.0},
    {"pp_size": 2, "disaggregation_mode": "null"},
    {"lora_backend": "triton", "max_loras_per_batch": 1, "max_lora_rank": 1},
    {"hicache_ratio": 0.01, "hicache_size": 0.01, "hicache_storage_backend_extra_config": "{}"},
    {**HI, "plugins": ("speculative=none",)},
    {**HI, "plugins": ("grammar=xgrammar",)},
    {**DET},
]


@pytest.mark.parametrize("settings", ACCEPTED)
def test_values_on_the_bounds_pass(settings: dict[str, Any]) -> None:
    cfg = EngineConfig(**settings)
    for key, value in settings.items():
        assert getattr(cfg, key) == value, key


def test_the_choices_offered() -> None:
    assert PAGE_SIZES == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert KV_DTYPES == ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
    assert QUANTIZATIONS == ("int8wo", "int4wo", "w8a8_int8", "gguf", "fp8")
    assert LORA_MODULES[0] == "q_proj" and len(LORA_MODULES) == 7
    assert LORA_BACKENDS == ("torch", "triton")
    assert HICACHE_WRITE_POLICIES[0] == "write_through"
    assert (HICACHE_IO_BACKENDS, HICACHE_MEM_LAYOUTS) == (
        ("direct", "kernel"),
        ("layer_first", "page_first"),
    )
    assert HICACHE_PREFETCH_POLICIES == ("best_effort", "wait_complete", "timeout")
    for choice in HICACHE_WRITE_POLICIES:
        assert EngineConfig(hicache_write_policy=choice).hicache_write_policy == choice
    for choice in HICACHE_PREFETCH_POLICIES:
        cfg = EngineConfig(hicache_storage_prefetch_policy=choice)
        assert cfg.hicache_storage_prefetch_policy == choice


def test_lora_settings_are_resolved() -> None:
    cfg = EngineConfig()
    assert (cfg.lora_target_modules, cfg.lora_paths, cfg.enable_lora) == (LORA_MODULES, (), False)
    cfg = EngineConfig(lora_target_modules=["o_proj", "q_proj"], lora_paths=["a=/x", "b=/y"])
    assert cfg.lora_target_modules == ("o_proj", "q_proj")
    assert cfg.lora_paths == ("a=/x", "b=/y")
    assert cfg.enable_lora  # adapters at start turn LoRA on
    assert EngineConfig(enable_lora=True).enable_lora
