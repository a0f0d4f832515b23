"""The offline Engine: an in-process API over EngineCore, driven by a background thread.

``generate`` accepts one prompt or a list (text, or token ids) with one sampling-params dict
for all or a list of one per prompt, returns SGLang-shaped dicts (``text``, ``output_ids``,
``meta_info``) and, with ``stream=True``, yields cumulative updates. Requests submitted from
several threads share the running batch (continuous batching). How a call fans out into
requests (per-prompt params, per-choice seeds) and what text may be streamed are the server's
own rules, from the same code.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.output import input_logprob_entries, logprob_triples, top_logprob_triples
from radixserve.core.parallel import teardown as teardown_parallel
from radixserve.core.plugins import PluginHost, default_host
from radixserve.core.request import FinishReason, InvalidRequest, Req, SamplingParams
from radixserve.core.spec_strategy import speculator_of
from radixserve.core.stop import streamable_text
from radixserve.entrypoints import tp_workers
from radixserve.entrypoints.fanout import choice_params, per_item
from radixserve.entrypoints.spec_meta import spec_meta_info

logger = logging.getLogger(__name__)
_STOP = object()

#: Settings the offline Engine chooses where the caller does not, before the platform's: it
#: runs batches, where no one watches tokens arrive, so a step takes a whole prefill chunk
#: beside its decodes instead of shrinking it for their inter-token latency (the CPU server's
#: default). 32 requests on the 2-core CPU VM: 74.99 tok/s at 0 against 71.52 at 4 and
#: 60.75 at 2 (docs/BENCHMARKS.md, issue 19). vLLM's offline LLM class also batches more per
#: step than its server by default.
OFFLINE_DEFAULTS: dict[str, Any] = {"prefill_shrink_after_decodes": 0}


class EngineDeadError(RuntimeError):
    """The engine loop failed; the message carries the original error."""


class Engine:
    """``Engine(model_path=None)`` serves the default model (SmolLM2-135M-Instruct)."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        plugins: tuple[str, ...] | list[str] | dict[str, str] = (),
        host: PluginHost | None = None,
        **settings: Any,
    ) -> None:
        allow = tuple(settings.pop("plugin_allow", ()) or ())
        self.host = host or default_host(allow)
        resolved = self.host.hook.resolve_model_dir(model_path=model_path) or model_path
        if resolved is None or not Path(resolved).is_dir():
            raise ConfigError(f"model path '{model_path}' is not a model directory or a .gguf file")
        if isinstance(plugins, dict):
            plugins = [f"{k}={v}" for k, v in plugins.items()]
        elif isinstance(plugins, str):  # one selection, not its characters
            plugins = [plugins]
        self.config = EngineConfig(
            model_path=str(resolved), plugins=tuple(plugins), plugin_allow=allow, **settings
        )
        self.model_dir = Path(resolved)
        self._error: BaseException | None = None
        self._workers = self._start_tp_ranks()
        try:
            self.core = EngineCore(
                self.model_dir,
                self.config,
                self.host,
                self._rendezvous,
                usage=("offline Engine", OFFLINE_DEFAULTS),
            )
        except BaseException:
            teardown_parallel()
            tp_workers.end_all(self._workers, 10.0)  # they fail alike, or wait for rank 0
            raise
        if self._workers:
            ranks = [(i + 1, p) for i, p in enumerate(self._workers)]
            tp_workers.watch(ranks, self._rank_died)
        self.tokenizer = self.core.tokenizer
        self._inbox: queue.Queue[Any] = queue.Queue()
        # Held to queue work and to close the inbox, so nothing is queued after the loop's
        # last look at it (that caller would wait forever).
        self._inbox_lock = threading.Lock()
        self._closed = False
        self._outboxes: dict[str, queue.Queue[Any]] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="radixserve-engine", daemon=True)
        self._thread.start()

    # -- public API ------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | SamplingParams | list[Any] | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
    ) -> Any:
        """One prompt -> one dict (a list when n > 1); a list of prompts -> a list in order
        (prompt-major, then choice). ``sampling_params`` is one dict for every prompt or a list
        of one per prompt."""
        self._check_running()
        batch = self._prompts(prompt, input_ids)
        single = not isinstance(prompt, list) and not (input_ids and isinstance(input_ids[0], list))
        per_prompt = per_item(sampling_params, len(batch), "sampling_params")
        reqs: list[Req] = []
        for ids, raw in zip(batch, per_prompt, strict=True):
            params = _params(raw, return_logprob, top_logprobs_num)
            for i in range(params.n):
                req = self._make_req(ids, choice_params(params, i))
                if return_logprob:
                    # SGLang: without a start, a prefill-only request scores its whole prompt.
                    start = logprob_start_len
                    if start is None:
                        start = 0 if params.max_new_tokens == 0 else -1
                    req.logprob_start_len = start
                    req.return_text_in_logprobs = return_text_in_logprobs
                reqs.append(req)
        for req in reqs:
            self.core.validate(req)
        if stream:
            if len(reqs) != 1:
                raise InvalidRequest("stream=True takes one prompt with n=1")
            return self._stream(reqs[0])
        boxes = [self._submit(r) for r in reqs]
        results = [self._wait(r, box) for r, box in zip(reqs, boxes, strict=True)]
        return results[0] if single and len(results) == 1 else results

    def chat(self, messages: list[dict[str, Any]], sampling_params: Any = None, **kw: Any) -> Any:
        """Apply the model's chat template, then generate."""
        return self.generate(
            input_ids=self.tokenizer.encode_chat(messages), sampling_params=sampling_params, **kw
        )

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def flush_cache(self) -> bool:
        done: queue.Queue[bool] = queue.Queue()
        with self._inbox_lock:
            self._check_running()
            self._inbox.put(("flush", done))
        return done.get()

    def shutdown(self) -> None:
        """Stop the engine and free its device memory, so another Engine can start in this
        process. Calling it again does nothing."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join()
        tp_workers.stop_watching(self._workers)  # their exits are expected from here on
        self.core.shutdown()  # rank 0 tells the other tensor-parallel ranks to stop
        tp_workers.end_all(self._workers, 10.0)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals -------------------------------------------------------------------------

    def _start_tp_ranks(self) -> list[Any]:
        """With tp_size > 1, spawn ranks 1..N-1 (this process is rank 0). They build their
        plugins from the installed entry points: a ``host`` given to Engine is not theirs."""
        self._rendezvous = None
        size = self.config.tp_size
        if size == 1:
            return []
        ranks = tp_workers.rendezvous(size, self.config.watchdog_timeout)
        self._rendezvous = ranks[0]
        return tp_workers.start_workers(dataclasses.asdict(self.config), ranks[1:])

    def _rank_died(self, reason: str) -> None:
        # The engine thread fails too if it was in a step (the collective errors out).
        logger.error("engine stopped: %s", reason)
        self._error = self._error or RuntimeError(reason)

    def _prompts(self, prompt: Any, input_ids: Any) -> list[list[int]]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequest("pass exactly one of prompt (text) or input_ids")
        if prompt is not None:
            texts = prompt if isinstance(prompt, list) else [prompt]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise InvalidRequest("prompt must be a string or a non-empty list of strings")
            return [self.tokenizer.encode(t) for t in texts]
        if not isinstance(input_ids, list):
            raise InvalidRequest("input_ids must be a list of token ids or a list of such lists")
        batch = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids]
        for ids in batch:
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise InvalidRequest("input_ids must contain only integer token ids")
        return batch

    def _make_req(self, ids: list[int], params: SamplingParams) -> Req:
        rid = f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        return Req(rid, list(ids), params)

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error}")
        if self._closed or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down; start a new Engine")

    def _submit(self, req: Req) -> queue.Queue[Any]:
        box: queue.Queue[Any] = queue.Queue()
        with self._inbox_lock:
            self._check_running()
            self._outboxes[req.rid] = box
            self._inbox.put(("add", req))
        return box

    def _wait(self, req: Req, box: queue.Queue[Any]) -> dict[str, Any]:
        while box.get() is not _FINISHED:
            pass
        return self._result(req)

    def _stream(self, req: Req) -> Iterator[dict[str, Any]]:
        box = self._submit(req)
        sent = 0
        try:
            while True:
                event = box.get()
                if event is _FINISHED:
                    yield self._result(req)
                    return
                tokens, text, spec = event
                if tokens > sent:
                    sent = tokens
                    yield self._result(req, upto=tokens, text=text, spec=spec)
        finally:
            if not req.finished:
                self.abort(req.rid)

    def _result(
        self,
        req: Req,
        upto: int | None = None,
        text: str | None = None,
        spec: tuple[int, int] | None = None,
    ) -> dict[str, Any]:
        """The SGLang-shaped result: the final one, or (``upto`` tokens, ``text``, ``spec``:
        verify steps and accepted drafts) a progress snapshot the engine thread took."""
        if req.state.value == "aborted" and req.finish_reason and self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error}")
        finished = req.finished and upto is None
        ids = req.output_ids if upto is None else req.output_ids[:upto]
        if text is None:
            text = req.detok.text if req.detok is not None else ""
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish_reason.to_json()
            if finished and req.finish_reason
            else None,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": req.cached_tokens,
        }
        if finished and req.finish_time is not None:
            meta["e2e_latency"] = req.finish_time - req.arrival_time
        speculator = speculator_of(self.core)
        if speculator is not None:  # SGLang adds these only while speculation is on
            verify_ct, accepted = spec or (req.spec_verify_ct, req.spec_accepted_tokens)
            meta.update(spec_meta_info(verify_ct, accepted, speculator.num_draft))
        if req.sampling.logprobs:
            n = len(ids)
            decode = self._token_text if req.return_text_in_logprobs else None
            meta["output_token_logprobs"] = logprob_triples(req.output_logprobs[:n], ids, decode)
            # as the server sends it: SGLang's frontend tells a cumulative list by this count
            meta["output_token_logprobs_length"] = n
            if req.sampling.top_logprobs_num:
                meta["output_top_logprobs"] = top_logprob_triples(
                    req.output_top_logprobs[:n], decode
                )
            if req.logprob_start_len >= 0:
                entries, tops = input_logprob_entries(
                    req.input_ids,
                    req.logprob_start_len,
                    req.input_token_logprobs,
                    req.input_top_logprobs,
                    decode,
                )
                meta["input_token_logprobs"] = entries
                if tops is not None:
                    meta["input_top_logprobs"] = tops
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _loop(self) -> None:
        core = self.core
        live: dict[str, Req] = {}
        handling: Any = None  # the inbox item being handled, if the step fails on it
        while True:
            try:
                block = not core.has_work()
                while True:
                    try:
                        item = self._inbox.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if item is _STOP:
                        self._fail_all(live, "engine shut down")
                        self._close_inbox("engine shut down")
                        return
                    handling = item
                    self._handle(item, live)
                    handling = None
                for req in core.step():
                    self._deliver(req, live)
            except Exception as e:  # noqa: BLE001 - surfaced to every waiting caller
                logger.exception("engine loop failed")
                self._error = self._error or e  # a dead rank, if that was the cause
                self._fail_all(live, f"engine error: {e}")
                if handling is not None:  # taken from the inbox, so _close_inbox cannot see it
                    self._refuse(handling, f"engine error: {e}")
                self._close_inbox(f"engine error: {e}")
                return

    def _close_inbox(self, message: str) -> None:
        """The loop is ending: answer what is still queued (requests end with ``message``, a
        flush reports False) and refuse more, so no caller waits forever."""
        with self._inbox_lock:
            self._closed = True
            while True:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    return
                if item is not _STOP:
                    self._refuse(item, message)

    def _refuse(self, item: tuple[str, Any], message: str) -> None:
        """Answer an inbox item the loop will not carry out: a request ends with ``message``,
        a flush reports False."""
        kind, arg = item
        if kind == "add":
            if not arg.finished:
                arg.finish(FinishReason("abort", message=message))
            self._deliver(arg, {})
        elif kind == "flush":
            arg.put(False)

    def _handle(self, item: tuple[str, Any], live: dict[str, Req]) -> None:
        kind, arg = item
        if kind == "add":
            try:
                self.core.add_request(arg)
            except InvalidRequest as e:
                arg.finish(FinishReason("abort", message=str(e)))
                self._deliver(arg, live)
                return
            live[arg.rid] = arg
        elif kind == "abort":
            req = self.core.abort(arg)
            if req is not None:
                self._deliver(req, live)
        elif kind == "flush":
            arg.put(self.core.flush_cache())

    def _deliver(self, req: Req, live: dict[str, Req]) -> None:
        box = self._outboxes.get(req.rid)
        if box is None:
            return
        if req.finished:
            live.pop(req.rid, None)
            self._outboxes.pop(req.rid, None)
            box.put(_FINISHED)
        else:
            # A snapshot taken here, between steps: the caller's thread never reads text that
            # the next step is changing (a stop string appended, then cut). A tail that could
            # still become a stop string is held back, as the server holds it back.
            text = req.detok.text if req.detok is not None else ""
            spec = (req.spec_verify_ct, req.spec_accepted_tokens)
            box.put((len(req.output_ids), streamable_text(text, req.sampling.stop), spec))

    def _fail_all(self, live: dict[str, Req], message: str) -> None:
        for req in list(live.values()):
            if not req.finished:
                req.finish(FinishReason("abort", message=message))
            self._deliver(req, live)


_FINISHED = object()


def _params(
    sampling_params: dict[str, Any] | SamplingParams | None, logprob: bool, top_n: int
) -> SamplingParams:
    if isinstance(sampling_params, SamplingParams):
        params = _copy_params(sampling_params)
        params.validate()
    else:
        params = SamplingParams.from_dict(sampling_params)
    if logprob or top_n:
        params.logprobs = True
        params.top_logprobs_num = max(params.top_logprobs_num, top_n)
    return params


def _copy_params(params: SamplingParams) -> SamplingParams:
    return replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
