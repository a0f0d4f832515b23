"""The engine's outer loop, one for both entrypoints: the offline Engine runs it on a thread
over in-process queues, the server's engine process over its ZMQ sockets.

Each turn: block on the inbox while idle (no busy polling; only KV transfers to wait for: sleep
until one ends or its deadline), handle every queued message, run one step, hand what changed
to the transport. The transport is the only difference between the two: how messages arrive,
how outputs and replies leave, and how callers learn that the loop has ended.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, TypeAlias

from radixserve.core.config import ConfigError
from radixserve.core.engine_core import EngineCore
from radixserve.core.lora_strategy import lora_of
from radixserve.core.request import FinishReason, InvalidRequest, Req
from radixserve.entrypoints import ipc
from radixserve.entrypoints.gc_timer import GcTimer
from radixserve.entrypoints.gen_rate import GenRate
from radixserve.entrypoints.profiler import EngineProfiler, ProfilerError

logger = logging.getLogger(__name__)

# Steps in a row that may fail with no request to end before the engine gives up.
MAX_FAILED_STEPS = 3

#: What the loop takes from its inbox: a message of the IPC protocol, or (in-process only) a
#: Req the caller built and keeps reading.
Inbound: TypeAlias = "ipc.EngineInbound | Req"


class Transport(ABC):
    """How the loop talks to its caller. Called from the loop's thread only."""

    @abstractmethod
    def wait(self, timeout: float | None) -> bool:
        """Block until a message may be queued, ``timeout`` seconds pass (None: no limit) or
        the engine's KV connector signals; False when the caller is gone (the loop ends)."""

    @abstractmethod
    def receive(self) -> Iterator[Inbound]:
        """Every queued message, in order, without blocking."""

    @abstractmethod
    def deliver(self, req: Req, error_status: int = 0) -> int:
        """``req`` changed (new tokens, or finished; ``error_status``: an HTTP status for a
        refusal). Returns how many new output tokens this hands on."""

    def flush(self) -> None:  # noqa: B027 - a transport that sends at once needs nothing
        """Send what ``deliver`` gathered since the last flush; called once per turn."""

    @abstractmethod
    def reply(self, msg: ipc.EngineOutbound) -> None:
        """Answer a call (state, flush_cache, profile, weights); deltas before it went first."""

    @abstractmethod
    def close(self, error: Exception | None, handling: Inbound | None) -> None:
        """The loop has ended: on shutdown or the caller's exit (``error`` None) or on an error
        it cannot recover from (``handling``: the message it was handling then, if any, which
        no one else will answer). No caller may be left waiting."""


class EngineLoop:
    """Owns the EngineCore's outer loop. ``isolate_failures``: a step that raises ends only the
    requests it was running, each with an abort naming the error, and a request that cannot be
    queued only itself (the server: one bad request must not take the others down); without
    it every such error ends the loop and reaches every caller (the offline Engine, where the
    caller sees the exception)."""

    def __init__(
        self,
        core: EngineCore,
        transport: Transport,
        *,
        isolate_failures: bool,
        gc_timer: GcTimer | None = None,
    ) -> None:
        self.core = core
        self.transport = transport
        self.isolate_failures = isolate_failures
        self.gc_timer = gc_timer  # EngineState.gc, where the process has one
        self.step_started: float | None = None  # read by a watchdog thread, if any
        self.failed_steps = 0  # in a row
        self.gen_rate = GenRate()  # EngineState.gen_throughput
        self.profiler = EngineProfiler()  # /start_profile, /stop_profile
        # /update_weights_from_disk: waits (admission paused) until no request runs
        self.weight_update: ipc.UpdateWeightsRequest | None = None
        self._handling: Inbound | None = None  # the message being handled, if it fails

    def run(self) -> None:
        error: Exception | None = None
        try:
            self._turns()
        except Exception as e:  # noqa: BLE001 - every waiting caller learns it (Transport.close)
            logger.exception("engine loop failed")
            error = e
        self.transport.close(error, self._handling)

    def _turns(self) -> None:
        core = self.core
        while True:
            wait = core.idle_wait()  # only KV transfers to wait for: sleep on them
            if (not core.has_work() or wait is not None) and not self.transport.wait(wait):
                logger.warning("server process died; engine exiting")
                return
            if not self._drain():
                return
            if core.has_work():
                self._step()
            self.transport.flush()
            if self.weight_update is not None and core.drained():
                self._update_weights(self.weight_update)

    # -- the step ----------------------------------------------------------------------------

    def _step(self) -> None:
        """One engine step. A step that raises ends the requests that were running (with
        ``isolate_failures``); only a failure the loop cannot recover from (KV still held
        afterwards, or steps failing with nothing to end) ends it."""
        self.step_started = time.monotonic()
        begin = time.perf_counter()
        try:
            changed = self.core.step()
            self.failed_steps = 0
        except AssertionError:
            raise  # a broken invariant (--debug-leak-check among them): the engine must stop
        except Exception as e:
            if not self.isolate_failures:
                raise
            changed = self._recover(e)
        finally:
            self.step_started = None
        tokens = 0
        for req in changed:
            tokens += self.transport.deliver(req)
        self.gen_rate.add_step(begin, time.perf_counter(), tokens)
        if self.profiler.active:
            self._profile_step()

    def _recover(self, error: Exception) -> list[Req]:
        logger.exception("an engine step failed; aborting the running requests")
        message = f"the engine failed while running this request ({type(error).__name__}: {error})"
        ended = []
        for rid in self.core.running_rids():
            req = self.core.abort(rid, message)
            if req is not None:
                req.failed = message
                ended.append(req)
        kv = self.core.kv_accounting()
        if kv["in_use"] or kv["locked"] != kv["pinned"]:
            raise RuntimeError(f"cannot recover from a failed step ({error!r}): KV held {kv}")
        if not ended:  # nothing to blame: a step that fails again and again is a broken engine
            self.failed_steps += 1
            if self.failed_steps > MAX_FAILED_STEPS:
                raise error
        return ended

    # -- the inbox ---------------------------------------------------------------------------

    def _drain(self) -> bool:
        """Handle every queued message; False on shutdown."""
        for msg in self.transport.receive():
            self._handling = msg
            if not self._handle(msg):
                return False
            self._handling = None
        return True

    def _handle(self, msg: Inbound) -> bool:
        core = self.core
        if isinstance(msg, Req | ipc.GenerateRequest):
            self._add(msg if isinstance(msg, Req) else request_of(msg))
        elif isinstance(msg, ipc.CancelRoomRequest):
            peer = (msg.host, msg.port) if msg.host else None
            core.cancel_room(msg.room, msg.message, peer, refused=msg.client_error)
        elif isinstance(msg, ipc.AbortRequest):
            aborted = core.abort(msg.rid, msg.message)
            if aborted is not None:
                self.transport.deliver(aborted)
        elif isinstance(msg, ipc.StateRequest):
            self._reply(self._state(msg.call_id))
        elif isinstance(msg, ipc.FlushCacheRequest):
            ok = core.clear_cache_storage() if msg.storage else core.flush_cache()
            self._reply(ipc.FlushCacheReply(msg.call_id, ok))
        elif isinstance(msg, ipc.ProfileRequest):
            self._reply(self._profile(msg))
        elif isinstance(msg, ipc.OpenSessionRequest | ipc.CloseSessionRequest):
            self._reply(self._session(msg))
        elif isinstance(msg, ipc.UpdateWeightsRequest):
            self._queue_weight_update(msg)
        elif isinstance(msg, ipc.LoadLoraRequest | ipc.UnloadLoraRequest):
            self._reply(lora_call(core, msg))
        elif isinstance(msg, ipc.ShutdownRequest):
            if self.profiler.active:
                self.profiler.stop()  # the trace so far is written, not lost
            core.close_transfers()  # the KV connector's server and transfer agent, in order
            return False
        return True

    def _add(self, req: Req) -> None:
        try:
            self.core.add_request(req)
        except InvalidRequest as e:
            req.finish(FinishReason("abort", message=str(e)))
            self.transport.deliver(req, error_status=400)
        except Exception as e:
            if not self.isolate_failures:
                raise
            logger.exception("request %s could not be queued", req.rid)
            message = f"the engine failed to queue the request ({type(e).__name__}: {e})"
            req.finish(FinishReason("abort", message=message))
            self.transport.deliver(req, error_status=500)

    def _reply(self, msg: ipc.EngineOutbound) -> None:
        self.transport.flush()  # replies never overtake the deltas before them
        self.transport.reply(msg)

    # -- calls -------------------------------------------------------------------------------

    def _queue_weight_update(self, msg: ipc.UpdateWeightsRequest) -> None:
        if self.weight_update is not None:  # one at a time: the server serializes them
            self.transport.reply(
                ipc.UpdateWeightsReply(
                    call_id=msg.call_id, success=False, num_paused_requests=0,
                    message="another weight update is in progress; retry when it has finished",
                )
            )  # fmt: skip
        else:
            self.weight_update = msg
            self.core.pause_admission(True)

    def _update_weights(self, msg: ipc.UpdateWeightsRequest) -> None:
        """Load the new weights now that no request runs, then let the waiting ones in."""
        held = self.core.num_waiting
        success, message = self.core.update_weights(msg.model_path)
        self.weight_update = None
        self.core.pause_admission(False)
        reply = ipc.UpdateWeightsReply(
            call_id=msg.call_id, success=success, message=message, num_paused_requests=held
        )
        self.transport.reply(reply)

    def _profile(self, msg: ipc.ProfileRequest) -> ipc.ProfileReply:
        profiler, reply = self.profiler, ipc.ProfileReply
        try:
            if msg.action == "start":
                path = profiler.start(
                    msg.output_dir, msg.file_name, msg.activities, msg.num_steps,
                    msg.record_shapes, msg.with_stack,
                )  # fmt: skip
                what = f"profiling {', '.join(profiler.activities)}"
                return reply(call_id=msg.call_id, ok=True, message=what, trace_path=path)
            path = profiler.stop()
            return reply(call_id=msg.call_id, ok=True, message="trace written", trace_path=path)
        except ProfilerError as e:
            return reply(call_id=msg.call_id, ok=False, message=str(e))
        except (OSError, ValueError) as e:  # writing the trace failed; the profile has ended
            return reply(call_id=msg.call_id, ok=False, message=f"cannot write the trace: {e}")

    def _session(self, msg: ipc.OpenSessionRequest | ipc.CloseSessionRequest) -> ipc.SessionReply:
        sessions = self.core.sessions
        try:
            if isinstance(msg, ipc.OpenSessionRequest):
                sid = sessions.open_session(msg.capacity, msg.session_id, msg.ttl)
                return ipc.SessionReply(call_id=msg.call_id, ok=True, session_id=sid)
            sessions.close_session(msg.session_id)
            return ipc.SessionReply(call_id=msg.call_id, ok=True, session_id=msg.session_id)
        except InvalidRequest as e:
            return ipc.SessionReply(call_id=msg.call_id, ok=False, message=str(e))

    def _profile_step(self) -> None:
        """Count a profiled step; the last of ``num_steps`` writes the trace."""
        try:
            self.profiler.after_step()
        except (OSError, ValueError):  # e.g. a path the file system refuses
            logger.exception("cannot write the profile trace")

    def _state(self, call_id: int) -> ipc.EngineState:
        core = self.core
        counters: dict[str, Any] = core.scheduler_counters()
        return ipc.EngineState(
            call_id=call_id,
            num_running=core.num_running,
            num_waiting=core.num_waiting,
            kv=core.kv_accounting(),
            speculative=core.spec_stats(),
            gen_throughput=self.gen_rate.per_second(),
            num_grammar_queue=core.num_grammar_queue,
            gc=self.gc_timer.to_json() if self.gc_timer is not None else {},
            sessions=core.sessions.describe(),
            **counters,
        )


def request_of(msg: ipc.GenerateRequest) -> Req:
    """The engine's Req for a request the server sent."""
    req = Req(msg.rid, msg.input_ids, msg.sampling, msg.extra_key)
    req.logprob_start_len = msg.logprob_start_len
    req.pooling, req.label_token_ids = msg.pooling, msg.label_token_ids
    req.bootstrap = msg.bootstrap
    req.lora_name = msg.lora_name
    req.mm_inputs = msg.mm
    req.priority, req.session_params = msg.priority, msg.session
    return req


def lora_call(core: EngineCore, msg: ipc.LoadLoraRequest | ipc.UnloadLoraRequest) -> ipc.LoraReply:
    """Load or unload an adapter between steps (core/lora_strategy.py)."""
    lora = lora_of(core)
    if lora is None:
        return ipc.LoraReply(
            call_id=msg.call_id, success=False,
            error_message="LoRA is off; start the server with --enable-lora",
        )  # fmt: skip
    try:
        if isinstance(msg, ipc.LoadLoraRequest):
            lora.load(msg.lora_name, msg.lora_path)
        else:
            lora.unload(msg.lora_name)
    except ConfigError as e:
        return ipc.LoraReply(
            call_id=msg.call_id, success=False, error_message=str(e), loaded_adapters=lora.names()
        )
    return ipc.LoraReply(call_id=msg.call_id, success=True, loaded_adapters=lora.names())
