"""Pydantic models of the OpenAI API subset radixserve serves (requests and responses).

Unknown request fields are ignored, as most OpenAI-compatible servers do. Besides OpenAI's own
sampling fields, requests accept SGLang/vLLM extensions (top_k, min_p, ignore_eos, ...).
Request models validate strictly: a boolean must be true or false and an integer an integer
(no "yes", no 1.0, no true for 1), so a wrong type is a 400 here, never a surprise later.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

STRICT = ConfigDict(strict=True)
SEED_MAX = 2**64 - 1


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radixserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    # SGLang / vLLM: the running usage in every chunk, not only in the final one
    continuous_usage_stats: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


#: Fields whose null means something of its own: a completion's max_tokens null is "up to the
#: context" (vLLM), not its default of 16.
_NULL_KEEPS = frozenset({"max_tokens"})


class SamplingRequest(BaseModel):
    """Fields shared by chat and completion requests."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's spec makes these fields nullable, and clients that send every field send
        null for the unset ones (vLLM takes them): a null takes the field's default."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or fields[k].default is None or k in _NULL_KEEPS
        }

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    # int64 as OpenAI documents it (a negative one maps onto the engine's 64-bit seeds)
    seed: int | None = Field(default=None, ge=-(2**63), le=SEED_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's newer name for the output budget; it wins over max_tokens when both are set.
    max_completion_tokens: int | None = Field(default=None, ge=0)
    # token id (a decimal string) -> bias in [-100, 100]; checked against the vocabulary later
    logit_bias: dict[str, float] | None = None
    # SGLang / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool | None = None
    rid: str | None = None
    # Prefill/decode disaggregation: what a PD router (sglang-router) injects; parallel
    # arrays for n > 1 or prompt batches (entrypoints/bootstrap.py checks them).
    bootstrap_host: str | list[str | None] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # Agent traffic (core/priority.py, core/sessions.py): the request's priority, and the
    # open session that keeps this conversation's KV pinned ({"id": ...}).
    priority: int | None = None
    session_params: dict[str, Any] | None = None
    # SGLang's custom_labels: {"group": ...} keys the speculative metrics (metrics_spec.py)
    custom_labels: dict[str, Any] | None = None
    # Constrained decoding (SGLang extensions); chat also takes response_format and tools.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: str = "text"  # text | json_object | json_schema
    json_schema: dict[str, Any] | None = None  # {"name": ..., "schema": {...}, "strict": ...}


# -- completions -----------------------------------------------------------------------------


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    response_format: ResponseFormat | None = None  # as chat's (SGLang and vLLM take it here too)
    suffix: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # SGLang's: the stop string or token id that ended the choice (finish_reason 'stop')
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- chat ------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = STRICT

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # Passed to the chat template as transformers' apply_chat_template passes them (vLLM and
    # SGLang accept the same two fields).
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM / SGLang: render without the assistant turn's opening (false), or continue the
    # last (assistant) message instead of starting a new turn (a prefilled answer)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    parallel_tool_calls: bool = True  # false: at most one tool call is returned
    # SGLang: with --reasoning-parser, split reasoning_content from content, and stream it as
    # it comes (false: in one piece when the reasoning ends)
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    # SGLang's: the stop string or token id that ended the choice (finish_reason 'stop')
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    # SGLang's: the stop string or token id that ended the choice (finish_reason 'stop')
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
