"""POST /v1/embeddings (OpenAI's shape) and POST /encode (SGLang's native one).

An embedding request is a prefill-only request (max_new_tokens 0) that the engine schedules
like any other and answers with the final hidden states pooled as ``--embedding-pooling``
says (core/pooling.py), L2-normalised. A batch is queued at once, so its prompts share steps.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel

from radixserve.core.request import InvalidRequest, SamplingParams
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import STRICT, UsageInfo
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.serving_native import _rids as request_ids
from radixserve.entrypoints.serving_openai import OpenAIServing, raise_if_failed
from radixserve.entrypoints.streaming import json_response
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    model_config = STRICT
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    rid: str | list[str] | None = None


async def run_prefill_only(
    tm: TokenizerManager,
    prompts: Sequence[list[int]],
    raw: Request,
    pooling: str | None = None,
    labels: Sequence[list[int]] | None = None,
    rids: Sequence[str | None] | None = None,
) -> list[ServerReq]:
    """Check and queue one prefill-only request per prompt (an embedding with ``pooling``, or
    the logprobs of ``labels[i]`` after prompt i), wait for all; failures raise ApiError."""
    params = SamplingParams(max_new_tokens=0)
    for ids in prompts:
        tm.check(ids, params)
    tm.admit(len(prompts))
    event = asyncio.Event()
    reqs: list[ServerReq] = []
    try:
        for i, ids in enumerate(prompts):
            label_ids = labels[i] if labels is not None else None
            rid = rids[i] if rids is not None else None
            reqs.append(tm.submit(ids, params, event, rid, -1, pooling, label_ids))
    except Exception:
        for r in reqs:
            tm.abort(r.rid)
        raise
    await tm.wait_finished(reqs, raw.is_disconnected)
    raise_if_failed(reqs)
    return reqs


async def tokenize_inputs(
    tm: TokenizerManager, value: Any, field: str
) -> tuple[list[list[int]], bool]:
    """A string, a list of strings, a list of token ids or a list of such lists as prompts,
    and whether it was a batch."""
    if isinstance(value, str):
        return await tm.encode_async([value]), False
    if isinstance(value, list) and value:
        tm.limits.check_batch(len(value))  # before tokenizing thousands of prompts
        if all(isinstance(v, str) for v in value):
            return await tm.encode_async(value), True
        if all(_is_int(t) for t in value):
            return [list(value)], False
        if all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
            return [list(v) for v in value], True
    raise InvalidRequest(
        f"{field} must be a string, a non-empty list of strings, a non-empty list of token ids "
        "or a list of such lists"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_texts(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)
    )


def _base64_floats(values: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32 bytes (what its clients decode)."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


class EmbeddingServing(OpenAIServing):
    def __init__(
        self,
        tm: TokenizerManager,
        model_name: str,
        aliases: Sequence[str],
        strict_model_name: bool,
        pooling: str,
        hidden_size: int | None,
    ) -> None:
        super().__init__(tm, model_name, aliases, strict_model_name)
        self.pooling = pooling
        self.hidden_size = hidden_size

    async def create(self, body: EmbeddingRequest, raw: Request) -> Any:
        model = self.check_model(body.model)
        if body.dimensions is not None and body.dimensions != self.hidden_size:
            raise ApiError(
                400,
                f"dimensions={body.dimensions} is not supported: this model's embeddings have "
                f"{self.hidden_size} dimensions and cannot be shortened; omit dimensions",
                param="dimensions",
            )
        prompts, _ = await tokenize_inputs(self.tm, body.input, "input")
        reqs = await run_prefill_only(self.tm, prompts, raw, self.pooling)
        data = []
        for i, r in enumerate(reqs):
            assert r.embedding is not None
            vec = r.embedding
            embedding = _base64_floats(vec) if body.encoding_format == "base64" else vec
            data.append({"object": "embedding", "embedding": embedding, "index": i})
        tokens = sum(len(r.prompt_ids) for r in reqs)
        usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens)
        return json_response(
            {"object": "list", "data": data, "model": model, "usage": usage.model_dump()}
        )

    async def encode(self, body: dict[str, Any], raw: Request) -> Any:
        """SGLang's /encode: ``text`` or ``input_ids`` -> {"embedding", "meta_info"}, a list
        for a list input."""
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise InvalidRequest("send exactly one of 'text' or 'input_ids'")
        if text is not None and not _is_texts(text):
            raise InvalidRequest("text must be a string or a non-empty list of strings")
        if input_ids is not None and _is_texts(input_ids):
            raise InvalidRequest("input_ids must be token ids or lists of token ids, not text")
        field = "text" if text is not None else "input_ids"
        prompts, batch = await tokenize_inputs(self.tm, body[field], field)
        rids = request_ids(body.get("rid"), len(prompts))
        reqs = await run_prefill_only(self.tm, prompts, raw, self.pooling, rids=rids)
        results = [
            {
                "embedding": r.embedding,
                "meta_info": {
                    "id": r.rid,
                    "finish_reason": r.finish.to_json() if r.finish else None,
                    "prompt_tokens": len(r.prompt_ids),
                    "e2e_latency": r.e2e_latency,
                },
            }
            for r in reqs
        ]
        return json_response(results if batch else results[0])


def add_embedding_routes(app: FastAPI, serving: EmbeddingServing, read_json: Any) -> None:
    """Register /v1/embeddings and /encode on ``app`` (``read_json``: the server's body reader)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Any:
        return await serving.create(body, raw)

    @app.post("/encode")
    async def encode(raw: Request) -> Any:
        body = await read_json(raw)
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        return await serving.encode(body, raw)
