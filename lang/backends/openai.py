"""OpenAI: programs against any OpenAI-compatible server (``/v1/chat/completions`` or
``/v1/completions``).

Chat models (the default) get the program's role blocks as messages and can generate or select
only at the start of an assistant turn. Completion models get the program's text rendered with
the client-side chat template.

select() needs logprobs. A completion model scores each ``prefix + choice`` from the prompt
logprobs the server echoes (``echo=True, logprobs=0, max_tokens=0``). A chat model can only
rank the first token of each choice (``top_logprobs`` of a one-token reply), so its choices
must start with different tokens. A server that returns no logprobs gets a clear error.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

from radixserve.lang.backends.base import Backend, BackendError, ProgramView
from radixserve.lang.chat_template import get_chat_template, template_for_model
from radixserve.lang.choices import ChoicesDecision, ChoicesMethod, mean_logprob
from radixserve.lang.sampling import SamplingOptions

_TOP_LOGPROBS = 20  # the most OpenAI's chat API returns per position
_EXTRA_FIELDS = {
    "top_k": "top_k",
    "min_p": "min_p",
    "min_new_tokens": "min_tokens",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
}


class OpenAI(Backend):
    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        is_chat_model: bool = True,
        chat_template: str | None = None,
        **client_kwargs: Any,
    ) -> None:
        import openai

        self._errors = openai
        key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "EMPTY")
        self.client = openai.OpenAI(base_url=base_url, api_key=key, **client_kwargs)
        self.model_name = model_name
        self.is_chat_model = is_chat_model
        self.chat_template = (
            get_chat_template(chat_template) if chat_template else template_for_model(model_name)
        )

    def get_model_name(self) -> str:
        return self.model_name

    def generate(self, view: ProgramView, options: SamplingOptions) -> tuple[str, dict[str, Any]]:
        kwargs = self._kwargs(options)
        if self.is_chat_model:
            messages = _assistant_turn(view, "generate")
            r = self._call(self.client.chat.completions.create, messages=messages, **kwargs)
            return r.choices[0].message.content or "", _meta(r)
        r = self._call(self.client.completions.create, prompt=view.text, **kwargs)
        return r.choices[0].text, _meta(r)

    def generate_stream(
        self, view: ProgramView, options: SamplingOptions
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        kwargs = {**self._kwargs(options), "stream": True}
        if self.is_chat_model:
            messages = _assistant_turn(view, "generate")
            stream = self._call(self.client.chat.completions.create, messages=messages, **kwargs)
        else:
            stream = self._call(self.client.completions.create, prompt=view.text, **kwargs)
        for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            piece = (c.delta.content or "") if self.is_chat_model else c.text
            yield piece, {"id": chunk.id, "finish_reason": c.finish_reason}

    def select(
        self, view: ProgramView, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        if method.requires_unconditional_logprobs:
            raise BackendError(
                f"select(choices_method={method.name}) needs token ids with logprobs, which the "
                "OpenAI API does not return; use RuntimeEndpoint or EngineBackend"
            )
        if self.is_chat_model:
            return self._select_first_token(view, choices)
        entries = self._echo_logprobs(view.text, choices)
        return method(
            choices=choices,
            normalized_prompt_logprobs=[mean_logprob(row) for row in entries],
            input_token_logprobs=entries,
            output_token_logprobs=[[] for _ in choices],
        )

    # -- select ----------------------------------------------------------------------------------

    def _echo_logprobs(self, prefix: str, choices: list[str]) -> list[list[list[Any]]]:
        r = self._call(
            self.client.completions.create,
            model=self.model_name,
            prompt=[prefix + c for c in choices],
            max_tokens=0,
            echo=True,
            logprobs=0,
            temperature=0,
            what="select() needs prompt logprobs (echo=True with logprobs)",
        )
        rows: list[list[list[Any]]] = [[] for _ in choices]
        for c in r.choices:
            lp = c.logprobs
            if lp is None or not lp.token_logprobs:
                raise BackendError(
                    "the server returned no prompt logprobs for echo=True; select() needs them"
                )
            # Tokens that end after the prefix: the choice's, plus one the choice re-tokenized.
            rows[c.index] = [
                [p, None, tok]
                for tok, p, off in zip(lp.tokens, lp.token_logprobs, lp.text_offset, strict=True)
                if off + len(tok) > len(prefix)
            ]
        return rows

    def _select_first_token(self, view: ProgramView, choices: list[str]) -> ChoicesDecision:
        r = self._call(
            self.client.chat.completions.create,
            model=self.model_name,
            messages=_assistant_turn(view, "select"),
            max_tokens=1,
            temperature=0,
            logprobs=True,
            top_logprobs=_TOP_LOGPROBS,
            what="select() on a chat model needs logprobs",
        )
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        if not content or not content[0].top_logprobs:
            raise BackendError(
                f"{self.model_name} returned no logprobs; select() on a chat model needs "
                "logprobs=True with top_logprobs"
            )
        top = content[0].top_logprobs
        scores = [
            max((t.logprob for t in top if t.token and c.startswith(t.token)), default=-math.inf)
            for c in choices
        ]
        best = max(scores)
        if best == -math.inf:
            raise BackendError(
                f"none of the choices {choices} starts with one of the model's {len(top)} most "
                "likely first tokens; a chat model can only rank choices by their first token"
            )
        tied = [c for c, s in zip(choices, scores, strict=True) if s == best]
        if len(tied) > 1:
            raise BackendError(
                f"choices {tied} start with the same token; a chat model can only rank choices "
                "by their first token, so give them different first words"
            )
        return ChoicesDecision(tied[0], {"first_token_logprobs": scores})

    # -- plumbing --------------------------------------------------------------------------------

    def _kwargs(self, options: SamplingOptions) -> dict[str, Any]:
        opts = options.resolved()
        if opts.regex is not None:
            raise BackendError(
                "the OpenAI backend cannot constrain output with a regex (gen(regex=...), "
                "gen_int, gen_string); use RuntimeEndpoint or EngineBackend"
            )
        kwargs: dict[str, Any] = {"model": self.model_name}
        for ours, theirs in (
            ("max_new_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("frequency_penalty", "frequency_penalty"),
            ("presence_penalty", "presence_penalty"),
        ):
            if (value := getattr(opts, ours)) is not None:
                kwargs[theirs] = value
        if opts.stop is not None:
            kwargs["stop"] = opts.stop_list()
        extra = {theirs: v for ours, theirs in _EXTRA_FIELDS.items() if (v := getattr(opts, ours))}
        if extra:
            kwargs["extra_body"] = extra
        if opts.json_schema is not None:
            if not self.is_chat_model:
                raise BackendError("json_schema on the OpenAI backend needs a chat model")
            schema = {"name": "output", "schema": json.loads(opts.json_schema)}
            kwargs["response_format"] = {"type": "json_schema", "json_schema": schema}
        return kwargs

    def _call(self, create: Any, what: str = "the request failed", **kwargs: Any) -> Any:
        kwargs.setdefault("model", self.model_name)
        try:
            return create(**kwargs)
        except self._errors.APIConnectionError as e:
            raise BackendError(f"cannot reach {self.client.base_url}: {e}") from e
        except self._errors.APIStatusError as e:
            raise BackendError(f"{what}; the server answered {e.status_code}: {e.message}") from e


def _assistant_turn(view: ProgramView, action: str) -> list[dict[str, Any]]:
    if view.images:
        raise BackendError(
            "image() needs RuntimeEndpoint or EngineBackend (native image_data); the OpenAI "
            "backend sends text only"
        )
    if view.role != "assistant" or view.role_text.strip():
        raise BackendError(
            f"a chat model can only {action} at the start of an assistant turn (right after "
            "assistant_begin()); use OpenAI(..., is_chat_model=False) for completion-style programs"
        )
    return list(view.messages)


def _meta(r: Any) -> dict[str, Any]:
    usage = getattr(r, "usage", None)
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "id": r.id,
        "finish_reason": r.choices[0].finish_reason,
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "completion_tokens": getattr(usage, "completion_tokens", None),
        "cached_tokens": getattr(details, "cached_tokens", 0) if details else 0,
    }
