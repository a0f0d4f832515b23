"""SGLang's native routes: /generate, and tokenizing and detokenizing as its clients call them."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from radixserve.core.request import InvalidRequest
from radixserve.entrypoints.http_json import read_json, read_object
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest
from radixserve.entrypoints.serving_chat import ChatServing
from radixserve.entrypoints.serving_native import NativeServing
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

GET_POST = ["GET", "POST"]
# /tokenize's fields that shape a chat's rendering, as on /v1/chat/completions
CHAT_RENDER_FIELDS = (
    "messages", "tools", "tool_choice", "documents", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message",
)  # fmt: skip


def add_native_routes(
    app: FastAPI, tm: TokenizerManager, native: NativeServing, chat: ChatServing
) -> None:
    @app.api_route("/generate", methods=GET_POST)
    async def generate(raw: Request) -> Any:
        return await native.generate(await read_json(raw), raw)

    # SGLang registers both the /v1/ and the bare paths (TokenizeRequest, DetokenizeRequest).
    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Any:
        return await _tokenize(tm, chat, await read_object(raw))

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Any:
        body = await read_object(raw)
        tokens = body.get("tokens")
        skip = body.get("skip_special_tokens", True) is not False
        vocab = tm.info.vocab_size
        if isinstance(tokens, list) and tokens and isinstance(tokens[0], list):  # a batch
            batch = [_token_ids(t, f"tokens[{i}]", vocab) for i, t in enumerate(tokens)]
            return {"text": [tm.tokenizer.decode(t, skip_special_tokens=skip) for t in batch]}
        ids = _token_ids(tokens, "tokens", vocab, batch_ok=True)
        return {"text": tm.tokenizer.decode(ids, skip_special_tokens=skip)}


async def _tokenize(
    tm: TokenizerManager, chat: ChatServing, body: dict[str, Any]
) -> dict[str, Any]:
    prompt = body.get("prompt", body.get("text"))
    special = body.get("add_special_tokens", True) is not False
    if body.get("messages") is not None:
        if prompt is not None:
            raise InvalidRequest("send exactly one of 'prompt' or 'messages'")
        tokens: Any = await _chat_prompt_ids(chat, body)
        count: Any = len(tokens)
    elif isinstance(prompt, str):
        tokens = (await tm.encode_async([prompt], special))[0]
        count = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = await tm.encode_async(prompt, special)
        count = [len(t) for t in tokens]
    else:
        raise InvalidRequest(
            "prompt must be a string or a list of strings (or send 'messages', a chat)"
        )
    return {"tokens": tokens, "count": count, "max_model_len": tm.info.max_context}


async def _chat_prompt_ids(chat: ChatServing, body: dict[str, Any]) -> list[int]:
    """/tokenize's ``messages``: the ids a chat completion with these messages (and tools,
    documents, chat_template_kwargs, add_generation_prompt, continue_final_message) prompts
    with, from the chat route's own rendering."""
    fields = {k: body[k] for k in CHAT_RENDER_FIELDS if body.get(k) is not None}
    try:
        request = ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # 400 naming the field, as on /v1/chat/completions
        raise RequestValidationError(e.errors()) from None
    return await chat.prompt_ids(request)


def _token_ids(value: Any, field: str, vocab: int, batch_ok: bool = False) -> list[int]:
    shape = "a list of token ids or a list of such lists" if batch_ok else "a list of token ids"
    if not isinstance(value, list):
        raise InvalidRequest(f"{field} must be {shape}", param=field)
    for j, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool):
            raise InvalidRequest(
                f"{field} must be {shape}; {field}[{j}] is {t!r:.100}", param=field
            )
        if not 0 <= t < vocab:
            raise InvalidRequest(
                f"{field}[{j}] = {t} is outside the vocabulary [0, {vocab})", param=field
            )
    return value
