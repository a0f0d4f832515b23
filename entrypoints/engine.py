"""The offline Engine: an in-process API over EngineCore, driven by a background thread.

``generate`` accepts one prompt or a list (text, or token ids) with one sampling-params dict
for all or a list of one per prompt, returns SGLang-shaped dicts (``text``, ``output_ids``,
``meta_info``) and, with ``stream=True``, yields cumulative updates. Requests submitted from
several threads share the running batch (continuous batching). How a call fans out into
requests (per-prompt params, per-choice seeds) and what text may be streamed are the server's
own rules, from the same code.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
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
from radixserve.core.distributed import teardown as teardown_parallel
from radixserve.core.engine_core import EngineCore
from radixserve.core.lora_strategy import check_request_adapter
from radixserve.core.multimodal import image_processor_for, refuse_images_message
from radixserve.core.plugins import PluginHost, default_host
from radixserve.core.request import InvalidRequest, Req, SamplingParams
from radixserve.entrypoints import ipc, tp_workers
from radixserve.entrypoints.engine_loop import EngineLoop
from radixserve.entrypoints.engine_transport import FINISHED, QueueTransport
from radixserve.entrypoints.fanout import choice_params, per_item
from radixserve.entrypoints.media import load_images, policy_of
from radixserve.entrypoints.output import (
    input_logprob_entries,
    logprob_triples,
    top_logprob_triples,
)
from radixserve.entrypoints.spec_meta import spec_meta_info

logger = logging.getLogger(__name__)

#: Settings the offline Engine chooses where the caller does not, before the platform's: it
#: runs batches, where no one watches tokens arrive, so a step takes a whole prefill chunk
#: beside its decodes instead of shrinking it for their inter-token latency (the CPU server's
#: default). 32 requests on the 2-core CPU VM: 74.99 tok/s at 0 against 71.52 at 4 and
#: 60.75 at 2 (bench/HISTORY.md, issue 19). vLLM's offline LLM class also batches more per
#: step than its server by default.
OFFLINE_DEFAULTS: dict[str, Any] = {"prefill_shrink_after_decodes": 0}


def _return_freed_host_memory() -> None:
    """Hand the C allocator's freed pages back to the system. The model and the KV pool were
    allocated on the engine thread, in that thread's malloc arena, which glibc does not trim on
    its own: without this a process kept about a model's size for each Engine it had started
    and stopped (SmolLM2 in float32, five Engines one after the other: 1.5 GB resident after
    them, against 310 MB with the trim)."""
    gc.collect()
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator's own policy stands
        return
    libc.malloc_trim(0)


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
        self._transport = QueueTransport(self._check_running, self._record_error)
        self._inbox = self._transport.inbox
        self._ids = itertools.count()
        #: the thread that built the EngineCore; the loop runs on it too (_run_engine_thread)
        self.built_on: int | None = None
        self.loop: EngineLoop | None = None
        built: queue.Queue[EngineCore | BaseException] = queue.Queue()
        self._thread = threading.Thread(
            target=self._run_engine_thread, args=(built,), name="radixserve-engine", daemon=True
        )
        self._thread.start()
        core = built.get()
        if isinstance(core, BaseException):
            self._thread.join()
            if self._rendezvous is not None:  # not a group this process had before the Engine
                teardown_parallel()
            tp_workers.end_all(self._workers, 10.0)  # they fail alike, or wait for rank 0
            raise core
        self.core = core
        if self._workers:
            ranks = [(i + 1, p) for i, p in enumerate(self._workers)]
            tp_workers.watch(ranks, self._rank_died)
        self.tokenizer = self.core.tokenizer
        self._image_processor: Any = None  # built at the first request with images
        self._image_lock = threading.Lock()

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
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
    ) -> Any:
        """One prompt -> one dict (a list when n > 1); a list of prompts -> a list in order
        (prompt-major, then choice). ``sampling_params`` is one dict for every prompt or a list
        of one per prompt; ``lora_path`` likewise names a loaded LoRA adapter (None: the base
        model); ``image_data`` gives a prompt's images (data: URLs, file paths, base64 text or
        bytes; a list of such lists for a list of prompts), each standing for one image
        placeholder of the prompt (docs/vision.md)."""
        self._check_running()
        batch = self._prompts(prompt, input_ids)
        single = not isinstance(prompt, list) and not (input_ids and isinstance(input_ids[0], list))
        mm = self._images_of(batch, image_data, single)
        per_prompt = per_item(sampling_params, len(batch), "sampling_params")
        adapters = per_item(lora_path, len(batch), "lora_path")
        reqs: list[Req] = []
        for ids, raw, adapter, images in zip(batch, per_prompt, adapters, mm, strict=True):
            params = _params(raw, return_logprob, top_logprobs_num)
            check_request_adapter(self.core, adapter)
            for i in range(params.n):
                req = self._make_req(ids if images is None else images[0], choice_params(params, i))
                req.lora_name = adapter
                req.mm_inputs = None if images is None else images[1]
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

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load a PEFT adapter under ``lora_name`` (between steps); SGLang's reply fields."""
        return self._transport.call(ipc.LoadLoraRequest(next(self._ids), lora_name, lora_path))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return self._transport.call(ipc.UnloadLoraRequest(next(self._ids), lora_name))

    def abort(self, rid: str) -> None:
        self._inbox.put(ipc.AbortRequest(rid))

    def flush_cache(self) -> bool:
        return self._transport.call(ipc.FlushCacheRequest(next(self._ids)))

    def shutdown(self) -> None:
        """Stop the engine and free its device memory, so another Engine can start in this
        process. Calling it again does nothing."""
        if self._thread.is_alive():
            self._inbox.put(ipc.ShutdownRequest())
            self._thread.join()
        tp_workers.stop_watching(self._workers)  # their exits are expected from here on
        self.core.shutdown()  # rank 0 tells the other tensor-parallel ranks to stop
        tp_workers.end_all(self._workers, 10.0)
        _return_freed_host_memory()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals -------------------------------------------------------------------------

    def _run_engine_thread(self, built: queue.Queue[Any]) -> None:
        """The engine thread: build the EngineCore, hand it to ``__init__`` (or the error that
        stopped it), then run the loop (the server engine process's loop, over in-process
        queues).

        The build runs here rather than on the caller's thread because torch's CPU kernels
        parallelize through OpenMP, and libgomp keeps a pool of worker threads per thread that
        starts parallel work: a build on the caller's thread left a second pool beside the
        loop's, more OpenMP threads than cores, so libgomp cut its workers' spin-wait to a
        few hundred cycles and woke them through the kernel for every parallel kernel of
        every step. At batch 1 (hundreds of small kernels a step) steps took twice as long
        as the server engine's, which builds and steps on one thread (SmolLM2 Q4_1, 2 cores:
        15.4 against 7.2 ms a decode step)."""
        try:
            core = EngineCore(
                self.model_dir,
                self.config,
                self.host,
                self._rendezvous,
                usage=("offline Engine", OFFLINE_DEFAULTS),
            )
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            built.put(e)
            return
        self.loop = loop = EngineLoop(core, self._transport, isolate_failures=False)
        self.built_on = threading.get_ident()
        built.put(core)
        loop.run()

    def _start_tp_ranks(self) -> list[Any]:
        """With tp_size > 1, spawn ranks 1..N-1 (this process is rank 0). They build their
        plugins from the installed entry points: a ``host`` given to Engine is not theirs."""
        self._rendezvous = None
        size, pp = self.config.tp_size * self.config.pp_size, self.config.pp_size
        if self.config.nnodes > 1:
            raise ConfigError(
                f"nnodes={self.config.nnodes}: a multi-node engine runs through `radixserve "
                "serve`, one launch per node; the offline Engine runs on one node"
            )
        if size == 1:
            return []
        ranks = tp_workers.rendezvous(size, self.config.watchdog_timeout, pp)
        self._rendezvous = ranks[0]
        workers = tp_workers.start_workers(dataclasses.asdict(self.config), ranks[1:])
        try:  # a rank dead at start-up (an unguarded main module) fails now, not at the timeout
            tp_workers.wait_started(list(enumerate(workers, 1)), self.config.watchdog_timeout)
        except RuntimeError:
            tp_workers.end_all(workers, 0.0)
            raise
        return workers

    def _rank_died(self, reason: str) -> None:
        # The engine thread fails too if it was in a step (the collective errors out).
        logger.error("engine stopped: %s", reason)
        self._record_error(RuntimeError(reason))

    def _record_error(self, error: BaseException) -> None:
        """The first error is the one callers are told (a dead rank, if that was the cause)."""
        self._error = self._error or error

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

    def _images_of(self, batch: list[list[int]], image_data: Any, single: bool) -> list[Any]:
        """Per prompt: None, or (its ids with the image spans expanded, MultimodalInputs)."""
        if image_data is None:
            return [None] * len(batch)
        per_prompt = [image_data] if single else image_data
        if not isinstance(per_prompt, list) or len(per_prompt) != len(batch):
            raise InvalidRequest("image_data must give one entry (or list) per prompt")
        with self._image_lock:  # built once, even when several threads submit the first images
            if self._image_processor is None:
                found = image_processor_for(self.host, str(self.model_dir))
                self._image_processor = found or False
        proc = self._image_processor
        out: list[Any] = []
        for ids, refs in zip(batch, per_prompt, strict=True):
            if refs is None or refs == []:
                out.append(None)
                continue
            if proc is False:
                raise InvalidRequest(refuse_images_message(self.core.runner.model_config))
            out.append(proc.expand(ids, load_images(refs, policy_of(self.config))))
        return out

    def _make_req(self, ids: list[int], params: SamplingParams) -> Req:
        rid = f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        return Req(rid, list(ids), params)

    def _check_running(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop failed: {self._error}")
        if self._transport.closed or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down; start a new Engine")

    def _submit(self, req: Req) -> queue.Queue[Any]:
        return self._transport.submit(req)

    def _wait(self, req: Req, box: queue.Queue[Any]) -> dict[str, Any]:
        while box.get() is not FINISHED:
            pass
        return self._result(req)

    def _stream(self, req: Req) -> Iterator[dict[str, Any]]:
        box = self._submit(req)
        sent = 0
        try:
            while True:
                event = box.get()
                if event is FINISHED:
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
        num_draft = self.core.spec_num_draft
        if num_draft is not None:  # SGLang adds these only while speculation is on
            verify_ct, accepted = spec or (req.spec_verify_ct, req.spec_accepted_tokens)
            meta.update(spec_meta_info(verify_ct, accepted, num_draft))
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
