"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the OpenAI Responses API, served as
the chat request it translates to (``responses_protocol``), its output as output items
(reasoning, message with output_text, function_call) in the order the model wrote them.

A response that ran out of ``max_output_tokens`` is ``incomplete`` (reason
``max_output_tokens``). Finished responses are kept (``store``, default true) with their
conversation in a bounded store in this process (``responses_store``); ``previous_response_id``
continues one, and names an unknown or dropped one in a 404. A stream sends OpenAI's events:
response.created, response.in_progress, per item response.output_item.added, its
content_part / output_text / reasoning_text / function_call_arguments events and
response.output_item.done, then response.completed (or response.incomplete); each carries a
``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.output_blocks import Block, BlockEvent, BlockSequence, whole_blocks
from radixserve.entrypoints.responses_protocol import (
    ResponsesRequest,
    chat_request,
    input_messages,
)
from radixserve.entrypoints.responses_store import ResponseStore
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.serving_chat import ChatRun, ChatServing
from radixserve.entrypoints.serving_openai import error_event
from radixserve.entrypoints.streaming import follow, json_response, sse_event, usage_counts

_ITEM_PREFIX = {"text": "msg", "reasoning": "rs", "tool_call": "fc"}


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    async def create(self, body: ResponsesRequest, raw: Request) -> Any:
        conversation = self._history(body.previous_response_id) + input_messages(body.input)
        run = await self.chat.start(chat_request(body, conversation), "max_output_tokens")
        base = _response(f"resp_{uuid.uuid4().hex}", run.model, body)
        if body.stream:
            stream = self._stream(run, base, body, conversation)
            return StreamingResponse(stream, media_type="text/event-stream")
        await self.chat.wait(run.reqs, raw.is_disconnected)
        (req,) = run.reqs
        blocks = whole_blocks(run.output, req.text)
        return json_response(self._finish(base, blocks, req, body, conversation))

    def retrieve(self, response_id: str) -> Any:
        return json_response(self._stored(response_id, "response_id").response)

    def delete(self, response_id: str) -> Any:
        self._stored(response_id, "response_id")
        self.store.pop(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    def _stored(self, response_id: str, param: str) -> Any:
        item = self.store.get(response_id)
        if item is None:
            raise ApiError(
                404,
                f"no stored response with id '{response_id}' (responses made with store=false "
                f"are not kept, and this server keeps the latest {self.store.max_entries})",
                param=param,
            )
        return item

    def _history(self, previous: str | None) -> list[dict[str, Any]]:
        return (
            []
            if previous is None
            else list(self._stored(previous, "previous_response_id").messages)
        )

    def _finish(
        self,
        base: dict[str, Any],
        blocks: list[Block],
        req: ServerReq,
        body: ResponsesRequest,
        conversation: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The finished response object (stored when the request asks)."""
        output = [_item(base["id"], b, "completed") for b in blocks]
        response = {**base, "output": output, "usage": _usage(req), **_status(req)}
        if body.store:
            self.store.put(response, [*conversation, _assistant_turn(blocks)])
        return response

    async def _stream(
        self,
        run: ChatRun,
        base: dict[str, Any],
        body: ResponsesRequest,
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        seq = iter(range(1 << 62))

        def event(payload: dict[str, Any]) -> bytes:
            return sse_event({**payload, "sequence_number": next(seq)})

        (req,) = run.reqs
        yield event({"type": "response.created", "response": base})
        yield event({"type": "response.in_progress", "response": base})
        stream, blocks = run.output.stream(), BlockSequence()
        async for updates in follow(self.chat.tm, run.reqs):
            for u in updates:
                if u.req.failed:
                    error = error_event(u.req)["error"]
                    # OpenAI's error event (code, message, param), and the error object too
                    yield event({**error, "type": "error", "error": error})
                    return
                events = blocks.feed(*stream.feed(u.text, u.finished))
                if u.finished:
                    events += blocks.close()
                for e in events:
                    for payload in _item_events(base["id"], e):
                        yield event(payload)
        response = self._finish(base, blocks.blocks, req, body, conversation)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield event({"type": kind, "response": response})


def _response(rid: str, model: str, body: ResponsesRequest) -> dict[str, Any]:
    """The response object before any output (what response.created carries)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "truncation": "disabled",
        "metadata": body.metadata or {},
        "user": body.user,
        "usage": None,
    }


def _status(req: ServerReq) -> dict[str, Any]:
    if req.finish is not None and req.finish.type == "length":
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {"status": "completed"}


def _usage(req: ServerReq) -> dict[str, Any]:
    prompt, output, cached = usage_counts([req], 1)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def _item_id(rid: str, block: Block) -> str:
    return f"{_ITEM_PREFIX[block.kind]}_{rid.removeprefix('resp_')}_{block.index}"


def _part(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(rid: str, block: Block, status: str) -> dict[str, Any]:
    """The output item of ``block``; with status in_progress, as it opens (empty)."""
    text = block.text if status == "completed" else ""
    item: dict[str, Any] = {"id": _item_id(rid, block), "status": status}
    if block.kind == "tool_call":
        return {
            **item, "type": "function_call", "call_id": block.call_id, "name": block.name,
            "arguments": text,
        }  # fmt: skip
    if block.kind == "reasoning":
        return {**item, "type": "reasoning", "summary": [], "content": [_part(block, text)]}
    return {**item, "type": "message", "role": "assistant", "content": [_part(block, text)]}


def _item_events(rid: str, event: BlockEvent) -> Iterator[dict[str, Any]]:
    block = event.block
    where = {"item_id": _item_id(rid, block), "output_index": block.index}
    part = {**where, "content_index": 0}
    kind = "reasoning_text" if block.kind == "reasoning" else "output_text"
    if event.type == "start":
        item = _item(rid, block, "in_progress")
        yield {"type": "response.output_item.added", "output_index": block.index, "item": item}
        if block.kind != "tool_call":
            yield {"type": "response.content_part.added", **part, "part": _part(block, "")}
    elif event.type == "delta" and block.kind == "tool_call":
        yield {"type": "response.function_call_arguments.delta", **where, "delta": event.delta}
    elif event.type == "delta":
        yield {"type": f"response.{kind}.delta", **part, "delta": event.delta, "logprobs": []}
    elif block.kind == "tool_call":
        done = {"arguments": block.text, "name": block.name}
        yield {"type": "response.function_call_arguments.done", **where, **done}
    else:
        yield {"type": f"response.{kind}.done", **part, "text": block.text, "logprobs": []}
        yield {"type": "response.content_part.done", **part, "part": _part(block, block.text)}
    if event.type == "stop":
        item = _item(rid, block, "completed")
        yield {"type": "response.output_item.done", "output_index": block.index, "item": item}


def _assistant_turn(blocks: list[Block]) -> dict[str, Any]:
    """The answer as the chat message a later turn's prompt shows."""
    text = "".join(b.text for b in blocks if b.kind == "text")
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
        for b in blocks
        if b.kind == "tool_call"
    ]
    if calls:
        turn["tool_calls"] = calls
    return turn
