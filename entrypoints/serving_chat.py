"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    ChoiceLogprobs,
    DeltaMessage,
    DeltaToolCall,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from radixserve.entrypoints.serving_openai import OpenAIServing
from radixserve.entrypoints.streaming import Update, finish_reason, json_response, sse
from radixserve.entrypoints.structured_output import chat_grammar
from radixserve.entrypoints.tokenizer_manager import ServerReq
from radixserve.entrypoints.tool_calls import ToolPlan, ToolStream, plan_tools


class ChatServing(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, raw: Request) -> Any:
        model = self.check_model(body.model)
        plan = plan_tools(body)
        grammar = chat_grammar(body, plan)
        messages = [_message_dict(i, m) for i, m in enumerate(body.messages)]
        extra = _template_kwargs(body)
        if plan.active:
            extra["tools"] = plan.tools
        template = self.tm.tokenizer.template_for(extra.get("tools")) or ""
        ids = self.tm.encode_chat(plan.prompt_messages(messages, template), **extra)
        if body.max_completion_tokens is not None:
            max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field = body.max_tokens, "max_tokens"
        top_n = body.top_logprobs or 0
        if top_n and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        params, max_field = self.sampling(
            body, [len(ids)], max_tokens, field, body.logprobs, top_n, grammar
        )
        reqs = self.submit_all([ids], params, body.n, max_field)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            stream = self._stream(body, reqs, rid, model, plan)
            return StreamingResponse(stream, media_type="text/event-stream")
        await self.wait(reqs, raw.is_disconnected)
        choices = []
        for i, r in enumerate(reqs):
            content, calls = plan.parse(r.text) if plan.active else (r.text, [])
            choices.append(
                ChatCompletionChoice(
                    index=i,
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    logprobs=self._logprobs(r, 0, len(r.output_ids)) if body.logprobs else None,
                    finish_reason=_finish_reason(r, bool(calls)),
                )
            )
        response = ChatCompletionResponse(
            id=rid, model=model, choices=choices, usage=self.usage(reqs, body.n)
        )
        return json_response(response)

    async def _stream(
        self,
        body: ChatCompletionRequest,
        reqs: list[ServerReq],
        rid: str,
        model: str,
        plan: ToolPlan,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None) -> BaseModel:
            return ChatCompletionChunk(
                id=rid, created=created, model=model, choices=choices, usage=usage
            )

        def choice(u: Update) -> ChatStreamChoice | None:
            logprobs = None
            if body.logprobs and u.token_end > u.token_start:
                logprobs = self._logprobs(u.req, u.token_start, u.token_end)
            text, calls = u.text, []
            if plan.active:
                text, calls = tool_streams[u.index].feed(u.text, u.finished)
            if not (text or calls or logprobs is not None or u.finished):
                return None
            deltas = [
                DeltaToolCall(index=called[u.index] + j, id=c.id, type=c.type, function=c.function)
                for j, c in enumerate(calls)
            ]
            called[u.index] += len(calls)
            return ChatStreamChoice(
                index=u.index,
                delta=DeltaMessage(content=text or None, tool_calls=deltas or None),
                logprobs=logprobs,
                finish_reason=_finish_reason(u.req, called[u.index] > 0) if u.finished else None,
            )

        tool_streams = [ToolStream(plan) for _ in reqs]
        called = [0] * len(reqs)  # tool calls sent per choice
        for i in range(len(reqs)):
            role = DeltaMessage(role="assistant", content="")
            yield sse(chunk([ChatStreamChoice(index=i, delta=role)], None))
        async for event in self.stream_chunks(reqs, body.n, include_usage, choice, chunk):
            yield event

    def _logprobs(self, req: ServerReq, start: int, end: int) -> ChoiceLogprobs:
        content = []
        for pos in range(start, min(end, len(req.logprobs))):
            text = self.token_text(req.output_ids[pos])
            tops = req.top_logprobs[pos] if pos < len(req.top_logprobs) else []
            content.append(
                TokenLogprob(
                    token=text,
                    logprob=req.logprobs[pos],
                    bytes=list(text.encode()),
                    top_logprobs=[_top(self.token_text(tid), lp) for lp, tid in tops],
                )
            )
        return ChoiceLogprobs(content=content)


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def _finish_reason(req: ServerReq, called: bool) -> str | None:
    reason = finish_reason(req)
    return "tool_calls" if called and reason == "stop" else reason


_TEMPLATE_ARGS = ("messages", "tools", "add_generation_prompt")


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    extra = dict(body.chat_template_kwargs or {})
    for name in _TEMPLATE_ARGS:
        if name in extra:
            raise ApiError(
                400,
                f"chat_template_kwargs may not set '{name}' (the server sets it)",
                param="chat_template_kwargs",
            )
    if body.documents is not None:
        extra["documents"] = body.documents
    return extra


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400,
                    f"messages[{index}].content[{j}] has type {part.get('type')!r}; "
                    "only text parts are supported",
                    param=f"messages[{index}].content",
                )
            texts.append(part["text"])
        content = "".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out
