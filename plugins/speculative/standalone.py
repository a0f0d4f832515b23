"""Speculative algorithm ``standalone``: a separate, smaller draft model proposes k tokens by
decoding autoregressively; the target verifies them in one step.

The draft model is any model plugin's architecture loaded from --speculative-draft-model-path
(it must share the target's vocabulary). Its KV pool has as many slots as the target's and is
indexed by the target's slot table, so the draft writes its KV exactly where the target keeps
the same positions: no allocator of its own, nothing to free. Per request the drafter remembers
how far its KV is computed and the slots it was written at; after verification, and whenever
the prefix cache re-points a row at shared slots, only positions whose slots are unchanged and
below the target's KV length are trusted, and the rest is computed again (a catch-up extend,
the whole prompt the first time).

Greedy requests draft the draft model's argmax; sampled requests draw from the draft's own
distribution under the request's sampling parameters and return it, so the core can verify by
rejection sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm, SpeculativeContext
from radixserve.core.memory import KVPool
from radixserve.core.request import Req, token_slice
from radixserve.core.sampling import adjusted_logits, target_probs
from radixserve.core.speculative import DraftPosition
from radixserve.core.weights import count_parameters, iter_weights


@dataclass(slots=True)
class _DraftKV:
    length: int  # positions [0, length) hold draft KV written for this request
    slots: torch.Tensor  # the row's slots of those positions when they were written


class StandaloneDraft(SpeculativeAlgorithm):
    def __init__(self) -> None:
        self._kv: dict[str, _DraftKV] = {}

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
        self.step = context.platform.step_executor(
            self.model, attention, self.kv_pool, context.req_to_token, context.config
        )
        self.eos_ids = context.eos_token_ids

    def release(self, rid: str) -> None:
        self._kv.pop(rid, None)

    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[Draft]:
        table = self.req_to_token.table
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        # Step 1: catch up each request's draft KV to its last token, which drafts token 1.
        starts = [self._trusted_length(r) for r in reqs]
        entries = [
            (i, s, token_slice(r.input_ids, r.output_ids, s, r.seq_len - s))
            for i, (r, s) in enumerate(zip(reqs, starts, strict=True))
        ]
        active = list(range(len(reqs)))
        for step in range(max(max_drafts)):
            if step == 0:
                batch = [(i, s, ids) for i, s, ids in entries]
            else:
                active = [i for i in active if len(tokens[i]) < max_drafts[i]]
                if not active:
                    break
                batch = [(i, reqs[i].kv_len + step, [tokens[i][-1]]) for i in active]
            logits = self._forward(reqs, batch)
            order = [i for i, _, _ in _decodes_first(batch)]
            self._choose(
                logits,
                [reqs[i] for i in order],
                [tokens[i] for i in order],
                [probs[i] for i in order],
            )
        for i, req in enumerate(reqs):
            written = req.kv_len + max_drafts[i]  # positions kv_len .. kv_len + m - 1 drafted
            assert req.req_pool_idx is not None
            self._kv[req.rid] = _DraftKV(written, table[req.req_pool_idx, :written].clone())
        return [
            Draft(t, torch.stack(p) if p and len(p) == len(t) else None)
            for t, p in zip(tokens, probs, strict=True)
        ]

    def _trusted_length(self, req: Req) -> int:
        """How many leading positions of ``req`` hold draft KV it can still use."""
        kv = self._kv.get(req.rid)
        if kv is None:
            return 0
        n = min(kv.length, req.kv_len)
        assert req.req_pool_idx is not None
        same = self.req_to_token.table[req.req_pool_idx, :n] == kv.slots[:n]
        return n if bool(same.all()) else int((~same).nonzero()[0, 0])

    def _forward(
        self, reqs: Sequence[Req], batch: list[tuple[int, int, list[int]]]
    ) -> torch.Tensor:
        """Run the draft over ``batch`` entries (request index, first position, tokens) and
        return the logits of each entry's last token, decodes first."""
        batch = _decodes_first(batch)
        table = self.req_to_token.table
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        pool_rows: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        for i, start, ids in batch:
            row = reqs[i].req_pool_idx
            assert row is not None
            input_ids += ids
            positions += range(start, start + len(ids))
            rows += [row] * len(ids)
            pool_rows.append(row)
            seq_lens.append(start + len(ids))
            logits_rows.append(len(positions) - 1)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        out_cache_loc = table[torch.tensor(rows), positions_t]
        self.req_to_token.sync()
        fb = ForwardBatch(
            input_ids=to_device(torch.tensor(input_ids, dtype=torch.int64), self.device),
            positions=to_device(positions_t, self.device),
            out_cache_loc=to_device(out_cache_loc, self.device),
            req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64),
            req_to_token=table,
            seq_lens=seq_lens,
            extend_lens=[len(ids) for _, _, ids in batch],
            num_decode=sum(1 for _, _, ids in batch if len(ids) == 1),
            logits_indices=to_device(torch.tensor(logits_rows, dtype=torch.int64), self.device),
            kv_pool=self.kv_pool,
            req_to_token_pool=self.req_to_token,
        )
        return self.step(fb)

    def _choose(
        self,
        logits: torch.Tensor,
        reqs: list[Req],
        tokens: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Append each request's next draft token (and, when sampled, its distribution)."""
        views = [DraftPosition(r, t, len(t)) for r, t in zip(reqs, tokens, strict=True)]
        logits = adjusted_logits(logits, views, self.eos_ids)  # type: ignore[arg-type]
        greedy = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(reqs) if not r.sampling.is_greedy]
        if sampled:
            q = target_probs(logits[sampled], [views[i] for i in sampled])  # type: ignore[misc]
            q = q / q.sum(dim=-1, keepdim=True)
            draws = torch.multinomial(q, 1).squeeze(1).tolist()
            for j, i in enumerate(sampled):
                greedy[i] = draws[j]
                probs[i].append(q[j])
        for i, t in enumerate(greedy):
            tokens[i].append(t)


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
