"""Configuration: the engine's settings (EngineConfig); the model's shape (ModelConfig) is in
``model_config.py`` and re-exported here.

Each EngineConfig field carries its ``--help`` text in ``metadata["help"]``; the CLI builds its
flags from these fields so there is one source of truth.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from radixserve.core import config_checks
from radixserve.core.config_checks import (  # noqa: F401 - re-exported: they lived here first
    DISAGGREGATION_MODES,
    DTYPES,
    LOG_LEVELS,
    PAGE_SIZES,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    ConfigError,
)
from radixserve.core.model_config import ModelConfig  # noqa: F401 - re-exported: it lived here
from radixserve.core.platform_settings import (  # noqa: F401 - re-exported: they lived here
    CORE_DEFAULTS,
    PlatformSettings,
)


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of the engine (scheduler, KV pool, plugins). Resolved before freezing."""

    model_path: str | None = _opt(
        None, "Model: an HF-layout directory or a .gguf file (default: SmolLM2-135M-Instruct)"
    )
    served_model_name: str | None = _opt(None, "Model name reported by the API")
    plugins: tuple[str, ...] = _opt((), "Plugin selection KIND=NAME (repeatable)")
    plugin_allow: tuple[str, ...] = _opt(
        (),
        "Load only these third-party entry-point plugins (repeatable; built-ins always load; "
        "default: every installed one)",
        metavar="NAME",
    )
    dtype: str = _opt(
        "auto",
        "Weight and KV dtype: auto, float32, bfloat16, float16. On the CPU, a GGUF model with "
        "no --dtype or --quantization runs the fast mode (its 4-bit blocks, float16 KV; "
        "docs/cpu_modes.md); --dtype float32 gives transformers' outputs",
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache dtype: auto (the model's dtype), float32, bfloat16, float16 or fp8_e4m3. A "
        "16-bit cache beside float32 weights halves the KV memory and the bytes decode "
        "attention reads (the torch_native and cpu_paged attention backends); fp8_e4m3 halves "
        "a bfloat16 cache (triton and torch_native; a scale per layer: the checkpoint's "
        "k_scale/v_scale, else 1.0)",
    )
    quantization: str | None = _opt(
        None,
        "Quantization of the linear layers at load: int8wo (int8, a scale per row) or int4wo "
        "(4-bit groups of 32 with scale and zero, the layout of GGUF Q4_1), both weight-only "
        "with bfloat16 activations; or w8a8_int8 (int8 weights and int8 activations "
        "quantized per step, on fbgemm); or gguf (GGUF's Q4_1 blocks, multiplied as llama.cpp "
        "does: activations in 8-bit blocks of 32; radixserve's CPU kernels); those four on the "
        "CPU. On CUDA: fp8 (FP8 e4m3 weights, the checkpoint's own for an FP8 checkpoint, else "
        "a scale per row; activations scaled per token; docs/quantization.md). Default: none "
        "(the weights as loaded), except gguf in the CPU fast mode (see --dtype) and fp8 for "
        "an FP8 checkpoint on CUDA",
    )
    context_length: int | None = _opt(None, "Maximum tokens per request (prompt + output)")
    max_running_requests: int | None = _opt(
        None, "Most requests decoding at once (default: the hardware platform's)"
    )
    max_total_tokens: int | None = _opt(
        None, "KV pool size in tokens (default: from --mem-fraction-static)"
    )
    mem_fraction_static: float | None = _opt(
        None, "Fraction of device memory for weights + KV pool (default: the hardware platform's)"
    )
    page_size: int = _opt(
        1,
        "Tokens per KV page (a power of two, 1 to 256); prefix-cache matches are whole pages",
    )
    chunked_prefill_size: int | None = _opt(
        None,
        "Most tokens computed per step (prefill chunks + decodes); -1 disables chunking "
        "(default: the hardware platform's)",
    )
    prefill_shrink_after_decodes: int | None = _opt(
        None,
        "Past this many decodes in a step, the step's prefill tokens shrink in proportion "
        "(chunk x this / decodes), so decodes sharing a step with a prefill chunk wait less "
        "for it (inter-token latency); 0: every step takes a full chunk "
        "(default: the hardware platform's)",
    )
    prefill_gather_steps: int | None = _opt(
        None,
        "While requests decode and the waiting prompts would fill well under one chunk, hold "
        "their admission for up to this many steps (and 50 ms) so that later arrivals share "
        "one prefill step: fewer steps mix prefill with the decodes (such a step cannot replay "
        "a CUDA graph), at that cost in time to first token; 0: admit at once "
        "(default: the hardware platform's)",
    )
    schedule_policy: str = _opt("lpm", "Waiting-queue order: lpm, dfs-weight, fcfs, random")
    schedule_conservativeness: float = _opt(
        1.0,
        "How much KV admission keeps for running requests' future tokens (1.0: an estimate "
        "that adapts to retractions; larger: fewer retractions; 0: none kept)",
    )
    enable_priority_scheduling: bool = _opt(
        False,
        "Admit waiting requests by their 'priority' (larger first), retracting running requests "
        "of a lower priority when a higher one does not fit; a request gains one level per "
        "--priority-aging-steps steps waited, so none waits forever",
    )
    schedule_low_priority_values_first: bool = _opt(
        False, "With --enable-priority-scheduling: smaller 'priority' values run first"
    )
    priority_aging_steps: int = _opt(
        100, "Engine steps a request waits (or runs) per priority level it gains (aging)"
    )
    session_pin_ratio: float = _opt(
        0.5,
        "Most share of the KV pool that open sessions (/open_session) keep pinned; past it "
        "the oldest session's pin is dropped first",
    )
    disable_radix_cache: bool = _opt(False, "Turn the radix prefix cache off")
    enable_hierarchical_cache: bool = _opt(
        False,
        "HiCache (docs/hicache.md): prefixes evicted from the device KV pool move to a host "
        "pool (and from there to --hicache-storage-backend) instead of being dropped, and are "
        "loaded back when a prompt matches them",
    )
    hicache_ratio: float = _opt(2.0, "Host KV pool size as a multiple of the device pool's")
    hicache_size: float | None = _opt(None, "Host KV pool size in GB (overrides --hicache-ratio)")
    hicache_write_policy: str = _opt(
        "write_through",
        "When device KV is copied to the host pool: write_through (as soon as it is cached), "
        "write_through_selective (once a prefix is hit again; cold ones are dropped on "
        "eviction), write_back (only when evicted from the device)",
    )
    hicache_io_backend: str | None = _opt(
        None,
        "How KV moves between device and host: direct (copies on the compute stream) or "
        "kernel (CUDA only: a copy stream beside the compute stream); default: kernel on "
        "CUDA, direct elsewhere",
    )
    hicache_mem_layout: str | None = _opt(
        None,
        "Host pool layout: layer_first (one buffer per layer, as the device pool) or "
        "page_first (a token's KV of every layer together; storage pages copy in one piece); "
        "default: page_first on CUDA, layer_first elsewhere",
    )
    hicache_storage_backend: str | None = _opt(
        None,
        "Third tier behind the host pool: file, mooncake or nixl (alias of --plugin "
        "hicache_storage=NAME; default: none)",
    )
    hicache_storage_backend_extra_config: str | None = _opt(
        None,
        'The storage backend\'s settings as JSON, e.g. {"dir": "/var/cache/radixserve"} for file',
    )
    enable_hicache_prefetch: bool = _opt(
        False,
        "HiCache: a queued request's prefix in storage or host memory moves toward the device "
        "while it waits (a background thread reads storage; docs/hicache.md)",
    )
    hicache_storage_prefetch_policy: str = _opt(
        "best_effort",
        "When a prefetching request may start: best_effort (with what has arrived), "
        "wait_complete, or timeout (prefetch_timeout_* in the backend's extra config)",
    )
    random_seed: int = _opt(0, "Seed of the engine's random generator")
    enable_deterministic_inference: bool = _opt(
        False,
        "The same tokens for a request whatever shares its batch, its prefix cache hits, its "
        "prefill chunks and speculation: batch-invariant linears, RMSNorm and attention (a "
        "fixed KV split), unseeded sampling seeded by --random-seed (docs/deterministic.md)",
    )
    tp_size: int = _opt(
        1,
        "Tensor parallelism: ranks that split every layer (attention heads, MLP, vocabulary), "
        "one engine process and one device each (GPUs 0..N-1, or N CPU processes over gloo); "
        "rank 0 schedules and broadcasts each step",
    )
    pp_size: int = _opt(
        1,
        "Pipeline parallelism: stages that split the decoder's layers into contiguous runs "
        "(embedding on the first, final norm and LM head on the last), one engine process per "
        "stage and tensor-parallel rank (tp_size x pp_size ranks); each step's requests go "
        "through the stages as up to pp_size micro-batches in flight at once",
    )
    nnodes: int = _opt(
        1,
        "Multi-node tensor parallelism: hosts the --tp-size ranks are spread over (tp_size / "
        "nnodes each); start one `radixserve serve` per node with the same flags and its "
        "--node-rank",
    )
    node_rank: int = _opt(
        0, "This launch's node (0: serves HTTP and schedules; others follow, no HTTP server)"
    )
    dist_init_addr: str | None = _opt(
        None,
        "host:port of node 0 where the nodes meet (torch.distributed's TCP store; the node "
        "watch listens on port + 1); needed with --nnodes > 1",
    )
    ep_size: int = _opt(
        1,
        "Expert parallelism for MoE models: the experts are spread over this many ranks "
        "(expert e on rank e // (experts / ep_size)) and tokens reach them through all-to-all; "
        "must equal --tp-size (attention is tensor-parallel over the same ranks)",
    )
    cuda_graph_max_bs: int | None = _opt(
        None,
        "Largest decode batch replayed from a CUDA graph (batches are padded up to a size; "
        "default: the hardware platform's)",
    )
    cuda_graph_max_prefill_tokens: int = _opt(
        512,
        "Largest prefill step (at most 4 requests, no input logprobs) replayed from a CUDA "
        "graph, its new tokens padded to 32, 64, 128, ... up to this: short prompts' eager "
        "prefills are bound by the host's kernel launches; 0: prefill steps run eagerly",
    )
    disable_cuda_graph: bool = _opt(
        False, "Run every step eagerly instead of from CUDA graphs (decode, verify and prefill)"
    )
    enable_torch_compile: bool = _opt(
        False,
        "CPU: run decode steps of up to --torch-compile-max-bs requests through torch.compile "
        "(each size compiles once at start-up, about a minute on 2 cores; later starts reuse "
        "inductor's cache); larger batches and prefill stay eager",
    )
    cpu_threads: int | None = _opt(
        None,
        "torch threads of the engine (CPU default: every core, offline and in a server's engine "
        "process; CUDA default: 1, for the host's Python)",
    )
    torch_compile_max_bs: int = _opt(
        1, "Largest decode batch --enable-torch-compile compiles (sizes 1, 2, 4, 8, ... up to it)"
    )
    disable_custom_all_reduce: bool = _opt(
        False,
        "Tensor parallelism: all-reduce every message through the distributed backend (NCCL) "
        "instead of the hardware platform's own for small ones (on CUDA: one-shot over NVLink "
        "peer-to-peer, through PyTorch symmetric memory)",
    )
    disable_mixed_chunk: bool = _opt(
        False,
        "Run prefill chunks in steps of their own, the decodes waiting a step (SGLang's "
        "default): decode-only steps can replay CUDA graphs; by default a step's decodes and "
        "prefill chunks run together",
    )
    disable_overlap_schedule: bool = _opt(
        False,
        "Finish each step before scheduling the next (by default, where the device runs "
        "asynchronously, the next step is scheduled while the device computes this one)",
    )
    enable_overlap_schedule: bool = _opt(
        False, "Overlap scheduling on synchronous devices too (CPU; for testing)"
    )
    watchdog_timeout: float = _opt(
        300.0, "Seconds one model step may take; a longer stall kills the engine (503 + exit 1)"
    )
    debug_leak_check: bool = _opt(False, "Check the KV leak invariant whenever the engine idles")
    log_level: str = _opt("warning", "Log level: debug, info, warning, error")
    grammar_backend: str | None = _opt(
        None, "Grammar backend for constrained decoding (alias of --plugin grammar=NAME)"
    )
    grammar_compile_timeout: float = _opt(
        30.0,
        "Seconds a request may wait for its grammar to compile; past it the request is refused "
        "(400) and, in the server, a runaway compile is stopped",
    )
    grammar_compile_memory: int = _opt(
        2048,
        "MiB of memory a grammar compile may use (the server compiles each new grammar in a "
        "capped child process first); a grammar that needs more is refused (400)",
    )
    disable_jump_forward: bool = _opt(
        False, "Sample every token of constrained outputs, even where the grammar forces them"
    )
    speculative_algorithm: str | None = _opt(
        None,
        "Speculative decoding: NGRAM, STANDALONE (a draft model), EAGLE, EAGLE3, DFLASH, or any "
        "installed speculative plugin (alias of --plugin speculative=NAME)",
    )
    speculative_num_steps: int | None = _opt(
        None,
        "Draft tokens proposed per request and step (default 4): a chain's length, a tree's depth",
    )
    speculative_num_draft_tokens: int | None = _opt(
        None,
        "Tokens verified per request and step, the last verified token included (SGLang's "
        "meaning: draft tokens + 1); for a chain it overrides --speculative-num-steps, for a "
        "tree it is the tree's size (default: depth x topk + 1)",
    )
    speculative_eagle_topk: int = _opt(
        1,
        "Branching of EAGLE/EAGLE-3 draft trees: 1 drafts chains; above 1, each tree level "
        "expands the topk likeliest nodes into topk children each (needs --page-size 1)",
    )
    speculative_draft_model_path: str | None = _opt(
        None,
        "Draft model for STANDALONE: a directory or .gguf sharing the target's vocabulary; "
        "for EAGLE3, a head directory (config.json + model.safetensors, tools/train_draft.py; "
        "default: the head shipped for SmolLM2-135M-Instruct)",
    )
    speculative_disable_batch_size: int | None = _opt(
        None,
        "Speculation turns itself off while more requests than this decode at once (above 8, "
        "the draft length also shrinks as the batch grows; default: the hardware platform's: "
        "2 on the CPU, 4 on CUDA for models under 2 GiB of weights, 32 where it sets none)",
    )
    speculative_disable_pause: bool = _opt(
        False,
        "Keep drafting for every request; by default a request whose drafts gain fewer tokens "
        "than a verify step costs (measured against plain decode steps) pauses its drafting "
        "for a while",
    )
    speculative_adaptive: bool = _opt(
        False,
        "Choose each request's draft length (0 to --speculative-num-steps, and a tree's width) "
        "every step from its recent acceptance and the measured cost of a draft row at the "
        "current batch size (docs/speculative.md); replaces the pause policy and the fixed "
        "--speculative-disable-batch-size cut-off",
    )
    disable_speculative_loop: bool = _opt(
        False,
        "Run every speculative step from the host; by default, where the device runs "
        "asynchronously and the plugin offers it (eagle, eagle3 chains), up to 4 greedy "
        "requests speculate in cycles kept on the device, the host one cycle behind",
    )
    enable_speculative_loop: bool = _opt(
        False, "The device-side speculative loop on synchronous devices too (CPU; for testing)"
    )
    speculative_ngram_min_match_window_size: int = _opt(
        1, "NGRAM: fewest trailing tokens a match must cover"
    )
    speculative_ngram_max_match_window_size: int = _opt(
        12, "NGRAM: most trailing tokens a match is tried with"
    )
    speculative_simulate_accept_len: float | None = _opt(
        None,
        "Benchmarks only: accept this mean accept length's number of draft tokens (tokens per "
        "verify step, 1 to num_steps + 1; rounded down or up so that each request's running mean "
        "stays on it) instead of verifying; outputs are meaningless. Also read from "
        "RADIXSERVE_SIMULATE_ACC_LEN",
    )

    disaggregation_mode: str = _opt(
        "null",
        "Prefill/decode disaggregation (docs/disaggregation.md): 'null' serves whole requests; "
        "'prefill' computes prompts and the first token and sends their KV to the decode "
        "server; 'decode' receives the KV and generates the rest",
    )
    disaggregation_transfer_backend: str = _opt(
        "mooncake",
        "KV connector moving KV from prefill to decode: mooncake, nixl, tcp (alias of --plugin "
        "kv_transfer=NAME; used only when --disaggregation-mode is prefill or decode)",
    )
    disaggregation_bootstrap_port: int = _opt(
        8998,
        "Prefill: the port of its bootstrap server, where decode servers fetch KV (the port "
        "given to sglang-router's --prefill URL PORT)",
    )
    disaggregation_bootstrap_host: str | None = _opt(
        None,
        "Prefill: the address its bootstrap server listens on (default: the server's --host; "
        "the offline Engine's: every interface)",
    )
    disaggregation_transfer_timeout: float = _opt(
        300.0,
        "Seconds a decode waits for a request's KV, and a prefill keeps KV that no decode has "
        "asked for; past it the request ends with an error and its slots are freed",
    )

    enable_lora: bool = _opt(False, "Serve LoRA adapters (docs/lora.md)")
    lora_paths: tuple[str, ...] = _opt(
        (), "LoRA adapters loaded at start: NAME=PATH or a PEFT directory PATH (named by its "
        "basename); several after one flag", metavar="NAME=PATH", nargs="+",
    )  # fmt: skip
    max_loras_per_batch: int = _opt(8, "Adapter slots on the device (adapters in one step)")
    max_lora_rank: int = _opt(64, "Highest adapter rank (the slots' size)")
    lora_target_modules: tuple[str, ...] = _opt(
        (), "Projections adapters may adapt (default: all of q_proj k_proj v_proj o_proj "
        "gate_proj up_proj down_proj)", metavar="MODULE", nargs="+",
    )  # fmt: skip
    lora_backend: str | None = _opt(
        None, "LoRA kernels: torch (a loop over the step's adapters) or triton (default: "
        "triton on CUDA, torch elsewhere)",
    )  # fmt: skip

    # images in (docs/vision.md): what a request may send, and the encoder outputs kept
    allow_remote_media: bool = _opt(False, "Fetch http(s) image URLs (else data: URLs, paths)")
    remote_media_timeout: float = _opt(10.0, "Seconds a remote image fetch may take")
    max_images_per_request: int = _opt(8, "Images one request may send")
    max_image_bytes: int = _opt(20 << 20, "Bytes of one image (encoded), remote ones included")
    max_image_pixels: int = _opt(4096 * 4096, "Pixels of one image, before resizing")
    mm_encoder_cache_mb: int = _opt(256, "MiB of vision-encoder outputs kept by image hash")

    def __post_init__(self) -> None:
        config_checks.check_disaggregation(self)
        if self.disaggregation_mode != "null":
            backend = self.disaggregation_transfer_backend.lower()
            self._merge_plugin_alias("kv_transfer", "disaggregation_transfer_backend", backend)
        if self.grammar_backend is not None:
            self._merge_grammar_backend(self.grammar_backend)
        if self.speculative_algorithm is not None:
            self._merge_plugin_alias(
                "speculative", "speculative_algorithm", self.speculative_algorithm.lower()
            )
        if self.hicache_storage_backend is not None:
            backend = self.hicache_storage_backend.lower()
            self._merge_plugin_alias("hicache_storage", "hicache_storage_backend", backend)
        config_checks.check_speculative(self)
        config_checks.check_hicache(self)
        config_checks.check_limits(self)
        config_checks.check_choices(self)
        config_checks.check_nodes(self)
        config_checks.check_lora(self)
        config_checks.check_deterministic(self)

    def _merge_grammar_backend(self, name: str) -> None:
        self._merge_plugin_alias("grammar", "grammar_backend", name)

    def _merge_plugin_alias(self, kind: str, flag: str, name: str) -> None:
        chosen = [p.partition("=")[2].strip() for p in self.plugins if p.startswith(f"{kind}=")]
        if any(c != name for c in chosen):
            raise ConfigError(
                f"{flag} '{name}' conflicts with --plugin {kind}={chosen[-1]}; give one"
            )
        if not chosen:
            # NOTE: the config is frozen; resolving the alias into ``plugins`` happens only here.
            object.__setattr__(self, "plugins", (*self.plugins, f"{kind}={name}"))

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per request and step, from the speculative flags: a chain's length k,
        or a tree's nodes (``speculative_eagle_topk`` > 1)."""
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        if self.speculative_eagle_topk > 1:
            return self.draft_depth * self.speculative_eagle_topk
        return self.draft_depth

    @property
    def tree_nodes(self) -> int:
        """A draft tree's nodes (``speculative_eagle_topk`` > 1), 0 where drafts are chains."""
        return self.num_draft_tokens if self.speculative_eagle_topk > 1 else 0

    @property
    def draft_depth(self) -> int:
        """Draft tokens a request may gain per step beyond the target's own: a chain's length,
        a tree's depth."""
        if self.speculative_eagle_topk > 1 or self.speculative_num_draft_tokens is None:
            return self.speculative_num_steps if self.speculative_num_steps is not None else 4
        return self.speculative_num_draft_tokens - 1

    def with_platform_defaults(
        self,
        platform: str,
        chosen: Mapping[str, Any],
        usage: tuple[str, Mapping[str, Any]] | None = None,
    ) -> tuple[EngineConfig, PlatformSettings]:
        """This config with every setting left unset (None) filled: from ``usage`` (a caller's
        defaults, e.g. ("offline Engine", {...})), else ``chosen`` (the hardware platform's
        defaults), else the core's. Returns it with the settings and where each came from."""
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        caller, caller_defaults = usage if usage is not None else ("", {})
        for name, core_default in CORE_DEFAULTS.items():
            given = getattr(self, name)
            if given is not None:
                values[name], origins[name] = given, "flag"
            elif name in caller_defaults:
                values[name], origins[name] = caller_defaults[name], f"{caller} default"
            elif name in chosen:
                values[name], origins[name] = chosen[name], f"{platform} default"
            else:
                values[name], origins[name] = core_default, "default"
        unknown = set(chosen) - set(CORE_DEFAULTS)
        if unknown:
            raise ConfigError(f"platform '{platform}' sets unknown defaults: {sorted(unknown)}")
        return replace(self, **values), PlatformSettings(**values, origins=origins)

    @classmethod
    def field_help(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("help", "") for f in fields(cls)}
