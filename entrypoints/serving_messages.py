"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API, served as the
chat request it translates to (``anthropic_protocol``), its output as content blocks.

- ``max_tokens`` is an upper bound: where the prompt leaves less room in the context, the
  answer ends at the context (``max_tokens``) instead of being refused (agent clients send a
  large one with every request, fit for the largest models).
- ``stop_reason``: ``tool_use`` when the answer called a tool, ``max_tokens`` when the budget
  ran out, ``stop_sequence`` (and ``stop_sequence``) when one of the request's ended it, else
  ``end_turn``.
- ``usage``: ``input_tokens`` counts the prompt tokens the radix cache did not hold,
  ``cache_read_input_tokens`` those it did (Anthropic's split: the two add up to the prompt);
  nothing is written to a cache on request, so ``cache_creation_input_tokens`` is 0.
- Reasoning split off by ``--reasoning-parser`` is a ``thinking`` block (with an empty
  signature: nothing to verify it with).
- A stream sends Anthropic's events: message_start, ping, content_block_start /
  content_block_delta (text_delta, thinking_delta, input_json_delta) / content_block_stop per
  block, message_delta (stop_reason, usage), message_stop; a failure after the start is an
  ``error`` event.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from radixserve.entrypoints.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
)
from radixserve.entrypoints.http_errors import anthropic_error_body
from radixserve.entrypoints.output_blocks import Block, BlockEvent, BlockSequence, whole_blocks
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.serving_chat import ChatRun, ChatServing
from radixserve.entrypoints.streaming import follow, json_response, sse_event, usage_counts

_DELTAS = {"text": "text_delta", "reasoning": "thinking_delta", "tool_call": "input_json_delta"}
_DELTA_FIELDS = {"text": "text", "reasoning": "thinking", "tool_call": "partial_json"}


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, body: MessagesRequest, raw: Request) -> Any:
        # max_tokens is required, and agent clients send a large one: a bound, not a demand
        run = await self.chat.start(chat_request(body), bound=True)
        mid = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(self._stream(run, mid), media_type="text/event-stream")
        await self.chat.wait(run.reqs, raw.is_disconnected)
        (req,) = run.reqs
        blocks = whole_blocks(run.output, req.text)
        called = any(b.kind == "tool_call" for b in blocks)
        message = _message(mid, run.model, [_content(b) for b in blocks], req)
        message.update(_stop(req, called))
        return json_response(message)

    async def count_tokens(self, body: CountTokensRequest) -> Any:
        chat = chat_request(body)
        self.chat.check_model(chat.model)
        ids = await self.chat.prompt_ids(chat)
        return json_response({"input_tokens": len(ids)})

    async def _stream(self, run: ChatRun, mid: str) -> AsyncIterator[bytes]:
        (req,) = run.reqs
        start = _message(mid, run.model, [], req)
        yield sse_event({"type": "message_start", "message": start})
        yield sse_event({"type": "ping"})
        stream, blocks = run.output.stream(), BlockSequence()
        async for updates in follow(self.chat.tm, run.reqs):
            for u in updates:
                if u.req.failed:
                    message = u.req.finish.message if u.req.finish is not None else None
                    body = anthropic_error_body(u.req.error_status, message or "request failed")
                    yield sse_event(body)
                    return
                events = blocks.feed(*stream.feed(u.text, u.finished))
                if u.finished:
                    events += blocks.close()
                for event in events:
                    yield sse_event(_block_event(event))
        delta = {"type": "message_delta", "delta": _stop(req, blocks.called)}
        yield sse_event({**delta, "usage": _usage(req)})
        yield sse_event({"type": "message_stop"})


def _message(mid: str, model: str, content: list[dict[str, Any]], req: ServerReq) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": _usage(req),
    }


def _usage(req: ServerReq) -> dict[str, int]:
    prompt, output, cached = usage_counts([req], 1)
    return {
        "input_tokens": prompt - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": output,
    }


def _stop(req: ServerReq, called: bool) -> dict[str, Any]:
    """stop_reason and stop_sequence of a finished request."""
    finish = req.finish
    reason, sequence = "end_turn", None
    if finish is not None and finish.type == "length":
        reason = "max_tokens"
    elif called:
        reason = "tool_use"
    elif finish is not None and isinstance(finish.matched, str):
        reason, sequence = "stop_sequence", finish.matched
    return {"stop_reason": reason, "stop_sequence": sequence}


def _content(block: Block, streamed: bool = False) -> dict[str, Any]:
    """The content block; ``streamed``: as content_block_start opens it (empty)."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if streamed else block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": "" if streamed else block.text}
    tool_id = "toolu_" + block.call_id.removeprefix("call_")
    args = {} if streamed else block.arguments()
    return {"type": "tool_use", "id": tool_id, "name": block.name, "input": args}


def _block_event(event: BlockEvent) -> dict[str, Any]:
    block = event.block
    if event.type == "start":
        return {
            "type": "content_block_start",
            "index": block.index,
            "content_block": _content(block, streamed=True),
        }
    if event.type == "stop":
        return {"type": "content_block_stop", "index": block.index}
    delta = {"type": _DELTAS[block.kind], _DELTA_FIELDS[block.kind]: event.delta}
    return {"type": "content_block_delta", "index": block.index, "delta": delta}
