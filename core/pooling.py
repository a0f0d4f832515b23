"""Prefill-only outputs: embeddings pooled from the final hidden states, and the logprobs of
label tokens after a prompt (/v1/score).

Such a request has ``max_new_tokens`` 0 and runs through the scheduler like any prefill; its
result is taken from the step that computes its last prompt token, and it then finishes with
"length" and frees its KV. An embedding request never touches the prefix cache (see
``Scheduler._cache_of``): mean pooling needs the hidden state of every prompt token, so none
may come from the cache, and the same rule for last pooling keeps one simple path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from radixserve.core.request import Req


class PoolPlan(NamedTuple):
    rows: list[int]  # rows of the flattened step whose final hidden states are needed
    # per embedding entry: (request, its first index in ``rows``, how many, last chunk?)
    entries: list[tuple[Req, int, int, bool]]


def plan_pooling(reqs: list[Req], extend_lens: list[int]) -> PoolPlan | None:
    """Which final hidden states the step's embedding requests need; None when there are none.
    Called before the scheduler advances the step (``kv_len`` is each chunk's start)."""
    rows: list[int] = []
    entries: list[tuple[Req, int, int, bool]] = []
    offset = 0  # the flattened step: each entry's new tokens in batch order
    for req, n in zip(reqs, extend_lens, strict=True):
        if req.pooling is not None:
            final = req.kv_len + n == req.seq_len
            if req.pooling == "mean":
                take = list(range(offset, offset + n))
            else:
                take = [offset + n - 1] if final else []
            if take:
                entries.append((req, len(rows), len(take), final))
                rows += take
        offset += n
    return PoolPlan(rows, entries) if entries else None


def finish_pooling(plan: PoolPlan, hidden: torch.Tensor) -> None:
    """Accumulate (mean) or take (last) each entry's hidden states; at its last chunk set
    ``req.embedding``, L2-normalised as SGLang's pooler does by default."""
    for req, first, count, final in plan.entries:
        h = hidden[first : first + count].float()
        if req.pooling == "mean":
            chunk_sum = h.sum(dim=0)
            # NOTE: an embedding request has no cached prefix, so its first chunk starts at 0;
            # a retracted request starts over there too and drops its old sum.
            req.pooled_sum = chunk_sum if req.kv_len == 0 else req.pooled_sum + chunk_sum
            vec = req.pooled_sum / len(req.input_ids)
        else:
            vec = h[-1]
        if final:
            req.embedding = (vec / vec.norm().clamp_min(1e-12)).tolist()
            req.pooled_sum = None


def record_label_logprobs(req: Req, logits_row: torch.Tensor) -> None:
    """The logprobs (over the whole vocabulary) of ``req.label_token_ids`` from the logits of
    the prompt's last position."""
    assert req.label_token_ids is not None
    logprobs = torch.log_softmax(logits_row.float(), dim=-1)
    ids = torch.tensor(req.label_token_ids, dtype=torch.int64, device=logprobs.device)
    req.label_logprobs = logprobs[ids].tolist()
