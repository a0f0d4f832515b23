"""Speculative algorithm ``standalone``: a separate, smaller draft model proposes k tokens by
decoding autoregressively; the target verifies them in one step.

The draft model is any model plugin's architecture loaded from --speculative-draft-model-path
(it must share the target's vocabulary). Its KV pool has as many slots as the target's and is
indexed by the target's slot table, so the draft writes its KV exactly where the target keeps
the same positions: no allocator of its own, nothing to free. Per request the drafter remembers
how far its KV is computed and the slots it was written at; after verification, and whenever
the prefix cache re-points a row at shared slots, only positions whose slots are unchanged and
below the target's KV length are trusted, and the rest is computed again (a catch-up extend,
the whole prompt the first time, less any prefix the radix cache matched whose slots still hold
the draft KV an earlier request wrote there: ``_shared_prefix``).

Greedy requests draft the draft model's argmax; sampled requests draw from the draft's own
distribution under the request's sampling parameters and return it, so the core can verify by
rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from radixserve.core.batch import to_device
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm, SpeculativeContext
from radixserve.core.memory import KVPool
from radixserve.core.request import Req, token_slice
from radixserve.core.sampling import adjusted_logits, row_seed, target_probs
from radixserve.core.spec_verify import DraftPosition
from radixserve.core.weights import count_parameters, iter_weights
from radixserve.plugins.speculative.draft_kv import (
    DraftKV,
    draft_batch,
    leading_true,
    rows_by_request,
    trusted_length,
)


class StandaloneDraft(SpeculativeAlgorithm):
    def __init__(self) -> None:
        self._kv: dict[str, DraftKV] = {}

    def memory_needs(self, config: Any, host: Any, dtype: torch.dtype) -> tuple[int, int]:
        resolved = _draft_dir(config, host)
        mc = ModelConfig.from_dir(resolved)
        weights = count_parameters(resolved) * dtype.itemsize
        return weights, KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)

    def setup(self, context: SpeculativeContext) -> None:
        resolved = _draft_dir(context.config, context.host)
        mc = ModelConfig.from_dir(resolved)
        target_vocab = context.model_config.vocab_size
        if mc.vocab_size != target_vocab:
            raise ConfigError(
                f"the draft model's vocabulary has {mc.vocab_size} tokens, the target's "
                f"{target_vocab}; a draft model must share the target's tokenizer"
            )
        host = context.host
        self.device = context.device
        self.req_to_token = context.req_to_token
        self.kv_pool = KVPool(
            context.kv_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, context.dtype,
            context.device, page_size=context.page_size,
        )  # fmt: skip
        attention = (
            host.registries["attention"]
            .get(context.attention)
            .factory(self.kv_pool, mc, context.device)
        )
        factory = host.select("model", None, mc.architecture).factory
        self.model = factory(mc, attention, context.dtype, context.device)
        self.model.load_weights(iter_weights(resolved, context.dtype))
        context.platform.prepare_model(self.model, context.config)  # as the target's
        self.step = context.platform.step_executor(
            self.model, attention, self.kv_pool, context.req_to_token, context.config
        )
        self.eos_ids = context.eos_token_ids
        self.chain = _chain_graphs(context, self.model, attention, self.kv_pool)
        # Per slot, the target allocator's free count when this drafter last wrote a committed
        # token's KV there (-1: never). Equal counts: the KV is still that token's, after the
        # same prefix, and a request that the radix cache gave the slot may use it.
        self._free_counts = context.free_counts
        self._stamps = torch.full((context.kv_size + 1,), -1, dtype=torch.int64)

    def release(self, rid: str) -> None:
        self._kv.pop(rid, None)

    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[Draft]:
        """Draft autoregressively. Draft tokens stay on the device, from one draft step to the
        next and in the drafts returned (``Draft.pending``: the core reads them with the
        verify result, so no host sync waits for the draft), unless a request has penalties,
        which read them on the host after each step."""
        trusted = [self._trusted(r) for r in reqs]
        if self._chainable(reqs, max_drafts, trusted):
            assert self.chain is not None
            refresh = any(t < r.kv_len for r, t in zip(reqs, trusted, strict=True))
            chained = self.chain.launch(reqs, refresh)
            for req, limit in zip(reqs, max_drafts, strict=True):
                self._kv[req.rid] = DraftKV.written(req, req.kv_len + limit, self.req_to_token)
            return [Draft([0] * self.chain.k, pending=chained[i]) for i in range(len(reqs))]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        on_host: list[list[int]] | None = None
        if any(_penalized(r) for r in reqs):
            on_host = [[] for _ in reqs]
        # Step 0 catches each request's draft KV up to its last token, which drafts token 1.
        first = _decodes_first(
            [
                (i, s, token_slice(r.input_ids, r.output_ids, s, r.seq_len - s))
                for i, (r, s) in enumerate(zip(reqs, trusted, strict=True))
            ]
        )
        steps: list[tuple[list[int], torch.Tensor]] = []  # (request indices, their tokens)
        for step in range(max(max_drafts)):
            if step == 0:
                batch, input_ids = first, None
            else:
                prev_order, prev_ids = steps[-1]
                active = [j for j, i in enumerate(prev_order) if max_drafts[i] > step]
                if not active:
                    break
                batch = [(prev_order[j], reqs[prev_order[j]].kv_len + step, None) for j in active]
                input_ids = prev_ids[to_device(torch.tensor(active), self.device)]
            order = [i for i, _, _ in batch]
            logits = self._forward(reqs, batch, input_ids)
            if step == 0:
                self._stamp(reqs, first)
            ids = self._choose(logits, [reqs[i] for i in order], step, order, probs, on_host)
            steps.append((order, ids))
        where = rows_by_request(steps, len(reqs))
        for req, limit in zip(reqs, max_drafts, strict=True):
            # positions kv_len .. kv_len + limit - 1 drafted
            self._kv[req.rid] = DraftKV.written(req, req.kv_len + limit, self.req_to_token)
        stacked = [
            torch.stack(p) if p and len(p) == len(w) else None
            for p, w in zip(probs, where, strict=True)
        ]
        if on_host is not None:
            return [Draft(t, p) for t, p in zip(on_host, stacked, strict=True)]
        flat = torch.cat([ids for _, ids in steps])
        gather = to_device(torch.tensor([j for w in where for j in w]), self.device)
        by_req = flat[gather].split([len(w) for w in where])
        return [Draft([0] * len(w), p, t) for w, p, t in zip(where, stacked, by_req, strict=True)]

    def _trusted(self, req: Req) -> int:
        """Leading positions of ``req`` whose draft KV is there to use."""
        kv = self._kv.get(req.rid)
        if kv is None and self._free_counts is not None:
            return self._shared_prefix(req)
        return trusted_length(kv, req, self.req_to_token)

    def _shared_prefix(self, req: Req) -> int:
        """For a request new to the drafter: how many leading positions hold draft KV written
        for another request with the same prefix (the radix cache gave this one the slots), at
        slots not freed since. The draft model's KV at a position depends only on the tokens
        up to it, so a shared system prompt is not drafted again."""
        assert req.req_pool_idx is not None and self._free_counts is not None
        slots = self.req_to_token.table[req.req_pool_idx, : req.kv_len]
        return leading_true(self._stamps[slots] == self._free_counts(slots))

    def _stamp(self, reqs: Sequence[Req], caught_up: list[tuple[int, int, list[int]]]) -> None:
        """Mark the slots a catch-up step wrote: its tokens are committed ones (positions below
        each request's sequence length), unlike the drafted tokens of the later steps."""
        if self._free_counts is None:
            return
        table = self.req_to_token.table
        slots = torch.cat(
            [table[reqs[i].req_pool_idx, start : start + len(ids)] for i, start, ids in caught_up]
        )
        self._stamps[slots] = self._free_counts(slots)

    def _chainable(
        self, reqs: Sequence[Req], max_drafts: Sequence[int], trusted: Sequence[int]
    ) -> bool:
        """Whether one replay of the chain graph drafts for all of ``reqs``: full greedy
        drafts, no penalties or min-tokens mask, and at most the two last tokens to feed."""
        chain = self.chain
        return (
            chain is not None
            and chain.fits(len(reqs))
            and all(m == chain.k for m in max_drafts)
            and all(
                r.sampling.is_greedy
                and not _penalized(r)
                and r.num_output_tokens >= r.sampling.min_new_tokens
                and t >= r.kv_len - 1
                for r, t in zip(reqs, trusted, strict=True)
            )
        )

    def _forward(
        self,
        reqs: Sequence[Req],
        batch: list[tuple[int, int, list[int] | None]],
        input_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run the draft over ``batch`` entries (request index, first position, its tokens, or
        None for one token taken from ``input_ids`` on the device), decodes first; return the
        logits of each entry's last token."""
        spans: list[tuple[int, int, int]] = []
        host_ids: list[int] = []
        for i, start, ids in batch:
            spans.append((i, start, 1 if ids is None else len(ids)))
            host_ids += ids or []
        if input_ids is None:
            input_ids = to_device(torch.tensor(host_ids, dtype=torch.int64), self.device)
        fb = draft_batch(reqs, spans, input_ids, self.req_to_token, self.kv_pool, self.device)
        return self.step(fb)

    def _choose(
        self,
        logits: torch.Tensor,
        reqs: list[Req],
        step: int,
        order: list[int],
        probs: list[list[torch.Tensor]],
        on_host: list[list[int]] | None,
    ) -> torch.Tensor:
        """Each row's next draft token on the device (argmax, or a draw from the draft's
        distribution for sampled requests, whose distribution is kept in ``probs``)."""
        views = [
            DraftPosition(r, on_host[i] if on_host is not None else [], step)
            for r, i in zip(reqs, order, strict=True)
        ]
        logits = adjusted_logits(logits, views, self.eos_ids)  # type: ignore[arg-type]
        ids = logits.argmax(dim=-1)
        sampled = [j for j, r in enumerate(reqs) if not r.sampling.is_greedy]
        if sampled:
            q = target_probs(logits[sampled], [views[j] for j in sampled])  # type: ignore[misc]
            q = q / q.sum(dim=-1, keepdim=True)
            drawn = _draw(q, [views[j] for j in sampled])
            ids[to_device(torch.tensor(sampled), ids.device)] = drawn
            for k, j in enumerate(sampled):
                probs[order[j]].append(q[k])
        if on_host is not None:
            for i, t in zip(order, ids.tolist(), strict=True):
                on_host[i].append(t)
        return ids


#: Mixed into a seeded request's seed for its draft draws, so they are not the verify's draws
DRAFT_SEED_SALT = 0xD4AF7


def _draw(q: torch.Tensor, views: list[DraftPosition]) -> torch.Tensor:
    """One draft token per row of ``q`` (normalised probabilities). A seeded request draws
    from a generator keyed by its seed and output position, so its output (which follows the
    drafted tokens through rejection sampling) repeats from run to run."""
    ids = torch.multinomial(q, 1).squeeze(1)
    for k, view in enumerate(views):
        seed = view.sampling.seed
        if seed is not None:
            gen = torch.Generator(device=q.device)
            gen.manual_seed(row_seed(seed ^ DRAFT_SEED_SALT, view.num_output_tokens))
            ids[k] = torch.multinomial(q[k], 1, generator=gen)[0]
    return ids


#: Largest batch drafted by the chain graph. Measured on an H200 (8B target, one-layer draft,
#: bench/HISTORY.md): at batch 1 it lifted speculation from 2.18x to 2.28x; at batch 8 the
#: same run fell from 1.72x to 1.03x, not yet explained, so larger batches keep the step loop.
CHAIN_MAX_BATCH = 1


def _chain_graphs(context: SpeculativeContext, model: Any, attention: Any, kv_pool: KVPool) -> Any:
    """The draft's k steps as one CUDA graph per batch size up to CHAIN_MAX_BATCH, where the
    platform and attention backend can capture them."""
    from radixserve.core.speculative import FULL_DRAFT_BATCH
    from radixserve.plugins.hardware.cuda_graph import capture_sizes
    from radixserve.plugins.speculative.draft_chain import DraftChainGraphs, graphs_capturable

    if not graphs_capturable(context, attention, decode=True):
        return None
    config = context.config
    limit = min(CHAIN_MAX_BATCH, FULL_DRAFT_BATCH, config.speculative_disable_batch_size)
    return DraftChainGraphs(
        model, attention, kv_pool, context.req_to_token, config.num_draft_tokens,
        capture_sizes(limit), context.device,
    )  # fmt: skip


def _penalized(req: Req) -> bool:
    s = req.sampling
    return bool(s.frequency_penalty or s.presence_penalty or s.repetition_penalty != 1.0)


def _draft_dir(config: Any, host: Any) -> str:
    path = config.speculative_draft_model_path
    if not path:
        raise ConfigError(
            "speculative algorithm 'standalone' needs --speculative-draft-model-path (a "
            "small model sharing the target's vocabulary)"
        )
    resolved = host.hook.resolve_model_dir(model_path=path) or path
    if not Path(resolved).is_dir():
        raise ConfigError(f"draft model path '{path}' is not a model directory or a .gguf")
    return str(resolved)


def _decodes_first(batch: list[tuple[int, int, list[int]]]) -> list[tuple[int, int, list[int]]]:
    return sorted(batch, key=lambda e: len(e[2]) != 1)


@hookimpl
def register_speculative_algorithms(register: Any) -> None:
    register(
        "standalone",
        StandaloneDraft,
        description="a separate small draft model (--speculative-draft-model-path)",
    )
