"""The OpenAI routes: chat and text completions, and the model list."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request

from radixserve.entrypoints.bootstrap import refused_rooms
from radixserve.entrypoints.http_errors import error_body, is_client_error
from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from radixserve.entrypoints.serving_chat import ChatServing
from radixserve.entrypoints.serving_completions import CompletionServing
from radixserve.entrypoints.streaming import json_response
from radixserve.entrypoints.tokenizer_manager import TokenizerManager


def add_openai_routes(
    app: FastAPI, tm: TokenizerManager, chat: ChatServing, completions: CompletionServing
) -> None:
    name = chat.model_name

    async def refusing_rooms(call: Awaitable[Any], body: Any) -> Any:
        """A refused call tells the other side of its rooms (PD routers) at once."""
        try:
            return await call
        except Exception as e:
            tm.refuse_rooms(refused_rooms(body), str(e), is_client_error(e))
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await refusing_rooms(chat.create(body, raw), body)

    @app.post("/v1/completions")
    async def text_completions(body: CompletionRequest, raw: Request) -> Any:
        return await refusing_rooms(completions.create(body, raw), body)

    @app.get("/v1/models")
    async def models() -> Any:
        card = ModelCard(id=name, root=name, max_model_len=tm.info.max_context)
        return json_response(ModelList(data=[card]))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Any:
        # the served name and its aliases; SGLang and OpenAI answer 404 for any other id
        if model not in chat.accepted:
            body = error_body(404, f"The model '{model}' does not exist", "model")
            body["error"].update(type="invalid_request_error", code="model_not_found")
            return json_response(body, 404)
        return json_response(ModelCard(id=model, root=name, max_model_len=tm.info.max_context))
