"""ModelRunner: resolves the plugins, owns the model, the KV pool and the attention backend,
builds each step's ForwardBatch and samples.

Per step it does one ForwardBatch build, one model call and one host sync (the sampled ids).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from radixserve.core import spec_tree
from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.checkpoint import check_checkpoint
from radixserve.core.config import ConfigError, EngineConfig, ModelConfig, PlatformSettings
from radixserve.core.distributed import Ranks, Rendezvous, join
from radixserve.core.grammar import GrammarMasker
from radixserve.core.interfaces import (
    PLUGIN_KINDS,
    AttentionBackend,
    CausalLM,
    Draft,
    HardwarePlatform,
)
from radixserve.core.logprobs import record_input_logprobs, scored_positions
from radixserve.core.memory import KVPool, ReqToTokenPool, TokenAllocator
from radixserve.core.plugins import PluginError, PluginHost, parse_plugin_selections
from radixserve.core.pooling import finish_pooling, plan_pooling, record_label_logprobs
from radixserve.core.request import Req, token_slice
from radixserve.core.sampling import SampleResult, presample_logits, sample, sample_ids
from radixserve.core.scheduler import SampledToken, ScheduledBatch
from radixserve.core.spec_tree import ancestors
from radixserve.core.spec_verify import verify_drafts
from radixserve.core.speculative import Speculator
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


_NOTHING_SCORED = range(0)


class LogitsPlan(NamedTuple):
    scored: range  # positions scored for input logprobs
    first_row: int  # logits row of scored[0]
    sample_row: int  # logits row of the entry's last new token


@dataclass(frozen=True, slots=True)
class ChosenPlugins:
    names: dict[str, str]

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.names.items())


class ModelRunner:
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
        self.speculator: Speculator | None = None  # set by EngineCore when speculating
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
        model_reg = self._choose_plugins(host, hardware, selections)
        self.dtype = (
            self.platform.default_dtype() if config.dtype == "auto" else _DTYPES[config.dtype]
        )
        self.kv_dtype = (
            self.dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
        )
        # Each rank holds its heads' share of the weights and of the KV pool.
        self.local_config = self.ranks.local_config(mc)
        weight_bytes = self.ranks.share(count_parameters(model_dir) * self.dtype.itemsize)
        self.ranks.check_plugins(self.plugins.names, config)
        self._reserve_speculative(config, host)
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

    def _reserve_speculative(self, config: EngineConfig, host: PluginHost) -> None:
        """Build the speculative algorithm now, so its device memory (a draft model and its
        KV) is set aside before the KV pool is sized; EngineCore sets it up later."""
        spec_factory = host.registries["speculative"].get(self.plugins.names["speculative"]).factory
        self.speculative_algorithm = spec_factory()
        self._spec_weight_bytes, self._spec_kv_bytes = self.speculative_algorithm.memory_needs(
            config, host, self.dtype
        )

    def _build_memory(self, config: EngineConfig) -> None:
        """The KV slot allocator, the req->token table and the KV pool (this rank's heads)."""
        self.allocator = TokenAllocator(self.kv_size, config.page_size)
        # Scratch rows for draft trees: their nodes' rows in verify steps (reserved here) and
        # the drafter's (reserved at its setup).
        trees = spec_tree.TREE_BATCH
        node_rows = trees * config.tree_nodes
        scratch = node_rows + trees * config.speculative_eagle_topk if node_rows else 0
        self.req_to_token = ReqToTokenPool(
            self.settings.max_running_requests + 1 + scratch, self.max_context + 1
        )
        self._tree_rows = self.req_to_token.reserve(node_rows)
        mc, local = self.model_config, self.local_config
        self.kv_pool = KVPool(
            self.kv_size, mc.num_layers, local.num_kv_heads, mc.head_dim, self.kv_dtype,
            self.device, page_size=config.page_size, compute_dtype=self.dtype,
        )  # fmt: skip

    def _build_attention(self, host: PluginHost, config: EngineConfig) -> None:
        name = self.plugins.names["attention"]
        attn_factory = host.registries["attention"].get(name).factory
        self.attention: AttentionBackend = attn_factory(
            self.kv_pool, self.local_config, self.device
        )
        if self.kv_dtype != self.dtype and not self.attention.reads_other_kv_dtype:
            model_dtype = str(self.dtype).removeprefix("torch.")
            raise ConfigError(
                f"--kv-cache-dtype {config.kv_cache_dtype}: the {name} attention "
                f"backend reads KV only in the model's dtype ({model_dtype}); choose "
                "--kv-cache-dtype auto, or the torch_native or cpu_paged backend"
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
        self.platform.prepare_model(self.model, config)
        # The platform decides how a step runs (eagerly here; e.g. CUDA graphs for decodes).
        self.step = self.platform.step_executor(
            self.model, self.attention, self.kv_pool, self.req_to_token, config
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
        per_token += self._spec_kv_bytes
        if config.max_total_tokens is not None:
            return config.max_total_tokens
        fraction = self.settings.mem_fraction_static
        weight_bytes += self._spec_weight_bytes
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
        self, batch: ScheduledBatch, prev_ids: torch.Tensor | None = None
    ) -> tuple[ForwardBatch, list[LogitsPlan]]:
        """The step's ForwardBatch and, per entry, which logits rows belong to it. A request
        whose last token is still pending reads it from ``prev_ids`` (on the device)."""
        future_dst: list[int] = []
        future_src: list[int] = []
        pending_dst: list[int] = []  # input rows of draft tokens still on the device
        pending: list[torch.Tensor] = []
        rows: list[int] = []
        logits_rows: list[int] = []
        plans: list[LogitsPlan] = []
        positions: list[int] = []
        input_ids: list[int] = []
        pool_rows: list[int] = []
        seq_lens: list[int] = []
        tree_rows = iter(self._tree_rows)
        tree_entries: dict[int, int] = {}  # batch index of a tree verify -> its decode rows
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            assert req.req_pool_idx is not None
            start = req.kv_len
            if n == 1 and req.logprob_start_len < 0:  # a plain decode: the hot path
                prompt_len = len(req.input_ids)
                if req.num_pending:
                    future_dst.append(len(positions))
                    future_src.append(req.pending_row)
                    input_ids.append(0)
                elif start >= prompt_len:
                    input_ids.append(req.output_ids[start - prompt_len])
                else:
                    input_ids.append(req.input_ids[start])
                positions.append(start)
                rows.append(req.req_pool_idx)
                pool_rows.append(req.req_pool_idx)
                seq_lens.append(start + 1)
                logits_rows.append(len(positions) - 1)
                plans.append(
                    LogitsPlan(_NOTHING_SCORED, len(logits_rows) - 1, len(logits_rows) - 1)
                )
                continue
            assert not req.num_pending, "only plain decodes have pending tokens"
            draft = batch.drafts.get(i)
            if draft is not None and draft.parents is not None:
                # a tree: the root and every node as a decode row (core/spec_tree.py)
                first = len(logits_rows)
                tokens = token_slice(req.input_ids, req.output_ids, start, 1) + draft.tokens
                node_rows = self._tree_node_rows(req, draft, tree_rows)
                for (r, p), token in zip(node_rows, tokens, strict=True):
                    input_ids.append(token)
                    positions.append(p)
                    rows.append(r)
                    pool_rows.append(r)
                    seq_lens.append(p + 1)
                    logits_rows.append(len(positions) - 1)
                tree_entries[i] = len(node_rows)
                plans.append(LogitsPlan(_NOTHING_SCORED, first, len(logits_rows) - 1))
                continue
            if draft is not None:  # verify: the last token, then the draft
                input_ids += token_slice(req.input_ids, req.output_ids, start, 1) + draft.tokens
                if draft.pending is not None:
                    pending_dst += range(len(positions) + 1, len(positions) + n)
                    pending.append(draft.pending)
            else:
                input_ids += token_slice(req.input_ids, req.output_ids, start, n)
            positions += range(start, start + n)
            rows += [req.req_pool_idx] * n
            pool_rows.append(req.req_pool_idx)
            seq_lens.append(start + n)
            offset = len(positions) - n - start  # flattened row of sequence position 0
            first = len(logits_rows)
            if draft is not None:  # every new token's logits: row j verifies draft token j
                logits_rows += range(offset + start, offset + start + n)
                plans.append(LogitsPlan(_NOTHING_SCORED, first, len(logits_rows) - 1))
                continue
            scored = scored_positions(req, start, n)
            logits_rows += [offset + p for p in scored]
            logits_rows.append(offset + start + n - 1)
            plans.append(LogitsPlan(scored, first, len(logits_rows) - 1))
        t, n_logits = len(positions), len(logits_rows)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        out_cache_loc = self.req_to_token.table[torch.tensor(rows), positions_t]
        # One host->device copy for every per-token index of the step.
        packed = torch.cat(
            [
                torch.tensor(input_ids, dtype=torch.int64),
                positions_t,
                out_cache_loc,
                torch.tensor(logits_rows + future_dst + future_src, dtype=torch.int64),
                torch.tensor(pending_dst, dtype=torch.int64),
            ]
        )
        extend_lens, num_decode = list(batch.extend_lens), batch.num_decode
        if tree_entries:  # each tree verify entry is that many decode rows, after the decodes
            extend_lens = []
            for i, n in enumerate(batch.extend_lens):
                extend_lens += [1] * tree_entries[i] if i in tree_entries else [n]
            num_decode += sum(tree_entries.values())
        dev = to_device(packed, self.device)
        input_ids_t = dev[:t]
        n_future = len(future_dst)
        if future_dst:
            assert prev_ids is not None, "a pending token needs the previous step's ids"
            at = 3 * t + n_logits
            dst, src = dev[at : at + 2 * n_future].view(2, -1)
            input_ids_t[dst] = prev_ids[src]
        if pending:  # draft tokens go device to device: no host sync before the verify
            at = 3 * t + n_logits + 2 * n_future
            input_ids_t[dev[at:]] = torch.cat(pending) if len(pending) > 1 else pending[0]
        fb = ForwardBatch(
            input_ids=input_ids_t,
            positions=dev[t : 2 * t],
            out_cache_loc=dev[2 * t : 3 * t],
            req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64),
            req_to_token=self.req_to_token.table,
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            num_decode=num_decode,
            logits_indices=dev[3 * t : 3 * t + n_logits],
            kv_pool=self.kv_pool,
            req_to_token_pool=self.req_to_token,
        )
        return fb, plans

    def _tree_node_rows(
        self, req: Req, draft: Draft, scratch: Iterator[int]
    ) -> list[tuple[int, int]]:
        """(slot-table row, position) of a tree verify's decode rows: the root on the
        request's own row, then each node on a scratch row holding the request's prefix, the
        node's ancestors and the node (whose slot is that of position kv_len + 1 + j)."""
        assert draft.parents is not None and req.req_pool_idx is not None
        own, start = req.req_pool_idx, req.kv_len
        table = self.req_to_token.table
        prefix = table[own, : start + 1]
        node_slots = table[own, start + 1 : start + 1 + len(draft.tokens)]
        out = [(own, start)]
        for j in range(len(draft.tokens)):
            path = ancestors(draft.parents, j)
            row = next(scratch)
            self.req_to_token.write(row, 0, torch.cat([prefix, node_slots[path]]))
            out.append((row, start + len(path)))
        return out

    def keep_hidden_layers(
        self, layers: tuple[int, ...], consumer: Callable[[ForwardBatch], None] | None = None
    ) -> None:
        """The speculative plugin reads these target layers' outputs after every forward: an
        executor that can keep them on its fast path (CUDA graphs: ``keep_hidden_layers``) is
        told so; any other runs such forwards as it always does. ``consumer``: the plugin's
        ``target_hidden`` where it may run inside a graph (``target_hidden_capturable``)."""
        keep = getattr(self.step, "keep_hidden_layers", None)
        if keep is not None:
            keep(tuple(layers), consumer)

    def launch(
        self,
        batch: ScheduledBatch,
        sample_rows: list[int],
        eos_ids: tuple[int, ...],
        prev_ids: torch.Tensor | None = None,
    ) -> LaunchedStep:
        """Queue ``batch``'s forward and the sampling of ``sample_rows`` on the device.

        ``prev_ids`` are the previous step's sampled ids on the device: requests with a pending
        token take their input from there. When every sampled request is ``overlappable`` no
        host sync happens here; ``result()`` waits for the ids."""
        fb, plans = self.build_batch(batch, prev_ids)
        pooling = plan_pooling(batch.reqs, batch.extend_lens)
        if pooling is not None:
            fb.hidden_rows = to_device(torch.tensor(pooling.rows, dtype=torch.int64), self.device)
        algorithm = self.speculator.algorithm if self.speculator is not None else None
        if algorithm is not None and algorithm.capture_hidden_layers:
            fb.capture_hidden_layers = algorithm.capture_hidden_layers
        self.req_to_token.sync()  # the device mirror of the slot table, before any kernel
        logits = self.step(fb)
        if fb.capture_hidden_layers and not fb.hidden_consumed:
            assert algorithm is not None
            if fb.hidden_states is None:
                raise RuntimeError(
                    f"model plugin '{self.plugins.names['model']}' keeps no hidden states "
                    "(ForwardBatch.capture_hidden_layers), which the speculative plugin "
                    f"'{self.plugins.names['speculative']}' needs"
                )
            algorithm.target_hidden(fb)
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
        if not sample_rows:
            return LaunchedStep(None, True, dict)
        if batch.drafts:
            verified = self._verify_now(logits, batch, plans, sample_rows, eos_ids)
            return LaunchedStep(None, False, lambda: verified)
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

    def run(
        self, batch: ScheduledBatch, sample_rows: list[int], eos_ids: tuple[int, ...]
    ) -> dict[int, SampledToken]:
        """Forward ``batch``; sample the rows in ``sample_rows``.
        Returns {batch index: (token id, its logprob or None, top logprobs or None)}."""
        return self.launch(batch, sample_rows, eos_ids).result()

    def _verify_now(
        self,
        logits: torch.Tensor,
        batch: ScheduledBatch,
        plans: list[LogitsPlan],
        sample_rows: list[int],
        eos_ids: tuple[int, ...],
    ) -> dict[int, Any]:
        """Sample a step with verify entries: each sampled entry's rows (one for a plain
        entry, 1 + len(draft) for a verify entry) go through ``speculative.verify``; a verify
        entry gets the list of tokens it emits, a plain entry its one token."""
        assert self.speculator is not None
        reqs: list[Any] = []
        drafts: list[Draft | None] = []
        rows: list[int] = []
        for i in sample_rows:
            draft = batch.drafts.get(i)
            last = plans[i].sample_row
            rows += range(last - (len(draft.tokens) if draft is not None else 0), last + 1)
            reqs.append(batch.reqs[i])
            drafts.append(draft)
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits[rows]  # (every row, in order, is the common case: no copy)
        emitted = verify_drafts(logits, reqs, drafts, eos_ids, self.grammar_masker, self.speculator)
        return {
            i: tokens if i in batch.drafts else tokens[0]
            for i, tokens in zip(sample_rows, emitted, strict=True)
        }

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
