"""ModelRunner: resolves the plugins, owns the model, the KV pool and the attention backend,
builds each step's ForwardBatch and samples.

Per step it does one ForwardBatch build, one model call and one host sync (the sampled ids).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from radixserve.core import strategies
from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.checkpoint import check_checkpoint
from radixserve.core.config import ConfigError, EngineConfig, ModelConfig, PlatformSettings
from radixserve.core.deterministic import make_batch_invariant
from radixserve.core.distributed import Ranks, Rendezvous, join
from radixserve.core.grammar import GrammarMasker
from radixserve.core.interfaces import (
    PLUGIN_KINDS,
    AttentionBackend,
    CausalLM,
    HardwarePlatform,
    StepCapabilities,
    StepExecutor,
)
from radixserve.core.interfaces_capabilities import WaitsForKVLayers
from radixserve.core.logprobs import record_input_logprobs
from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator
from radixserve.core.plugins import PluginError, PluginHost, parse_plugin_selections
from radixserve.core.pooling import finish_pooling, plan_pooling, record_label_logprobs
from radixserve.core.sampling import SampleResult, presample_logits, sample, sample_ids
from radixserve.core.step_plan import SampledToken, StepPlan
from radixserve.core.step_rows import LogitsPlan, StepRows
from radixserve.core.strategy_list import StrategyList
from radixserve.core.weights import (
    count_parameters,
    iter_weights,
    reload_in_place,
    weights_reloaded,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn}
# A default max_running_requests is lowered to what the KV pool holds at this many tokens each.
_MIN_TOKENS_PER_RUNNING_REQUEST = 128

__all__ = ["LogitsPlan", "ModelRunner", "LaunchedStep"]


@dataclass(frozen=True, slots=True)
class ChosenPlugins:
    names: dict[str, str]

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.names.items())


class ModelRunner:
    step: StepExecutor  # how each step runs the model (the platform's; see _build_model)

    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        host: PluginHost,
        rendezvous: Rendezvous | None = None,
        usage: tuple[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``rendezvous``: where this process meets the engine's other ranks, when it has
        several (``core/distributed.py``; rank 0 leads every step, the others follow). ``usage``:
        the caller's defaults for settings left unset, before the platform's (for example the
        offline Engine's, ``EngineConfig.with_platform_defaults``)."""
        self.grammar_masker: GrammarMasker | None = None  # set by EngineCore
        self.strategies = StrategyList()  # set by EngineCore (shared with the scheduler)
        selections = parse_plugin_selections(config.plugins)
        hw = host.select_hardware(selections.get("hardware"))
        self.platform: HardwarePlatform = hw.factory()
        self.ranks: Ranks = join(self.platform, config, rendezvous)
        try:
            self._start(model_dir, config, host, hw.name, selections, usage)
        except BaseException:
            self.ranks.close()  # a failed start leaves no group behind in this process
            raise

    def _start(
        self,
        model_dir: Path,
        config: EngineConfig,
        host: PluginHost,
        hardware: str,
        selections: Mapping[str, str],
        usage: tuple[str, Mapping[str, Any]] | None,
    ) -> None:
        self.device = self.platform.device
        self.platform.seed_everything(config.random_seed)
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        config = self.platform.resolve_config(config, str(model_dir))
        model_reg = self._choose_plugins(host, hardware, selections)
        self.dtype = (
            self.platform.default_dtype() if config.dtype == "auto" else _DTYPES[config.dtype]
        )
        self.kv_dtype = (
            self.dtype if config.kv_cache_dtype == "auto" else _KV_DTYPES[config.kv_cache_dtype]
        )
        # Each rank holds its heads' share of the weights and of the KV pool.
        self.local_config = self.ranks.local_config(mc)
        weight_bytes = self.ranks.share(count_parameters(model_dir) * self.dtype.itemsize)
        # What the step strategies need is built here, so their device memory (e.g. a second
        # model and its KV) is set aside before the KV pool is sized; they refuse settings
        # they cannot run with, several ranks among them (core/strategies.py).
        self.reservation = strategies.reserve(
            host, dict(self.plugins.names), config, self.dtype, self.ranks.size, mc
        )
        config, self.settings = config.with_platform_defaults(
            hardware, self.platform.engine_defaults(mc, weight_bytes), usage
        )
        self.max_context = min(config.context_length or mc.max_context, mc.max_context)
        self.kv_size = self.ranks.agree_min(self._kv_pool_size(weight_bytes, config))
        config, self.settings = self._fit_running_to_pool(config)
        self.config = config  # every setting resolved (see self.settings for their origins)
        self._build_memory(config)
        self._build_attention(host, config)
        self._build_model(model_dir, model_reg, config)
        self.capabilities = StepCapabilities.of(self.step)  # checked once, here

    def _choose_plugins(
        self, host: PluginHost, hardware: str, selections: Mapping[str, str]
    ) -> Any:
        """Resolve every plugin kind (the platform's defaults where none is selected); the
        model's registration."""
        defaults = self.platform.default_plugins()
        chosen = {"hardware": hardware}
        for kind in PLUGIN_KINDS:
            if kind in ("hardware", "model"):
                continue
            chosen[kind] = host.select(kind, selections.get(kind), defaults.get(kind)).name
        model_reg = self._select_model(host, selections.get("model"))
        chosen["model"] = model_reg.name
        self.plugins = ChosenPlugins(chosen)
        return model_reg

    def _build_memory(self, config: EngineConfig) -> None:
        """The KV slot allocator, the req->token table and the KV pool (this rank's heads)."""
        self.allocator = TokenAllocator(self.kv_size, config.page_size)
        # Scratch rows of the slot table for the strategies: the step's (reserved here) and
        # their own (reserved at their setup).
        self.req_to_token = ReqToTokenPool(
            self.settings.max_running_requests + 1 + self.reservation.table_rows,
            self.max_context + 1,
        )
        self.scratch_rows = self.req_to_token.reserve(self.reservation.node_rows)
        mc, local = self.model_config, self.local_config
        self.kv_pool = KVPool(
            self.kv_size, local.num_layers, local.num_kv_heads, mc.head_dim, self.kv_dtype,
            self.device, page_size=config.page_size, compute_dtype=self.dtype,
        )  # fmt: skip

    def _build_attention(self, host: PluginHost, config: EngineConfig) -> None:
        name = self.plugins.names["attention"]
        attn_factory = host.registries["attention"].get(name).factory
        self.attention: AttentionBackend = attn_factory(
            self.kv_pool, self.local_config, self.device
        )
        make_batch_invariant(self.attention, f"the {name} attention backend", config)
        if self.kv_dtype != self.dtype and not self.attention.reads_other_kv_dtype:
            model_dtype = str(self.dtype).removeprefix("torch.")
            raise ConfigError(
                f"--kv-cache-dtype {config.kv_cache_dtype}: the {name} attention "
                f"backend reads KV only in the model's dtype ({model_dtype}); choose "
                "--kv-cache-dtype auto, or the torch_native or cpu_paged backend (fp8_e4m3: "
                "the triton or torch_native backend)"
            )

    def _build_model(self, model_dir: Path, model_reg: Any, config: EngineConfig) -> None:
        """The model with its weights, prepared by the platform, and the step executor."""
        mc = self.model_config
        self.model: CausalLM = self.ranks.build_model(
            model_reg.name, model_reg.factory, mc, self.attention, self.dtype, self.device
        )
        weights = iter_weights(model_dir, self.dtype)
        self.model.load_weights(self.ranks.shard(weights, self.model, model_reg.name, mc))
        if config.quantization is not None:
            self.platform.quantize_model(self.model, config.quantization)
        # e.g. LoRA's wrapped projections, before the platform captures any graph
        self.lora_weights = strategies.prepare_model(self.model, config, self.device)
        self.platform.prepare_model(self.model, config)
        make_batch_invariant(self.model, f"model plugin '{model_reg.name}'", config)
        self.waits_for_kv_layers = (
            isinstance(self.model, WaitsForKVLayers) and self.model.waits_for_kv_layers
        )
        # The platform decides how a step runs (eagerly here; e.g. CUDA graphs for decodes).
        self.step = self.ranks.step_executor(
            self.platform, self.model, self.attention, self.kv_pool, self.req_to_token, config
        )
        self.step = self.ranks.lead(self.step, self.req_to_token, self.device)

    def close(self) -> None:
        """Several ranks: stop the other ranks' step loops and leave their group, so a new
        engine can start in this process. A no-op with one rank; calling it again does
        nothing."""
        self.ranks.close(self.step)

    def reload_weights(self, model_dir: Path) -> None:
        """Load the weights of ``model_dir`` into the running model in place. Raise
        ConfigError (or the model's ValueError) naming the problem, with the old weights still
        loaded, when the checkpoint is not one of this model's shape."""
        self.ranks.check_reload()
        if self.config.quantization is not None:
            raise ConfigError(
                f"loading new weights into a model quantized at load "
                f"(quantization={self.config.quantization}) is not supported; restart instead"
            )
        check_checkpoint(model_dir, self.model_config)
        weights = iter_weights(model_dir, self.dtype)
        reload_in_place(self.model, lambda: self.model.load_weights(weights))  # type: ignore[arg-type]
        weights_reloaded(self.model)  # type: ignore[arg-type]

    def _select_model(self, host: PluginHost, requested: str | None) -> Any:
        arch = self.model_config.architecture
        try:
            return host.select("model", requested, arch)
        except PluginError as e:
            if requested:
                raise
            raise PluginError(
                f"no model plugin for architecture '{arch}'; "
                f"available: {', '.join(host.registries['model'].available_names())}"
            ) from e

    def _kv_pool_size(self, weight_bytes: int, config: EngineConfig) -> int:
        mc = self.local_config  # this rank's KV heads
        per_token = KVPool.bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, self.kv_dtype
        )
        per_token += self.reservation.kv_bytes_per_slot
        if config.max_total_tokens is not None:
            return config.max_total_tokens
        fraction = self.settings.mem_fraction_static
        weight_bytes += self.reservation.weight_bytes
        size = self.platform.kv_cache_bytes(weight_bytes, fraction) // per_token
        if self.platform.max_kv_tokens is not None:
            size = min(size, self.platform.max_kv_tokens)
        if size < 16:
            raise ConfigError(
                f"no memory left for the KV pool with mem_fraction_static={fraction} "
                f"({self.settings.origins['mem_fraction_static']}); raise it or set "
                "max_total_tokens"
            )
        return int(size)

    def _fit_running_to_pool(self, config: EngineConfig) -> tuple[EngineConfig, PlatformSettings]:
        """A default max_running_requests that the KV pool cannot hold at a modest request
        size is lowered, with the reason logged and shown where the settings are."""
        s = self.settings
        fit = max(1, self.kv_size // _MIN_TOKENS_PER_RUNNING_REQUEST)
        user_set = (
            s.origins["max_running_requests"] == "flag" or config.max_total_tokens is not None
        )
        if user_set or fit >= s.max_running_requests:
            return config, s
        why = (
            f"lowered from {s.max_running_requests}: the KV pool holds {self.kv_size} tokens, "
            f"{_MIN_TOKENS_PER_RUNNING_REQUEST} per running request"
        )
        logger.warning("max_running_requests %d: %s", fit, why)
        origins = {**s.origins, "max_running_requests": why}
        return replace(config, max_running_requests=fit), replace(
            s, max_running_requests=fit, origins=origins
        )

    def build_batch(
        self, batch: StepPlan, prev_ids: torch.Tensor | None = None
    ) -> tuple[ForwardBatch, list[LogitsPlan]]:
        """The step's ForwardBatch and, per entry, which logits rows belong to it. A request
        whose last token is still pending reads it from ``prev_ids`` (on the device)."""
        rows = StepRows()
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            assert req.req_pool_idx is not None
            if n == 1 and req.logprob_start_len < 0:  # a plain decode: the hot path
                rows.add_decode(req)
                continue
            assert not req.num_pending, "only plain decodes have pending tokens"
            extra = batch.extra.get(i)
            if extra is not None and any(
                s.add_rows(rows, i, req, n, extra) for s in self.strategies.on.add_rows
            ):
                continue
            rows.add_extend(req, n)
        fb = rows.forward_batch(
            list(batch.extend_lens), batch.num_decode, self.req_to_token, self.kv_pool,
            self.device, prev_ids,
        )  # fmt: skip
        return fb, rows.plans

    def launch(
        self,
        batch: StepPlan,
        sample_rows: list[int],
        eos_ids: tuple[int, ...],
        prev_ids: torch.Tensor | None = None,
    ) -> LaunchedStep:
        """Queue ``batch``'s forward and the sampling of ``sample_rows`` on the device.

        ``prev_ids`` are the previous step's sampled ids on the device: requests with a pending
        token take their input from there. When every sampled request is ``overlappable`` no
        host sync happens here; ``result()`` waits for the ids."""
        logits, plans = self._forward(batch, prev_ids)
        if not sample_rows:
            return LaunchedStep(None, True, dict)
        chosen = None  # the first strategy that samples this step itself
        for s in self.strategies.on.sample_rows:
            chosen = s.sample_rows(logits, batch, plans, sample_rows, eos_ids)
            if chosen is not None:
                break
        if chosen is not None:
            return LaunchedStep(None, False, lambda: chosen)
        reqs = [batch.reqs[i] for i in sample_rows]
        last_rows = [plans[i].sample_row for i in sample_rows]
        if all(r.overlappable for r in reqs):
            # The model returns only the rows asked for; when all are sampled, read them as is.
            rows = logits if len(last_rows) == logits.shape[0] else logits[last_rows]
            ids = sample_ids(presample_logits(rows, reqs, eos_ids), reqs)
            fetch = self.platform.copy_to_host_async(ids)

            def wait() -> dict[int, SampledToken]:
                return {i: (t, None, None) for i, t in zip(sample_rows, fetch(), strict=True)}

            return LaunchedStep(ids, True, wait)
        sampled = self._sample_now(logits[last_rows], reqs, sample_rows, eos_ids)
        return LaunchedStep(None, False, lambda: sampled)

    def _forward(
        self, batch: StepPlan, prev_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[LogitsPlan]]:
        """Run the model over ``batch``; record input logprobs and pooled embeddings. Returns
        the logits and each entry's logits rows."""
        fb, plans = self.build_batch(batch, prev_ids)
        pooling = plan_pooling(batch.reqs, batch.extend_lens)
        if pooling is not None:
            fb.hidden_rows = to_device(torch.tensor(pooling.rows, dtype=torch.int64), self.device)
        for strategy in self.strategies.on.before_forward:
            strategy.before_forward(fb)
        self.req_to_token.sync()  # the device mirror of the slot table, before any kernel
        self.kv_pool.prepare_loads(per_layer=self.waits_for_kv_layers)
        logits = self.step(fb)
        self.kv_pool.wait_loads()
        for strategy in self.strategies.on.after_forward:
            strategy.after_forward(fb)
        for req, n, plan in zip(batch.reqs, batch.extend_lens, plans, strict=True):
            if plan.scored:
                rows = logits[plan.first_row : plan.first_row + len(plan.scored)]
                record_input_logprobs(req, plan.scored, rows)
            if req.label_token_ids is not None and req.kv_len + n == req.seq_len:
                record_label_logprobs(req, logits[plan.sample_row])
        if pooling is not None:
            if fb.final_hidden is None:
                raise RuntimeError(
                    f"model plugin '{self.plugins.names['model']}' keeps no final hidden "
                    "states (ForwardBatch.hidden_rows), so it cannot serve embeddings"
                )
            finish_pooling(pooling, fb.final_hidden)
        return logits, plans

    def run(
        self, batch: StepPlan, sample_rows: list[int], eos_ids: tuple[int, ...]
    ) -> dict[int, SampledToken]:
        """Forward ``batch``; sample the rows in ``sample_rows``.
        Returns {batch index: (token id, its logprob or None, top logprobs or None)}."""
        return self.launch(batch, sample_rows, eos_ids).result()

    def _sample_now(
        self,
        rows: torch.Tensor,
        reqs: list[Any],
        sample_rows: list[int],
        eos_ids: tuple[int, ...],
    ) -> dict[int, SampledToken]:
        raw = None
        if self.grammar_masker is not None and any(r.grammar is not None for r in reqs):
            if any(r.sampling.logprobs for r in reqs):
                raw = rows.clone()  # logprobs report the model's belief, not the mask
            self.grammar_masker.apply(rows, reqs)
        result: SampleResult = sample(rows, reqs, eos_ids, raw)
        out = {}
        for j, i in enumerate(sample_rows):
            lp = result.logprobs[j] if result.logprobs is not None else None
            top = result.top_logprobs[j] if result.top_logprobs is not None else None
            out[i] = (result.next_ids[j], lp, top)
        return out


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device. ``result()`` waits for its sampled tokens:
    {batch index: (token id, logprob or None, top logprobs or None)}."""

    next_ids: torch.Tensor | None  # sampled ids on the device, in sample-row order
    overlappable: bool  # the next step may be scheduled before result()
    result: Callable[[], dict[int, SampledToken]]
