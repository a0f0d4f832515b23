"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from radixserve.entrypoints.chat_output import ChatOutput
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.media import ServerImages
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
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.serving_openai import OpenAIServing
from radixserve.entrypoints.streaming import (
    Update,
    finish_reason,
    json_response,
    matched_stop,
    sse,
)
from radixserve.entrypoints.structured_output import chat_grammar
from radixserve.entrypoints.tool_calls import ToolPlan, plan_tools
from radixserve.entrypoints.tool_parsers import get_tool_parser


class ChatRun(NamedTuple):
    model: str  # the served name, which the response reports
    reqs: list[ServerReq]  # the n choices, queued
    output: ChatOutput  # how their text becomes reasoning, content and tool calls


class ChatServing(OpenAIServing):
    def __init__(
        self,
        *args: Any,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        **kwargs: Any,
    ) -> None:
        """``tool_call_parser``/``reasoning_parser``: the server's --tool-call-parser and
        --reasoning-parser (names checked at start-up)."""
        super().__init__(*args, **kwargs)
        self.tool_parser = get_tool_parser(tool_call_parser)
        self.reasoning_parser = reasoning_parser

    async def start(
        self, body: ChatCompletionRequest, budget_field: str | None = None, bound: bool = False
    ) -> ChatRun:
        """Check and queue a chat request: its n requests and how their output is read.
        /v1/messages and /v1/responses translate their bodies into chat requests and start
        them here too: ``budget_field`` is what their API calls the output budget (for
        errors); ``bound``: the budget is only an upper bound (Anthropic's required
        max_tokens, which clients set high), so past the context the answer ends there
        ("length") instead of being refused."""
        model = self.check_model(body.model)
        plan = plan_tools(body, self.tool_parser)
        output = ChatOutput(plan, self.reasoning_parser, body)
        if plan.active and plan.parser.keeps_special_tokens and body.skip_special_tokens is None:
            # the format's markers are special tokens: the parser must see them
            body = body.model_copy(update={"skip_special_tokens": False})
        grammar = chat_grammar(body, plan)
        ids = await self.prompt_ids(body, plan)
        max_tokens, field = self.output_budget(body)
        field = budget_field or field
        top_n = body.top_logprobs or 0
        if top_n and not body.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        params, max_field = self.sampling(
            body, [len(ids)], max_tokens, field, body.logprobs, top_n, grammar
        )
        if bound:
            max_field = None
        return ChatRun(model, self.submit_all([ids], params, body.n, max_field, body=body), output)

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Any:
        model, reqs, output = await self.start(body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            stream = self._stream(body, reqs, rid, model, output)
            return StreamingResponse(stream, media_type="text/event-stream")
        await self.wait(reqs, raw.is_disconnected)
        choices = []
        for i, r in enumerate(reqs):
            reasoning, content, calls = output.parse(r.text)
            message = AssistantMessage(
                content=content, reasoning_content=reasoning, tool_calls=calls or None
            )
            choices.append(
                ChatCompletionChoice(
                    index=i,
                    message=message,
                    logprobs=self._logprobs(r, 0, len(r.output_ids)) if body.logprobs else None,
                    finish_reason=_finish_reason(r, bool(calls)),
                    matched_stop=matched_stop(r),
                )
            )
        response = ChatCompletionResponse(
            id=rid, model=model, choices=choices, usage=self.usage(reqs, body.n)
        )
        return json_response(response)

    async def prompt_ids(
        self, body: ChatCompletionRequest, plan: ToolPlan | None = None
    ) -> list[int]:
        """The prompt's token ids: the messages (and tools, documents, template kwargs)
        through the chat template; with continue_final_message, the last (assistant)
        message's text goes on unclosed. /tokenize renders chats with it too."""
        plan = plan or plan_tools(body, self.tool_parser)
        images: list[Any] = []  # image_url parts, in prompt order
        messages = [
            _message_dict(i, m, self.tm.images, images) for i, m in enumerate(body.messages)
        ]
        extra = _template_kwargs(body)
        if plan.active:
            extra["tools"] = plan.tools
        template = self.tm.tokenizer.template_for(extra.get("tools")) or ""
        prefill = _final_assistant_text(body, messages)
        if prefill is not None:
            messages = messages[:-1]
        ids = await self.tm.encode_chat_async(plan.prompt_messages(messages, template), **extra)
        if prefill:  # the answer goes on from the client's text (SGLang's way)
            ids += (await self.tm.encode_async([prefill], add_special_tokens=False))[0]
        return await self.tm.images.prompt(ids, images)

    async def _stream(
        self,
        body: ChatCompletionRequest,
        reqs: list[ServerReq],
        rid: str,
        model: str,
        output: ChatOutput,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None) -> BaseModel:
            return ChatCompletionChunk(
                id=rid, created=created, model=model, choices=choices, usage=usage
            )

        def choice(u: Update) -> ChatStreamChoice | None:
            logprobs = None
            if body.logprobs and u.token_end > u.token_start:
                logprobs = self._logprobs(u.req, u.token_start, u.token_end)
            stream = streams[u.index]
            reasoning, text, calls = stream.feed(u.text, u.finished)
            if not (reasoning or text or calls or logprobs is not None or u.finished):
                return None
            delta = DeltaMessage(
                content=text or None, reasoning_content=reasoning or None, tool_calls=calls or None
            )
            return ChatStreamChoice(
                index=u.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=_finish_reason(u.req, stream.calls_sent > 0) if u.finished else None,
                matched_stop=matched_stop(u.req) if u.finished else None,
            )

        streams = [output.stream() for _ in reqs]
        for i in range(len(reqs)):
            role = DeltaMessage(role="assistant", content="")
            yield sse(chunk([ChatStreamChoice(index=i, delta=role)], None))
        async for event in self.stream_chunks(reqs, body.n, body.stream_options, choice, chunk):
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


_TEMPLATE_ARGS = ("messages", "tools")


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    extra = dict(body.chat_template_kwargs or {})
    for name in _TEMPLATE_ARGS:
        if name in extra:
            raise ApiError(
                400,
                f"chat_template_kwargs may not set '{name}' (the server sets it)",
                param="chat_template_kwargs",
            )
    # as vLLM: the template kwargs' add_generation_prompt wins over the request field
    opening = extra.get("add_generation_prompt", body.add_generation_prompt)
    if not isinstance(opening, bool):
        raise ApiError(
            400, "add_generation_prompt must be true or false", param="chat_template_kwargs"
        )
    # continuing the last message: the turn before it is rendered with the assistant's opening
    extra["add_generation_prompt"] = opening or body.continue_final_message
    if body.documents is not None:
        extra["documents"] = body.documents
    return extra


def _final_assistant_text(
    body: ChatCompletionRequest, messages: list[dict[str, Any]]
) -> str | None:
    """With continue_final_message: the last message's text, which the answer continues (it
    must be the assistant's); else None."""
    if not body.continue_final_message:
        return None
    if messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls"):
        raise ApiError(
            400,
            "continue_final_message needs the last message to be an assistant message with text",
            param="continue_final_message",
        )
    if len(messages) == 1:  # the turns before it are rendered alone: there must be one
        raise ApiError(
            400,
            "continue_final_message needs a message before the assistant message it continues",
            param="continue_final_message",
        )
    return str(messages[-1]["content"])


def _message_dict(
    index: int, message: ChatMessage, media: ServerImages, images: list[Any]
) -> dict[str, Any]:
    """The message for the chat template; an image_url part becomes the family's image
    placeholder text, its URL appended to ``images``."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") == "image_url" and isinstance(part.get("image_url"), dict | str):
                media.refuse_if_text_only()
                images.append(part["image_url"])
                texts.append(media.placeholder)
                continue
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400,
                    f"messages[{index}].content[{j}] has type {part.get('type')!r}; "
                    "only text and image_url parts are supported",
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
