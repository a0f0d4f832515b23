"""The agent-client routes: the Anthropic Messages API (/v1/messages) and the OpenAI Responses
API (/v1/responses), both served through the chat route's machinery."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from radixserve.entrypoints.anthropic_protocol import CountTokensRequest, MessagesRequest
from radixserve.entrypoints.responses_protocol import ResponsesRequest
from radixserve.entrypoints.serving_chat import ChatServing
from radixserve.entrypoints.serving_messages import MessagesServing
from radixserve.entrypoints.serving_responses import ResponsesServing


def add_agent_routes(app: FastAPI, chat: ChatServing) -> None:
    messages = MessagesServing(chat)
    responses = ResponsesServing(chat)

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, raw: Request) -> Any:
        return await messages.create(body, raw)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> Any:
        return await messages.count_tokens(body)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Any:
        return await responses.create(body, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Any:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Any:
        return responses.delete(response_id)
