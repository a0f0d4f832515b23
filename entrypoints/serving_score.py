"""POST /v1/score: SGLang's scoring API for a causal model.

For each item, the probabilities of the label tokens at the position after ``query + item``
(``item + query`` with ``item_first``): texts are joined, then tokenized; token ids are joined.
Each item is one prefill-only request (max_new_tokens 0) that reads the log-probability of its
label tokens from the logits of its last position (core/pooling.py); all items are queued at
once, so they share steps and the query's cached prefix. ``apply_softmax`` renormalises over
the label tokens (with ``temperature``); otherwise each score is exp(logprob) over the whole
vocabulary, as SGLang does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from radixserve.core.request import InvalidRequest
from radixserve.core.validation import check_context
from radixserve.entrypoints.openai_protocol import STRICT, UsageInfo
from radixserve.entrypoints.serving_embedding import run_prefill_only
from radixserve.entrypoints.serving_openai import OpenAIServing
from radixserve.entrypoints.streaming import json_response


class ScoringRequest(BaseModel):
    model_config = STRICT
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | list[list[int]] | None = None
    apply_softmax: bool = False
    temperature: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    item_first: bool = False
    model: str | None = None
    # SGLang's fields for sequence-classification models, embedding overrides and setwise
    # scoring: refused when set (this server scores with a causal model only)
    return_pooled_hidden_states: bool = False
    score_extraction_token: str | None = None
    embed_override_token_id: int | None = None
    return_token_logprobs: bool = False


def scores_from_logprobs(
    logprobs: Sequence[float], apply_softmax: bool, temperature: float
) -> list[float]:
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)  # centred first, so a small temperature cannot overflow
    weights = [math.exp((lp - top) / temperature) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


class ScoreServing(OpenAIServing):
    async def score(self, body: ScoringRequest, raw: Request) -> Any:
        model = self.check_model(body.model)
        for name in ("return_pooled_hidden_states", "return_token_logprobs"):
            if getattr(body, name):
                raise InvalidRequest(f"{name} is not supported by this server; omit it")
        for name in ("score_extraction_token", "embed_override_token_id"):
            if getattr(body, name) is not None:
                raise InvalidRequest(f"{name} is not supported by this server; omit it")
        if body.temperature != 1.0 and not body.apply_softmax:
            raise InvalidRequest("temperature requires apply_softmax=true")
        prompts = await self._prompts(body)
        labels = self._labels(body.label_token_ids, len(prompts))
        if not prompts:
            return json_response({"scores": [], "model": model, "object": "scoring"})
        reqs = await run_prefill_only(self.tm, prompts, raw, labels=labels)
        scores = []
        for r in reqs:
            assert r.label_logprobs is not None
            scores.append(
                scores_from_logprobs(r.label_logprobs, body.apply_softmax, body.temperature)
            )
        tokens = sum(len(r.prompt_ids) for r in reqs)
        usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens)
        return json_response(
            {"scores": scores, "model": model, "usage": usage.model_dump(), "object": "scoring"}
        )

    async def _prompts(self, body: ScoringRequest) -> list[list[int]]:
        items, query = body.items, body.query
        if items is None:
            raise InvalidRequest("items must be provided")
        if isinstance(items, str):
            items = [items]
        if not items:
            return []
        self.tm.limits.check_batch(len(items))
        if isinstance(items[0], str):
            if query is None:
                query = ""
            if not isinstance(query, str):
                raise InvalidRequest("query and items must both be text or both be token ids")
            # sized before they are built: the query is copied into each
            self.tm.check_batch_text_size([len(query) + len(i) for i in items])
            texts = [f"{i}{query}" if body.item_first else f"{query}{i}" for i in items]
            return await self.tm.encode_async(texts)  # type: ignore[arg-type]
        if query is None:
            query = []
        if isinstance(query, str):
            raise InvalidRequest("query and items must both be text or both be token ids")
        # refused before the query is copied into each item
        longest = len(query) + max(len(i) for i in items)  # type: ignore[arg-type]
        check_context(longest, self.tm.info.max_context)
        return [list(i) + query if body.item_first else query + list(i) for i in items]  # type: ignore[operator]

    def _labels(self, value: list[int] | list[list[int]] | None, count: int) -> list[list[int]]:
        if not value:
            raise InvalidRequest("label_token_ids must be a non-empty list of token ids")
        if isinstance(value[0], list):
            if len(value) != count:
                raise InvalidRequest(
                    f"label_token_ids has {len(value)} lists for {count} items; give one per item"
                )
            per_item: list[list[int]] = value  # type: ignore[assignment]
        else:
            per_item = [value] * count  # type: ignore[list-item]
        vocab = self.tm.info.vocab_size
        for labels in per_item:
            if not labels or any(not 0 <= t < vocab for t in labels):
                raise InvalidRequest(
                    f"label_token_ids must be non-empty lists of token ids in [0, {vocab})"
                )
            if len(set(labels)) != len(labels):
                raise InvalidRequest("label_token_ids must not repeat a token")
        return per_item


def add_score_routes(app: FastAPI, serving: ScoreServing) -> None:
    @app.post("/v1/score")
    async def score(body: ScoringRequest, raw: Request) -> Any:
        return await serving.score(body, raw)
