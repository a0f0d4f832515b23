"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from radixserve.entrypoints.fill_in_middle import fim_prompt, find_fim_tokens
from radixserve.entrypoints.http_errors import ApiError
from radixserve.entrypoints.openai_protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from radixserve.entrypoints.structured_output import response_format_schema


class CompletionServing(OpenAIServing):
    async def create(self, body: CompletionRequest, raw: Request) -> Any:
        model = self.check_model(body.model)
        _check_unsupported(body)
        if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
            self.tm.limits.check_batch(len(body.prompt) * body.n)  # before tokenizing them all
        prompts = await self._prompts(body.prompt, body.suffix)
        top_n = body.logprobs or 0
        max_tokens, field = self.output_budget(body)
        schema = response_format_schema(body.response_format)
        params, max_field = self.sampling(
            body,
            [len(p) for p in prompts],
            max_tokens,
            field,
            body.logprobs is not None,
            top_n,
            None if schema is None else {"json_schema": schema},
        )
        # echo + logprobs (how scoring clients such as lm-eval read a text's likelihood): the
        # echoed prompt tokens carry their logprobs too, so score the prompt from position 0.
        score_prompt = body.echo and body.logprobs is not None
        start = 0 if score_prompt else -1
        reqs = self.submit_all(prompts, params, body.n, max_field, start, body=body)
        echoes = self._echoes(body, reqs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            stream = self._stream(body, reqs, echoes, rid, model)
            return StreamingResponse(stream, media_type="text/event-stream")
        await self.wait(reqs, raw.is_disconnected)
        choices = [
            CompletionChoice(
                index=i,
                text=echoes[i] + r.text,
                logprobs=self._choice_logprobs(r, echoes[i], top_n, score_prompt)
                if body.logprobs is not None
                else None,
                finish_reason=finish_reason(r),
                matched_stop=matched_stop(r),
            )
            for i, r in enumerate(reqs)
        ]
        usage = self.usage(reqs, body.n)
        return json_response(CompletionResponse(id=rid, model=model, choices=choices, usage=usage))

    async def _prompts(self, prompt: Any, suffix: str | None) -> list[list[int]]:
        if suffix:  # SGLang too leaves an empty suffix out
            return await self.tm.encode_async(self._fim_prompts(prompt, suffix))
        if isinstance(prompt, str):
            return await self.tm.encode_async([prompt])
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return await self.tm.encode_async(prompt)
        return [list(p) for p in prompt]

    def _fim_prompts(self, prompt: Any, suffix: str) -> list[str]:
        tokens = find_fim_tokens(self.tm.tokenizer.token_to_id)
        if tokens is None:
            raise ApiError(
                400,
                "this model has no fill-in-the-middle tokens, so suffix cannot be served; omit it",
                param="suffix",
            )
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "suffix needs a text prompt (not token ids)", param="suffix")
        # sized before they are built: the suffix is copied into each
        self.tm.check_batch_text_size([len(text) + len(suffix) for text in texts])
        return [fim_prompt(tokens, text, suffix) for text in texts]

    def _echoes(self, body: CompletionRequest, reqs: list[ServerReq]) -> list[str]:
        """Each choice's echo: its prompt as sent (SGLang's), a token-id prompt as its text
        with special tokens (the text of its logprob tokens)."""
        if not body.echo:
            return [""] * len(reqs)
        sent = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        out = []
        for i, req in enumerate(reqs):
            prompt = sent[i // body.n]  # choices are prompt-major; an id list holds >= 1 id
            if not isinstance(prompt, str):
                prompt = self.tm.tokenizer.decode(req.prompt_ids, skip_special_tokens=False)
            out.append(prompt)
        return out

    async def _stream(
        self,
        body: CompletionRequest,
        reqs: list[ServerReq],
        echoes: list[str],
        rid: str,
        model: str,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        offsets = [len(e) for e in echoes]

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None) -> BaseModel:
            return CompletionChunk(
                id=rid, created=created, model=model, choices=choices, usage=usage
            )

        def choice(u: Update) -> CompletionChoice | None:
            logprobs = None
            if body.logprobs is not None and u.token_end > u.token_start:
                start, end, offset = u.token_start, u.token_end, offsets[u.index]
                logprobs = self._logprobs(u.req, start, end, offset, body.logprobs)
                offsets[u.index] += sum(len(t) for t in logprobs.tokens)
            if not (u.text or logprobs is not None or u.finished):
                return None
            return CompletionChoice(
                index=u.index,
                text=u.text,
                logprobs=logprobs,
                finish_reason=finish_reason(u.req) if u.finished else None,
                matched_stop=matched_stop(u.req) if u.finished else None,
            )

        for i, echo in enumerate(echoes):
            if echo:
                yield sse(chunk([CompletionChoice(index=i, text=echo)], None))
        async for event in self.stream_chunks(reqs, body.n, body.stream_options, choice, chunk):
            yield event

    def _choice_logprobs(
        self, req: ServerReq, echo: str, top_n: int, with_prompt: bool
    ) -> CompletionLogprobs:
        outputs = self._logprobs(req, 0, len(req.output_ids), len(echo), top_n)
        if not with_prompt:
            return outputs
        prompt = self._prompt_logprobs(req, top_n)
        return CompletionLogprobs(
            tokens=prompt.tokens + outputs.tokens,
            token_logprobs=prompt.token_logprobs + outputs.token_logprobs,
            top_logprobs=prompt.top_logprobs + outputs.top_logprobs,
            text_offset=prompt.text_offset + outputs.text_offset,
        )

    def _prompt_logprobs(self, req: ServerReq, top_n: int) -> CompletionLogprobs:
        """The echoed prompt's tokens; the first has no logprob (nothing predicts it)."""
        out = CompletionLogprobs()
        offset = 0
        scored: list[float | None] = [None, *req.input_logprobs]
        tops: list[list[tuple[float, int]] | None] = [None, *req.input_top_logprobs]
        for pos, token_id in enumerate(req.prompt_ids):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(scored[pos] if pos < len(scored) else None)
            out.text_offset.append(offset)
            offset += len(text)
            top = tops[pos] if pos < len(tops) else None
            if top_n and top is not None:
                out.top_logprobs.append({self.token_text(tid): lp for lp, tid in top})
            else:
                out.top_logprobs.append(None)
        return out

    def _logprobs(
        self, req: ServerReq, start: int, end: int, offset: int, top_n: int
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for pos in range(start, min(end, len(req.logprobs))):
            text = self.token_text(req.output_ids[pos])
            out.tokens.append(text)
            out.token_logprobs.append(req.logprobs[pos])
            out.text_offset.append(offset)
            offset += len(text)
            if top_n:
                tops = req.top_logprobs[pos] if pos < len(req.top_logprobs) else []
                out.top_logprobs.append({self.token_text(tid): lp for lp, tid in tops})
            else:
                out.top_logprobs.append(None)
        return out


def _check_unsupported(body: CompletionRequest) -> None:
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of must equal n (or be omitted)", param="best_of")
    if body.echo and body.logprobs is not None and body.stream:
        raise ApiError(
            400,
            "echo with logprobs is only supported without streaming; send stream=false",
            param="echo",
        )
