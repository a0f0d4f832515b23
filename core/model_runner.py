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
from radixserve.core.config import ConfigError, EngineConfig, ModelConfig, PlatformSettings
from radixserve.core.grammar import GrammarMasker
from radixserve.core.interfaces import (
    PLUGIN_KINDS,
    AttentionBackend,
    CausalLM,
    HardwarePlatform,
    StepCapabilities,
    StepExecutor,
    StepStrategy,
)
from radixserve.core.logprobs import record_input_logprobs
from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator
from radixserve.core.parallel import Rendezvous, local_model_config, shard_weights
from radixserve.core.parallel import setup as setup_parallel
from radixserve.core.parallel import teardown as teardown_parallel
from radixserve.core.plugins import PluginError, PluginHost, parse_plugin_selections
from radixserve.core.pooling import finish_pooling, plan_pooling, record_label_logprobs
from radixserve.core.sampling import SampleResult, presample_logits, sample, sample_ids
from radixserve.core.step_plan import SampledToken, StepPlan
from radixserve.core.step_rows import LogitsPlan, StepRows
from radixserve.core.tp_step import StepBroadcaster, release_step
from radixserve.core.weights import (
    count_parameters,
    iter_weights,
    reload_in_place,
    weights_reloaded,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A default max_running_requests is lowered to what the KV pool holds at this many tokens each.
_MIN_TOKENS_PER_RUNNING_REQUEST = 128

__all__ = ["LogitsPlan", "ModelRunner", "LaunchedStep"]


@dataclass(frozen=True, slots=True)
class ChosenPlugins:
    names: dict[str, str]

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.names.items())


#: config.json fields that do not shape the built model (a reload may change them): every other
#: field, and "architectures" through ``architecture``, must equal the running model's, since
#: loading weights does not rebuild what the config fixed (RoPE tables, norms, soft-capping,
#: sliding windows, activations, the stop tokens, ...). Keys starting with "_" are free too.
RELOAD_FREE_FIELDS = frozenset({
    "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "bos_token_id", "pad_token_id", "initializer_range", "attention_dropout",
    "output_attentions", "output_hidden_states", "return_dict", "auto_map",
})  # fmt: skip


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
        """``rendezvous``: this process's rank of a tensor-parallel group (config.tp_size > 1);
        rank 0 broadcasts every step, the others run ``core.tp_step.follow_steps``. ``usage``:
        the caller's defaults for settings left unset, before the platform's (for example the
        offline Engine's, ``EngineConfig.with_platform_defaults``)."""
        selections = parse_plugin_selections(config.plugins)
        hw = host.select_hardware(selections.get("hardware"))
        self.platform: HardwarePlatform = hw.factory()
        self.tp = setup_parallel(
            self.platform, config.tp_size, rendezvous, not config.disable_custom_all_reduce
        )
        self.device = self.platform.device
        self.platform.seed_everything(config.random_seed)
        self.model_config = ModelConfig.from_dir(model_dir)
        chosen, model_reg = self._choose_plugins(host, selections, hw.name)
        self.plugins = ChosenPlugins(chosen)
        self.dtype = (
            self.platform.default_dtype() if config.dtype == "auto" else _DTYPES[config.dtype]
        )
        mc = self.model_config
        # Each rank holds its heads' share of the weights and of the KV pool.
        self.local_config = local_model_config(mc, self.tp)
        self.kv_dtype = (
            self.dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
        )
        weight_bytes = count_parameters(model_dir) * self.dtype.itemsize // self.tp.size
        # What the step strategies need is built here, so their device memory (e.g. a second
        # model and its KV) is set aside before the KV pool is sized (core/strategies.py).
        self.reservation = strategies.reserve(host, chosen, config, self.dtype, self.tp.size)
        config, self.settings = config.with_platform_defaults(
            hw.name, self.platform.engine_defaults(mc, weight_bytes), usage
        )
        self.max_context = min(config.context_length or mc.max_context, mc.max_context)
        self.kv_size = self.tp.agree_min(self._kv_pool_size(weight_bytes, config))
        config, self.settings = self._fit_running_to_pool(config)
        self.config = config  # every setting resolved (see self.settings for their origins)
        self.allocator = TokenAllocator(self.kv_size, config.page_size)
        # Scratch rows of the slot table for the strategies: the step's (reserved here) and
        # their own (reserved at their setup).
        self.req_to_token = ReqToTokenPool(
            self.settings.max_running_requests + 1 + self.reservation.table_rows,
            self.max_context + 1,
        )
        self.scratch_rows = self.req_to_token.reserve(self.reservation.node_rows)
        self._build_model(host, model_reg, model_dir)
        self.broadcaster: StepBroadcaster | None = None
        if self.tp.size > 1 and self.tp.leader:
            self.broadcaster = StepBroadcaster(self.tp, self.req_to_token, self.device, self.step)
            self.step = self.broadcaster
        self.capabilities = StepCapabilities.of(self.step)  # checked once, here
        self.grammar_masker: GrammarMasker | None = None  # set by EngineCore
        self.strategies: list[StepStrategy] = []  # set by EngineCore

    def _choose_plugins(
        self, host: PluginHost, selections: dict[str, str], hardware: str
    ) -> tuple[dict[str, str], Any]:
        """The plugin of each kind (the selection, else the platform's default) and the
        model's registration."""
        defaults = self.platform.default_plugins()
        chosen = {"hardware": hardware}
        for kind in PLUGIN_KINDS:
            if kind in ("hardware", "model"):
                continue
            chosen[kind] = host.select(kind, selections.get(kind), defaults.get(kind)).name
        model_reg = self._select_model(host, selections.get("model"))
        chosen["model"] = model_reg.name
        return chosen, model_reg

    def _build_model(self, host: PluginHost, model_reg: Any, model_dir: Path) -> None:
        """The KV pool, the attention backend, the model with its weights, and the step
        executor."""
        mc, local, config = self.model_config, self.local_config, self.config
        chosen = self.plugins.names
        self.kv_pool = KVPool(
            self.kv_size, mc.num_layers, local.num_kv_heads, mc.head_dim, self.kv_dtype,
            self.device, page_size=config.page_size, compute_dtype=self.dtype,
        )  # fmt: skip
        attn_factory = host.registries["attention"].get(chosen["attention"]).factory
        self.attention: AttentionBackend = attn_factory(self.kv_pool, local, self.device)
        if self.kv_dtype != self.dtype and not self.attention.reads_other_kv_dtype:
            model_dtype = str(self.dtype).removeprefix("torch.")
            raise ConfigError(
                f"--kv-cache-dtype {config.kv_cache_dtype}: the {chosen['attention']} attention "
                f"backend reads KV only in the model's dtype ({model_dtype}); choose "
                "--kv-cache-dtype auto, or the torch_native or cpu_paged backend"
            )
        self.model: CausalLM = model_reg.factory(mc, self.attention, self.dtype, self.device)
        self.model.load_weights(self._weights(model_dir))
        if config.quantization is not None:
            self.platform.quantize_model(self.model, config.quantization)
        self.platform.prepare_model(self.model, config)
        # The platform decides how a step runs (eagerly here; e.g. CUDA graphs for decodes).
        self.step = self.platform.step_executor(
            self.model, self.attention, self.kv_pool, self.req_to_token, config
        )

    def _weights(self, model_dir: Path) -> Any:
        """The checkpoint's tensors, cut to this rank's shard by the model's ``tp_plan``."""
        weights = iter_weights(model_dir, self.dtype)
        if self.tp.size == 1:
            return weights
        plan = getattr(self.model, "tp_plan", None)
        if plan is None:
            raise ConfigError(
                f"model plugin '{self.plugins.names['model']}' declares no tp_plan, so it cannot "
                f"run with tp_size={self.tp.size} (docs/plugins.md: tensor parallelism)"
            )
        return shard_weights(weights, plan, self.model_config, self.tp)

    def close(self) -> None:
        """Tensor parallelism: stop the other ranks' step loops and leave the group, so a new
        engine can start in this process. A no-op with one rank; calling it again does
        nothing."""
        if self.tp.size == 1:
            return
        try:
            if self.broadcaster is not None:
                self.broadcaster.stop()
        except RuntimeError as e:  # a rank already gone: nothing is left to stop there
            logger.warning("could not stop the other tensor-parallel ranks: %s", e)
        finally:
            release_step(self.step)  # captured collectives go before the group does
            teardown_parallel()

    def reload_weights(self, model_dir: Path) -> None:
        """Load the weights of ``model_dir`` into the running model in place. Raise
        ConfigError (or the model's ValueError) naming the problem, with the old weights still
        loaded, when the checkpoint is not one of this model's shape."""
        if self.tp.size > 1:
            raise ConfigError(
                f"loading new weights is not supported with tp_size={self.tp.size} yet"
            )
        if self.config.quantization is not None:
            raise ConfigError(
                f"loading new weights into a model quantized at load "
                f"(quantization={self.config.quantization}) is not supported; restart instead"
            )
        new = ModelConfig.from_dir(model_dir)
        old = self.model_config
        for name in ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size"):  # fmt: skip
            if getattr(new, name) != getattr(old, name):
                raise ConfigError(
                    f"'{model_dir}' has {name}={getattr(new, name)!r}; the running model has "
                    f"{getattr(old, name)!r} (only weights of the same shape can be loaded)"
                )
        # Every other field may have shaped the model when it was built (RoPE tables, norms,
        # whether the LM head is the embedding, ...): loading weights does not rebuild it
        fixed = sorted(
            name
            for name in new.raw.keys() | old.raw.keys()
            if name not in RELOAD_FREE_FIELDS and not name.startswith("_")
        )
        for name in fixed:
            if new.raw.get(name) != old.raw.get(name):
                raise ConfigError(
                    f"'{model_dir}' has {name}={new.raw.get(name)!r}; the running model was "
                    f"built with {old.raw.get(name)!r} (restart the server to load this model)"
                )
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
                s.add_rows(rows, i, req, n, extra) for s in self.strategies
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
        chosen = next(
            (
                x
                for s in self.strategies
                if (x := s.sample_rows(logits, batch, plans, sample_rows, eos_ids)) is not None
            ),
            None,
        )
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
        for strategy in self.strategies:
            strategy.before_forward(fb)
        self.req_to_token.sync()  # the device mirror of the slot table, before any kernel
        logits = self.step(fb)
        for strategy in self.strategies:
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
