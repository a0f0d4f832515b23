"""What the HTTP handlers share: following a group of requests as they progress, SSE framing,
and usage accounting."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi.responses import Response
from pydantic import BaseModel

from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> bytes:
    if isinstance(payload, BaseModel):
        return b"data: " + payload.model_dump_json().encode() + b"\n\n"
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """An SSE event named by its payload's ``type`` (as /v1/messages and /v1/responses send
    them: ``event: message_start``, then the data)."""
    return (
        b"event: " + payload["type"].encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"
    )


@dataclass(slots=True)
class Update:
    """New output of one request since its previous update."""

    index: int  # position of the request in the group
    req: ServerReq
    text: str  # newly visible text
    token_start: int  # new output tokens are req.output_ids[token_start:token_end]
    token_end: int
    finished: bool  # the request's last update


def json_response(payload: BaseModel | dict[str, Any] | list[Any], status: int = 200) -> Response:
    if isinstance(payload, BaseModel):
        return Response(payload.model_dump_json(), status, media_type="application/json")
    return Response(msgspec.json.encode(payload), status, media_type="application/json")


async def follow(tm: TokenizerManager, reqs: Sequence[ServerReq]) -> AsyncIterator[list[Update]]:
    """Yield the updates of ``reqs`` (which share one event) until all have finished.

    Leaving early (the client disconnected, the generator was closed or cancelled) aborts every
    unfinished request, so its KV is freed."""
    n = len(reqs)
    for r in reqs:
        r.streaming = True
    sent_text, sent_tokens, done = [0] * n, [0] * n, [False] * n
    event = reqs[0].event
    try:
        while not all(done):
            await event.wait()
            event.clear()
            batch: list[Update] = []
            for i, r in enumerate(reqs):
                if done[i]:
                    continue
                finished = r.finished
                text = r.visible_text()
                ntok = len(r.output_ids)
                if len(text) > sent_text[i] or ntok > sent_tokens[i] or finished:
                    batch.append(Update(i, r, text[sent_text[i] :], sent_tokens[i], ntok, finished))
                    sent_text[i], sent_tokens[i], done[i] = len(text), ntok, finished
            if batch:
                yield batch
    finally:
        for r in reqs:
            if not r.finished:
                tm.abort(r.rid)


def finish_reason(req: ServerReq) -> str | None:
    return None if req.finish is None else req.finish.type


def matched_stop(req: ServerReq) -> int | str | None:
    """The stop string or token id that ended ``req`` (None unless it stopped on one)."""
    return req.finish.matched if req.finish is not None and req.finish.type == "stop" else None


def usage_counts(reqs: Sequence[ServerReq], n: int) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens; each prompt is counted once for its n choices."""
    prompt = completion = cached = 0
    for start in range(0, len(reqs), n):
        group = reqs[start : start + n]
        prompt += len(group[0].prompt_ids)
        cached += min(max(r.cached_tokens for r in group), len(group[0].prompt_ids))
        completion += sum(len(r.output_ids) for r in group)
    return prompt, completion, cached
