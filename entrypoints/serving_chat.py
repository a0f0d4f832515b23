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
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from radixserve.entrypoints.serving_openai import OpenAIServing
from radixserve.entrypoints.streaming import Update, finish_reason, json_response, sse
from radixserve.entrypoints.tokenizer_manager import ServerReq


class ChatServing(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, raw: Request) -> Any:
        model = self.check_model(body.model)
        _check_unsupported(body)
        ids = self.tm.encode_chat([_message_dict(i, m) for i, m in enumerate(body.messages)])
        if body.max_completion_tokens is not None:
            max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, field = body.max_tokens, "max_tokens"
        top_n = body.top_logprobs or 0
        if top_n and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        params, max_field = self.sampling(body, [len(ids)], max_tokens, field, body.logprobs, top_n)
        reqs = self.submit_all([ids], params, body.n, max_field)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            stream = self._stream(body, reqs, rid, model)
            return StreamingResponse(stream, media_type="text/event-stream")
        await self.wait(reqs, raw.is_disconnected)
        choices = [
            ChatCompletionChoice(
                index=i,
                message=AssistantMessage(content=r.text),
                logprobs=self._logprobs(r, 0, len(r.output_ids)) if body.logprobs else None,
                finish_reason=finish_reason(r),
            )
            for i, r in enumerate(reqs)
        ]
        response = ChatCompletionResponse(
            id=rid, model=model, choices=choices, usage=self.usage(reqs, body.n)
        )
        return json_response(response)

    async def _stream(
        self, body: ChatCompletionRequest, reqs: list[ServerReq], rid: str, model: str
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
            if not (u.text or logprobs is not None or u.finished):
                return None
            return ChatStreamChoice(
                index=u.index,
                delta=DeltaMessage(content=u.text or None),
                logprobs=logprobs,
                finish_reason=finish_reason(u.req) if u.finished else None,
            )

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


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools and body.tool_choice != "none":
        raise ApiError(400, "tools (function calling) are not supported yet", param="tools")
    if body.response_format is not None and body.response_format.type != "text":
        raise ApiError(
            400,
            f"response_format type '{body.response_format.type}' is not supported yet; "
            "only 'text' is",
            param="response_format",
        )


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
    return out
