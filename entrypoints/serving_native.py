"""POST /generate: SGLang's native API (the wire contract is PROTOCOL.md).

One input gives one object, a batch (a list input, or n > 1) a list in input order (input-major,
then choice). ``stream`` sends cumulative ``text`` per event and ends with ``data: [DONE]``;
with ``--incremental-streaming-output`` each event holds only what is new (SGLang's flag).
Either way ``output_token_logprobs_length`` counts all output logprobs so far, so a client can
tell a cumulative list from a delta (SGLang's frontend reads it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from radixserve.core.disaggregation import Bootstrap
from radixserve.core.request import INT64_MAX, InvalidRequest, SamplingParams
from radixserve.entrypoints.bootstrap import expand_bootstrap, refused_rooms
from radixserve.entrypoints.fanout import choice_params
from radixserve.entrypoints.fanout import per_item as _per_item
from radixserve.entrypoints.http_errors import is_client_error
from radixserve.entrypoints.output import (
    input_logprob_entries,
    logprob_triples,
    top_logprob_triples,
)
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.serving_openai import error_event, raise_if_failed
from radixserve.entrypoints.session_fields import RouteExtras, route_extras
from radixserve.entrypoints.spec_meta import spec_meta_info
from radixserve.entrypoints.streaming import SSE_DONE, follow, json_response, sse
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

# Keys whose "" SGLang clients send for "unset" (the constraints, and stop_regex).
_GRAMMAR_KEYS = ("regex", "json_schema", "ebnf", "stop_regex", "structural_tag")
_IGNORED_KEYS = ("spaces_between_special_tokens", "custom_params")
_LIST_KEYS = ("stop", "stop_token_ids")


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    return_logprob: bool = False
    top_n: int = 0
    with_text: bool = False
    start_len: int | None = None  # None: SGLang's default (whole prompt when prefill-only)


class NativeServing:
    def __init__(self, tm: TokenizerManager, incremental: bool = False) -> None:
        self.tm = tm
        self.incremental = incremental

    async def generate(self, body: Any, raw: Request) -> Any:
        if not isinstance(body, dict):
            raise InvalidRequest("the request body must be a JSON object")
        try:
            stream, batch, reqs, req_options = await self._start(body)
        except Exception as e:
            # the PD router's other server waits for (or computes) these rooms: tell it now
            self.tm.refuse_rooms(refused_rooms(body), str(e), is_client_error(e))
            raise
        if stream:
            stream = self._stream(reqs, req_options, batch)
            return StreamingResponse(stream, media_type="text/event-stream")
        await self.tm.wait_finished(reqs, raw.is_disconnected)
        raise_if_failed(reqs)
        results = [self.result(r, o) for r, o in zip(reqs, req_options, strict=True)]
        return json_response(results if batch else results[0])

    async def _start(
        self, body: dict[str, Any]
    ) -> tuple[bool, bool, list[ServerReq], list[LogprobOptions]]:
        """Check the call and queue its requests: (stream, batch, requests, their options)."""
        stream = _flag(body.get("stream"), "stream")
        prompts, batch = await self._prompts(body)
        prompts = await self._with_images(prompts, batch, body.get("image_data"))
        count = len(prompts)
        raw_params = _per_item(body.get("sampling_params"), count, "sampling_params")
        options = [
            LogprobOptions(
                _flag(lp, "return_logprob"),
                _count(top, "top_logprobs_num"),
                _flag(txt, "return_text_in_logprobs"),
                _start(start),
            )
            for lp, top, txt, start in zip(
                _per_item(body.get("return_logprob"), count, "return_logprob"),
                _per_item(body.get("top_logprobs_num"), count, "top_logprobs_num"),
                _per_item(body.get("return_text_in_logprobs"), count, "return_text_in_logprobs"),
                _per_item(body.get("logprob_start_len"), count, "logprob_start_len"),
                strict=True,
            )
        ]
        params = [_sampling(p, o) for p, o in zip(raw_params, options, strict=True)]
        for ids, p, raw_p in zip(prompts, params, raw_params, strict=True):
            explicit = isinstance(raw_p, dict) and raw_p.get("max_new_tokens") is not None
            self.tm.check(ids, p, "max_new_tokens" if explicit else None)
        loras = _per_item(body.get("lora_path"), count, "lora_path")
        for name in loras:
            if name is not None and not isinstance(name, str):
                raise InvalidRequest("lora_path must be an adapter name or a list of them")
            self.tm.check_lora(name)
        rids = _rids(body.get("rid"), count)
        route = route_extras(
            body.get("priority"), body.get("session_params"), True, body.get("custom_labels")
        )
        boots = expand_bootstrap(
            body.get("bootstrap_host"),
            body.get("bootstrap_port"),
            body.get("bootstrap_room"),
            [p.n for p in params],
        )
        reqs, req_options = self._submit(prompts, params, options, rids, boots, loras, route)
        return stream, batch or len(reqs) > 1, reqs, req_options

    async def _with_images(
        self, prompts: list[list[int]], batch: bool, image_data: Any
    ) -> list[list[int]]:
        """The prompts with their ``image_data`` (SGLang's field: one image or a list for one
        prompt; one entry per prompt for a batch) expanded (docs/vision.md)."""
        if image_data is None:
            return prompts
        per_prompt = image_data if batch else [image_data]
        if not isinstance(per_prompt, list) or len(per_prompt) != len(prompts):
            raise InvalidRequest("image_data must have one entry (an image or a list) per prompt")
        return [
            await self.tm.images.prompt(ids, refs)
            for ids, refs in zip(prompts, per_prompt, strict=True)
        ]

    async def _prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool]:
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise InvalidRequest("send exactly one of 'text' or 'input_ids'")
        items = text if text is not None else input_ids
        if isinstance(items, list) and items and not _is_int(items[0]):
            self.tm.limits.check_batch(len(items))  # before tokenizing thousands of prompts
        if text is not None:
            if isinstance(text, str):
                return await self.tm.encode_async([text]), False
            if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                return await self.tm.encode_async(text), True
            raise InvalidRequest("text must be a string or a non-empty list of strings")
        if isinstance(input_ids, list) and _token_ids(input_ids):
            return [list(input_ids)], False
        if (
            isinstance(input_ids, list)
            and input_ids
            and all(isinstance(ids, list) and _token_ids(ids) for ids in input_ids)
        ):
            return [list(ids) for ids in input_ids], True
        raise InvalidRequest(
            "input_ids must be a non-empty list of token ids or a list of such lists"
        )

    def _submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        options: list[LogprobOptions],
        rids: list[str | None],
        boots: list[Bootstrap | None],
        loras: list[str | None],
        route: RouteExtras,
    ) -> tuple[list[ServerReq], list[LogprobOptions]]:
        self.tm.admit(sum(p.n for p in params))
        event = asyncio.Event()
        reqs: list[ServerReq] = []
        req_options: list[LogprobOptions] = []
        try:
            for ids, p, o, rid, lora in zip(prompts, params, options, rids, loras, strict=True):
                for i in range(p.n):
                    choice_rid = rid if rid is None or p.n == 1 else f"{rid}-{i}"
                    start = _resolved_start(o, p)
                    boot = boots[len(reqs)]
                    reqs.append(
                        self.tm.submit(
                            ids,
                            choice_params(p, i),
                            event,
                            choice_rid,
                            start,
                            bootstrap=boot,
                            lora_name=lora,
                            route=route,
                        )  # fmt: skip
                    )
                    req_options.append(o)
        except Exception:
            for r in reqs:
                self.tm.abort(r.rid)
            raise
        return reqs, req_options

    async def _stream(
        self, reqs: list[ServerReq], options: list[LogprobOptions], batch: bool
    ) -> AsyncIterator[bytes]:
        sent = [_Sent() for _ in reqs]  # what each request's earlier events carried
        async for updates in follow(self.tm, reqs):
            for u in updates:
                if u.req.failed:
                    yield sse(error_event(u.req))
                    continue
                out = self.result(u.req, options[u.index])
                if self.incremental:
                    sent[u.index].cut(out)
                if batch:
                    out["index"] = u.index
                yield sse(out)
        yield SSE_DONE

    def result(self, r: ServerReq, opts: LogprobOptions) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish.to_json() if r.finish is not None else None,
            "prompt_tokens": len(r.prompt_ids) + r.context_tokens,
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
        }
        if r.finished:
            meta["e2e_latency"] = r.e2e_latency
        k = self.tm.spec_num_draft_tokens
        if k is not None:
            meta.update(spec_meta_info(r.spec_verify_ct, r.spec_accepted_tokens, k))
        if opts.return_logprob or opts.top_n:
            decode = self.tm.token_text if opts.with_text else None
            n = min(len(r.logprobs), len(r.output_ids))
            meta["output_token_logprobs"] = logprob_triples(
                r.logprobs[:n], r.output_ids[:n], decode
            )
            meta["output_token_logprobs_length"] = n
            entries: list[Any] = []
            tops: list[Any] | None = []
            if r.logprob_start_len >= 0 and r.finished:
                entries, tops = input_logprob_entries(
                    r.prompt_ids,
                    r.logprob_start_len,
                    r.input_logprobs,
                    r.input_top_logprobs,
                    decode,
                )
            meta["input_token_logprobs"] = entries
            if opts.top_n:
                meta["input_top_logprobs"] = tops or []
                meta["output_top_logprobs"] = top_logprob_triples(r.top_logprobs, decode)
        return {"text": r.visible_text(), "output_ids": list(r.output_ids), "meta_info": meta}


# Output-side lists that an incremental stream sends as deltas (SGLang's set).
_DELTA_KEYS = ("output_token_logprobs", "output_top_logprobs")


@dataclass(slots=True)
class _Sent:
    """How much of one request's text, ids and output logprobs earlier events carried."""

    text: int = 0
    ids: int = 0
    logprobs: int = 0

    def cut(self, out: dict[str, Any]) -> None:
        """Turn a cumulative event into a delta, in place (input logprobs stay whole, as in
        SGLang: they arrive once, with the last event)."""
        text, ids, meta = out["text"], out["output_ids"], out["meta_info"]
        out["text"], out["output_ids"] = text[self.text :], ids[self.ids :]
        self.text, self.ids = len(text), len(ids)
        if "output_token_logprobs_length" in meta:
            for key in _DELTA_KEYS:
                if key in meta:
                    meta[key] = meta[key][self.logprobs :]
            self.logprobs = meta["output_token_logprobs_length"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any]) -> bool:
    """A non-empty list of ints (no bools), checked at C speed: a server receiving 256
    prompts of 1,024 ids at once spent ~1 ms a prompt calling _is_int on each (H200 profile)."""
    return set(map(type, values)) == {int}  # a JSON body's ints are exactly int


def _flag(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r:.200}")
    return value


def _count(value: Any, name: str) -> int:
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value <= INT64_MAX:
        raise InvalidRequest(f"{name} must be a non-negative integer, got {value!r:.200}")
    return int(value)


def _start(value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or not -1 <= value <= INT64_MAX:
        raise InvalidRequest(f"logprob_start_len must be an integer >= -1, got {value!r:.200}")
    return int(value)


def _resolved_start(opts: LogprobOptions, params: SamplingParams) -> int:
    """SGLang: without a start, a prefill-only request scores its whole prompt."""
    if not (opts.return_logprob or opts.top_n):
        return -1
    if opts.start_len is None:
        return 0 if params.max_new_tokens == 0 else -1
    return opts.start_len


def _rids(value: Any, count: int) -> list[str | None]:
    rids = _per_item(value, count, "rid") if value is not None else [None] * count
    if any(r is not None and not isinstance(r, str) for r in rids):
        raise InvalidRequest(f"rid must be a string or a list of strings, got {value!r:.200}")
    if count > 1 and value is not None and len(set(rids)) != count:
        raise InvalidRequest("rid must give a distinct id per input of the batch")
    return rids


def _sampling(raw: Any, opts: LogprobOptions) -> SamplingParams:
    if raw is not None and not isinstance(raw, dict):
        raise InvalidRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    values: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        if value == [] and key not in _LIST_KEYS:
            value = None  # SGLang clients send [] for unset fields
        if key in _GRAMMAR_KEYS and value == "":
            value = None  # SGLang clients send "" for an unset constraint
        if key not in _IGNORED_KEYS:
            values[key] = value
    if opts.return_logprob or opts.top_n:
        values["logprobs"] = True
        given = values.get("top_logprobs_num")
        values["top_logprobs_num"] = max(opts.top_n, _count(given, "top_logprobs_num"))
    return SamplingParams.from_dict(values)
