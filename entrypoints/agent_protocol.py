"""What the agent-API translations share (/v1/messages and /v1/responses): SGLang's request
extensions they take as the chat route does, and the checked chat request they amount to."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest


class ChatExtensions(BaseModel):
    """SGLang's extensions of a chat request, passed on as they are (the chat request checks
    them): constrained decoding, seeds and penalties, template arguments, the reasoning split."""

    seed: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    ignore_eos: Any = None
    skip_special_tokens: Any = None
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None
    chat_template_kwargs: Any = None
    separate_reasoning: Any = None
    stream_reasoning: Any = None

    def extensions(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ChatExtensions.model_fields}


def chat_body(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request of ``fields`` (None values left out); a value the chat route does not
    take is a 400 naming the field, not a server error."""
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(400, f"{field}: {first.get('msg')}", param=field or None) from None
