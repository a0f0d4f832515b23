"""TokenizerManager: the server process's side of every request.

Tokenizes prompts and applies chat templates, validates (an ``InvalidRequest`` here becomes a
400 before the engine sees anything), assigns rids, and keeps one ``ServerReq``
(``server_req.py``) per live request, updated from the engine's per-step deltas by the
EngineClient's receive task. HTTP handlers wait on a request's ``event`` and read its state.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from radixserve.core.disaggregation import Bootstrap
from radixserve.core.multimodal import checked_ids
from radixserve.core.request import FinishReason, InvalidRequest, SamplingParams
from radixserve.core.tokenizer import Tokenizer
from radixserve.core.validation import ServingLimits, check_request
from radixserve.entrypoints import ipc
from radixserve.entrypoints.admission import Limits
from radixserve.entrypoints.engine_client import EngineClient, EngineDied
from radixserve.entrypoints.media import ServerImages
from radixserve.entrypoints.metrics import ServerMetrics
from radixserve.entrypoints.server_req import ServerReq
from radixserve.entrypoints.spec_meta import num_draft_tokens

if TYPE_CHECKING:
    from radixserve.entrypoints.session_fields import RouteExtras

logger = logging.getLogger(__name__)

# How often a non-streaming handler checks whether its client is still connected, whether or
# not tokens arrive meanwhile.
DISCONNECT_CHECK_S = 0.5
# A prompt's text is refused before it is tokenized when it is longer than this many characters
# per token of the context: no tokenizer packs that much text into every token (the longest
# tokens are runs of spaces or repeated symbols), so such a text cannot fit, and tokenizing it
# first would hold the HTTP process for seconds and leave it gigabytes larger.
MAX_CHARS_PER_TOKEN = 32
# Texts up to this many characters in all are tokenized on the event loop (well under a
# millisecond); longer ones in a worker thread, where the tokenizer releases the GIL.
INLINE_TOKENIZE_CHARS = 4096
# A weight update waits for the running requests to finish, then loads the checkpoint.
WEIGHT_UPDATE_TIMEOUT_S = 1800.0


def _text_size(value: Any) -> int:
    """The characters of every string in ``value`` (messages: nested dicts and lists)."""
    size, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return size


class ClientGone(Exception):
    """The HTTP client disconnected; its requests were aborted."""


class TokenizerManager:
    def __init__(
        self,
        client: EngineClient,
        info: ipc.EngineReady,
        tokenizer: Tokenizer,
        metrics: ServerMetrics | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.client = client
        self.limits = limits or Limits()
        self.draining = False  # set on SIGTERM: new requests get 503
        self.info = info
        # the LoRA adapters requests may name (None: LoRA is off); follows load/unload replies
        self.lora_adapters = None if info.lora_adapters is None else dict(info.lora_adapters)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.reqs: dict[str, ServerReq] = {}
        self._token_texts: dict[int, str] = {}
        self._weights_lock = asyncio.Lock()
        self.on_engine_death: Callable[[str], None] | None = None
        self.images = ServerImages(info.model_dir)  # a prompt's images (entrypoints/media.py)
        client.on_step = self._on_step
        client.on_death = self._on_death

    @property
    def dead(self) -> str | None:
        return self.client.dead

    @property
    def spec_num_draft_tokens(self) -> int | None:
        """Draft tokens per request and step; None when speculation is off."""
        return num_draft_tokens(self.info.speculative)

    # -- prompt side -----------------------------------------------------------------------

    @property
    def max_prompt_chars(self) -> int:
        """The longest text tokenized for a prompt (longer ones are refused untokenized)."""
        return self.info.max_context * MAX_CHARS_PER_TOKEN

    def check_text_size(self, size: int, what: str = "the prompt") -> None:
        """Raise InvalidRequest when ``size`` characters cannot fit in the context."""
        if size > self.max_prompt_chars:
            raise InvalidRequest(
                f"{what} has {size} characters, more than the {self.max_prompt_chars} this "
                f"model's context length of {self.info.max_context} tokens can hold "
                f"({MAX_CHARS_PER_TOKEN} characters per token); it was not tokenized"
            )

    def check_batch_text_size(self, sizes: Sequence[int]) -> None:
        """Raise InvalidRequest when one prompt of ``sizes`` characters cannot fit in the context
        or all of them together pass what one request may have tokenized; checked before the
        prompts are built where they repeat a field (a query or suffix copied into each)."""
        if not sizes:
            return
        self.check_text_size(max(sizes))
        total, limit = sum(sizes), self.limits.max_batch_chars
        if total > limit:
            raise InvalidRequest(
                f"the prompts have {total} characters together, more than the {limit} one "
                "request may have tokenized (--max-body-bytes); they were not tokenized"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if isinstance(text, str):
            self.check_text_size(len(text))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def encode_async(
        self, texts: list[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """``encode`` of each text, off the event loop unless they are short: a long prompt
        must not hold up /health or other clients while it is tokenized. Each text is checked
        against ``max_prompt_chars`` first."""
        self.check_batch_text_size([len(t) for t in texts if isinstance(t, str)])
        if sum(len(t) for t in texts if isinstance(t, str)) <= INLINE_TOKENIZE_CHARS:
            return [self.tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        return await asyncio.to_thread(self.tokenizer.encode_batch, texts, add_special_tokens)

    async def encode_chat_async(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        """The chat's prompt ids through the chat template, tokenized off the event loop (the
        template renders on it: its input is capped by then)."""
        self.check_text_size(_text_size(messages) + _text_size(extra), "the chat's text")
        text = self.tokenizer.apply_chat_template(messages, **extra)
        self.check_text_size(len(text), "the rendered chat")
        # The template already holds any BOS it wants, so no special tokens are added here.
        return (await self.encode_async([text], add_special_tokens=False))[0]

    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens included), memoized: logprob responses ask
        for the same tokens again and again."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def check(
        self,
        ids: Sequence[int],
        params: SamplingParams,
        max_field: str | None = None,
        *,
        pooling: str | None = None,
        label_token_ids: Sequence[int] | None = None,
    ) -> None:
        """Raise InvalidRequest when the prompt or params can never be served (the engine's own
        check, core/validation.py, then this server's size limits). With ``max_field`` (the
        name the client used) the output budget must fit the context."""
        mm = getattr(ids, "mm", None)  # a prompt with images: its spans hold pad ids
        prompt = ids if mm is None else checked_ids(list(ids), mm)
        check_request(
            prompt, params, self.serving_limits, pooling=pooling,
            label_token_ids=label_token_ids, max_field=max_field,
        )  # fmt: skip
        self.limits.check_params(params)

    @property
    def serving_limits(self) -> ServingLimits:
        info = self.info
        return ServingLimits(info.vocab_size, info.max_context, info.kv_size)

    def admit(self, count: int) -> None:
        """Raise Overloaded unless ``count`` more requests may be queued now."""
        self.limits.admit(len(self.reqs), count, self.draining)

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(self.info.max_context - prompt_len, 0)

    def submit(
        self,
        ids: list[int],
        params: SamplingParams,
        event: asyncio.Event,
        rid: str | None = None,
        logprob_start_len: int = -1,
        pooling: str | None = None,
        label_token_ids: list[int] | None = None,
        bootstrap: Bootstrap | None = None,
        lora_name: str | None = None,
        route: RouteExtras | None = None,
    ) -> ServerReq:
        """Queue a checked request in the engine. It counts as live (in ``reqs``, against the
        admission limit) only once the engine has it: a request that fails before that leaves
        nothing behind. ``bootstrap`` (a PD router's room) is honoured only by a prefill or
        decode server."""
        if self.dead is not None:
            raise EngineDied(self.dead)
        if rid is None:
            rid = uuid.uuid4().hex
        elif rid in self.reqs:
            raise InvalidRequest(f"rid '{rid}' is already in use by a running request")
        if bootstrap is not None:
            mode = self.info.disaggregation_mode
            if mode == "null" or params.max_new_tokens == 0:
                bootstrap = None  # the request runs whole here
            elif mode == "decode":
                logprob_start_len = -1  # prompt logprobs come from the prefill (router merges)
        message = ipc.GenerateRequest(
            rid=rid,
            input_ids=list(ids),
            mm=getattr(ids, "mm", None),
            sampling=params,
            logprob_start_len=logprob_start_len,
            pooling=pooling,
            label_token_ids=label_token_ids,
            bootstrap=bootstrap,
            lora_name=lora_name,
        )
        if route is not None:
            message.priority, message.session = route.priority, route.session
        try:
            data = ipc.encode(message)
        except ipc.EncodeError as e:
            raise InvalidRequest(f"the request cannot be passed to the engine: {e}") from None
        req = ServerReq(rid, ids, params, event)
        req.logprob_start_len = logprob_start_len
        req.custom_labels = route.labels if route is not None else None
        self.client.send_encoded(data)
        self.reqs[rid] = req
        timeout = self.limits.request_timeout
        if timeout is not None:
            req.timer = asyncio.get_running_loop().call_later(timeout, self._time_out, rid)
        return req

    def refuse_rooms(
        self, bootstraps: list[Bootstrap | None], message: str, client_error: bool = True
    ) -> None:
        """This server refused a call whose requests carry these rooms. A prefill tells the
        decode servers waiting for them (else each would wait --disaggregation-transfer-timeout),
        and whether the call was at fault (``client_error``: the decode answers 400, else 500,
        which a router retries); a decode tells the prefill servers (else each would compute the
        prompt and keep its KV for that long)."""
        if self.info.disaggregation_mode not in ("prefill", "decode") or self.dead is not None:
            return
        for b in bootstraps:
            if b is not None:
                request = ipc.CancelRoomRequest(b.room, message, b.host, b.port, client_error)
                self.client.send(request)

    def abort(self, rid: str, message: str = "aborted by the client") -> None:
        if rid in self.reqs and self.dead is None:
            self.client.send(ipc.AbortRequest(rid, message))

    def _time_out(self, rid: str) -> None:
        self.abort(rid, f"the request ran past --request-timeout={self.limits.request_timeout:g}s")
        logger.warning("request %s ran past --request-timeout; aborted it", rid)

    def abort_all(self, message: str = "aborted by the client") -> None:
        for rid in list(self.reqs):
            self.abort(rid, message)

    async def wait_finished(
        self,
        reqs: Sequence[ServerReq],
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        """Wait until every request of ``reqs`` (sharing one event) has finished; abort them
        and raise ClientGone if the client goes away meanwhile."""
        event = reqs[0].event
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_CHECK_S
        while not all(r.finished for r in reqs):
            # NOTE: the check runs on its own clock: a request whose tokens keep arriving
            # must not keep a gone client's request (and its KV) alive.
            try:
                await asyncio.wait_for(event.wait(), max(next_check - loop.time(), 0.0))
                event.clear()
            except TimeoutError:
                pass
            if is_disconnected is None or loop.time() < next_check:
                continue
            next_check = loop.time() + DISCONNECT_CHECK_S
            if await is_disconnected():
                for r in reqs:
                    if not r.finished:
                        self.abort(r.rid)
                raise ClientGone()

    async def session_call(self, make: Any) -> ipc.SessionReply:
        """Open or close a session in the engine (``make(call_id)`` builds the request)."""
        reply: ipc.SessionReply = await self.client.call(make)
        return reply

    async def flush_cache(self, storage: bool = False) -> bool:
        """Flush the cached prefixes (device and host tiers), or with ``storage`` the
        hierarchical cache's storage tier; False while requests run (or without that tier)."""
        reply = await self.client.call(lambda call_id: ipc.FlushCacheRequest(call_id, storage))
        return bool(reply.ok)

    async def update_weights(self, model_path: str) -> ipc.UpdateWeightsReply:
        """Have the engine load ``model_path``'s weights once its running requests finish
        (those arriving meanwhile wait). One update at a time."""
        async with self._weights_lock:
            return await self.client.call(
                lambda call_id: ipc.UpdateWeightsRequest(call_id=call_id, model_path=model_path),
                timeout=WEIGHT_UPDATE_TIMEOUT_S,
            )

    def check_lora(self, name: str | None) -> None:
        """InvalidRequest (400) naming ``name`` unless that LoRA adapter is loaded."""
        if name is None:
            return
        if self.lora_adapters is None:
            raise InvalidRequest(
                f"the request names the LoRA adapter '{name}', but this server serves no "
                "adapters (start it with --enable-lora)"
            )
        if name not in self.lora_adapters:
            loaded = ", ".join(sorted(self.lora_adapters)) or "none"
            raise InvalidRequest(f"unknown LoRA adapter '{name}' (loaded: {loaded})")

    async def lora_call(self, make: Callable[[int], Any]) -> ipc.LoraReply:
        """Load or unload an adapter in the engine (between steps); the names this process
        checks requests against follow the reply."""
        reply: ipc.LoraReply = await self.client.call(make)
        if self.lora_adapters is not None and (reply.success or reply.loaded_adapters):
            self.lora_adapters = dict(reply.loaded_adapters)
        return reply

    async def engine_state(self) -> ipc.EngineState:
        return await self.client.call(ipc.StateRequest)

    # -- output side (runs in the receive task) --------------------------------------------

    def _on_step(self, out: ipc.StepOutput) -> None:
        now = time.perf_counter()
        metrics, live, extras = self.metrics, self.reqs, out.extras
        token_ids, pos = out.token_ids, 0
        for i, (rid, k, text) in enumerate(
            zip(out.rids, out.num_tokens, out.text_deltas, strict=True)
        ):
            r = live.get(rid)
            if r is None:
                pos += k
                continue
            if k:
                r.output_ids += token_ids[pos : pos + k]
                pos += k
                if r.first_token_time is None:
                    r.first_token_time = now
                    k -= 1
                if metrics is not None and k > 0 and r.last_token_time is not None:
                    metrics.on_tokens((now - r.last_token_time) / k, k)
                r.last_token_time = now
            x = extras.get(i) if extras else None
            if x is None:
                if text:
                    r.text += text
            else:
                self._apply_extras(r, x, text, now)
            r.event.set()

    def _apply_extras(self, r: ServerReq, x: ipc.ReqExtras, text: str, now: float) -> None:
        r.text = r.text[: x.text_start] + text if x.text_start >= 0 else r.text + text
        if x.logprobs:
            r.logprobs.extend(x.logprobs)
        if x.top_logprobs:
            r.top_logprobs.extend(x.top_logprobs)
        if x.input_logprobs is not None:
            r.input_logprobs = x.input_logprobs
            r.input_top_logprobs = x.input_top_logprobs or []
        if x.cached_tokens >= 0:
            r.cached_tokens = x.cached_tokens
        if x.context_tokens:
            r.context_tokens = x.context_tokens
        if x.spec_verify_ct >= 0:
            r.spec_verify_ct, r.spec_accepted_tokens = x.spec_verify_ct, x.spec_accepted_tokens
        if x.spec_draft_tokens >= 0:
            r.spec_draft_tokens = x.spec_draft_tokens
        if x.embedding is not None:
            r.embedding = x.embedding
        if x.label_logprobs is not None:
            r.label_logprobs = x.label_logprobs
        if x.finish is not None:
            self._finish(r, x.finish, x.error_status, now)

    def _finish(self, r: ServerReq, reason: FinishReason, status: int, now: float) -> None:
        r.finish, r.error_status, r.finish_time = reason, status, now
        if r.timer is not None:
            r.timer.cancel()
        self.reqs.pop(r.rid, None)
        logger.info(
            "request %s: %s, prompt %d (cached %d), output %d tokens, %.3f s",
            r.rid, reason.to_json(), len(r.prompt_ids), r.cached_tokens, len(r.output_ids),
            now - r.created,
        )  # fmt: skip
        if self.metrics is not None:
            first = r.first_token_time
            self.metrics.on_finish(
                aborted=reason.type == "abort",
                streaming=r.streaming,
                structured=r.sampling.grammar is not None,
                prompt_tokens=len(r.prompt_ids) + r.context_tokens,
                output_tokens=len(r.output_ids),
                cached_tokens=r.cached_tokens,
                spec_verify_ct=r.spec_verify_ct,
                spec=(r.custom_labels, r.spec_draft_tokens, r.spec_accepted_tokens),
                e2e=now - r.created,
                ttft=None if first is None else first - r.created,
                decode_seconds=None if first is None else now - first,
            )

    def _on_death(self, reason: str) -> None:
        now = time.perf_counter()
        for r in list(self.reqs.values()):
            self._finish(r, FinishReason("abort", message=f"engine died: {reason}"), 500, now)
            r.event.set()
        if self.on_engine_death is not None:
            self.on_engine_death(reason)
