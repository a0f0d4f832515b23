"""What the OpenAI routes share: model names, request -> SamplingParams, fan-out of n choices,
usage objects and turning failed requests into errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel

from radixserve.core.disaggregation import Bootstrap
from radixserve.core.request import GRAMMAR_FIELDS, InvalidRequest, SamplingParams
from radixserve.entrypoints.bootstrap import expand_bootstrap
from radixserve.entrypoints.fanout import choice_params
from radixserve.entrypoints.http_errors import ApiError, error_body
from radixserve.entrypoints.openai_protocol import (
    PromptTokensDetails,
    SamplingRequest,
    StreamOptions,
    UsageInfo,
)
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.session_fields import route_extras
from radixserve.entrypoints.streaming import SSE_DONE, Update, follow, sse, usage_counts
from radixserve.entrypoints.tokenizer_manager import TokenizerManager


class OpenAIServing:
    def __init__(
        self,
        tm: TokenizerManager,
        model_name: str,
        aliases: Sequence[str] = (),
        strict_model_name: bool = False,
    ) -> None:
        self.tm = tm
        self.model_name = model_name
        # SGLang clients often send "default"; the model's path names it too.
        self.accepted = {model_name, "default", *aliases}
        self.strict = strict_model_name

    def check_model(self, model: str | None) -> str:
        """The served model's name, which every response reports. Any requested name is
        accepted by default, as SGLang does (its bench client sends the tokenizer path);
        ``--strict-model-name`` answers 404 for names this server does not know."""
        if model is None or model in self.accepted:
            return self.model_name
        if not model.isprintable():  # NUL, control characters, lone surrogates: never a name
            raise ApiError(400, f"the model name {model!r:.100} is not printable", param="model")
        if self.adapter_of(model) is not None:
            return self.model_name
        if self.strict:
            raise ApiError(
                404,
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        _, _, adapter = model.partition(":")
        if adapter.strip() and self.tm.lora_adapters is None:  # SGLang: "base:adapter" is LoRA
            raise ApiError(
                400,
                f"the model '{model}' names the LoRA adapter '{adapter.strip()}', but this "
                f"server serves no adapters; use '{self.model_name}'",
                param="model",
            )
        return self.model_name

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names as "base:adapter" (SGLang's form) where LoRA is on;
        an adapter that is not loaded is a 400 naming it."""
        if model is None or self.tm.lora_adapters is None:
            return None
        base, sep, adapter = model.partition(":")
        if not sep or not adapter.strip():
            return None
        if self.strict and base not in self.accepted:
            raise ApiError(
                404, f"the model '{base}' does not exist; this server serves "
                f"'{self.model_name}'", param="model", code="model_not_found",
            )  # fmt: skip
        try:
            self.tm.check_lora(adapter.strip())
        except InvalidRequest as e:
            raise ApiError(400, str(e), param="model") from None
        return adapter.strip()

    def sampling(
        self,
        body: SamplingRequest,
        prompt_lens: Sequence[int],
        max_tokens: int | None,
        max_field: str,
        logprobs: bool,
        top_logprobs: int,
        grammar: dict[str, Any] | None = None,
    ) -> tuple[SamplingParams, str | None]:
        """The request's SamplingParams, and the name of its output budget field when the
        client set it (then prompt + budget must fit the context)."""
        explicit = max_tokens is not None
        if max_tokens is None:
            max_tokens = min(self.tm.default_max_tokens(n) for n in prompt_lens)
        values: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty,
            "min_new_tokens": body.min_tokens,
            "stop": body.stop or None,
            "stop_token_ids": body.stop_token_ids,
            "stop_regex": body.stop_regex or None,
            "logit_bias": body.logit_bias,
            "ignore_eos": body.ignore_eos,
            "skip_special_tokens": body.skip_special_tokens,
            "no_stop_trim": body.no_stop_trim,
            "seed": None if body.seed is None else body.seed % (1 << 64),
            "logprobs": logprobs,
            "top_logprobs_num": top_logprobs,
            "json_schema": body.json_schema,
            "regex": body.regex,
            "ebnf": body.ebnf,
        }
        if grammar:  # response_format / a forced tool call: one constraint, not two
            given = [k for k in GRAMMAR_FIELDS if values.get(k) is not None]
            if given:
                raise ApiError(
                    400,
                    f"give either {given[0]} or response_format / a forced tool_choice, not both",
                    param=given[0],
                )
            values.update(grammar)
        return SamplingParams.from_dict(values), (max_field if explicit else None)

    @staticmethod
    def output_budget(body: SamplingRequest) -> tuple[int | None, str]:
        """The output token budget the client set and the field it used: OpenAI's
        max_completion_tokens wins over the older max_tokens, as in SGLang."""
        if body.max_completion_tokens is not None:
            return body.max_completion_tokens, "max_completion_tokens"
        return body.max_tokens, "max_tokens"

    def submit_all(
        self,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        n: int,
        max_field: str | None,
        logprob_start_len: int = -1,
        body: SamplingRequest | None = None,
    ) -> list[ServerReq]:
        """Check every prompt, then queue n choices of each (prompt-major order). ``body``
        brings a PD router's bootstrap fields."""
        self.tm.limits.check_n(n)
        for ids in prompts:
            self.tm.check(ids, params, max_field)
        self.tm.admit(len(prompts) * n)
        boots: list[Bootstrap | None] = [None] * (len(prompts) * n)
        route = None
        if body is not None:
            route = route_extras(body.priority, body.session_params, False, body.custom_labels)
            boots = expand_bootstrap(
                body.bootstrap_host, body.bootstrap_port, body.bootstrap_room, [n] * len(prompts)
            )
        lora = self.adapter_of(body.model) if body is not None else None
        event = asyncio.Event()
        reqs: list[ServerReq] = []
        try:
            for ids in prompts:
                for i in range(n):
                    params_i = choice_params(params, i)
                    boot = boots[len(reqs)]
                    reqs.append(
                        self.tm.submit(
                            ids,
                            params_i,
                            event,
                            None,
                            logprob_start_len,
                            bootstrap=boot,
                            lora_name=lora,
                            route=route,
                        )  # fmt: skip
                    )
        except Exception:
            for r in reqs:
                self.tm.abort(r.rid)
            raise
        return reqs

    async def wait(
        self, reqs: list[ServerReq], is_disconnected: Callable[[], Awaitable[bool]]
    ) -> None:
        await self.tm.wait_finished(reqs, is_disconnected)
        raise_if_failed(reqs)

    async def stream_chunks(
        self,
        reqs: list[ServerReq],
        n: int,
        options: StreamOptions | None,
        make_choice: Callable[[Update], BaseModel | None],
        make_chunk: Callable[[list[Any], UsageInfo | None], BaseModel],
    ) -> AsyncIterator[bytes]:
        """The SSE events of a stream: one chunk per step with a choice per updated request
        (``make_choice`` may skip one), errors as error events, the usage chunk (with
        ``include_usage``; with ``continuous_usage_stats`` every chunk carries the usage so
        far), [DONE]."""
        continuous = options is not None and options.continuous_usage_stats
        async for updates in follow(self.tm, reqs):
            choices = []
            for u in updates:
                if u.req.failed:
                    yield sse(error_event(u.req))
                elif (choice := make_choice(u)) is not None:
                    choices.append(choice)
            if choices:
                yield sse(make_chunk(choices, self.usage(reqs, n) if continuous else None))
        if options is not None and options.include_usage:
            yield sse(make_chunk([], self.usage(reqs, n)))
        yield SSE_DONE

    def usage(self, reqs: Sequence[ServerReq], n: int) -> UsageInfo:
        prompt, completion, cached = usage_counts(reqs, n)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def token_text(self, token_id: int) -> str:
        return self.tm.token_text(token_id)


def raise_if_failed(reqs: Sequence[ServerReq]) -> None:
    for r in reqs:
        if r.failed and r.finish is not None:
            raise ApiError(r.error_status, r.finish.message or "the request failed")


def error_event(req: ServerReq) -> dict[str, Any]:
    message = req.finish.message if req.finish is not None else None
    return error_body(req.error_status, message or "the request failed")
