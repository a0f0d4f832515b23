"""The engine process: builds EngineCore and serves it over two ZMQ IPC sockets.

Loop: block on the inbound socket while idle (no busy polling; the parent's death also wakes
it), drain every queued message, run one step, push one ``StepOutput`` of what changed.
Started by the launcher with the multiprocessing spawn context; all arguments are plain data.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from radixserve.core import ipc
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.disaggregation import connector_of
from radixserve.core.engine_core import EngineCore
from radixserve.core.gen_rate import GenRate
from radixserve.core.grammar_sandbox import SandboxSpec
from radixserve.core.parallel import Rendezvous
from radixserve.core.plugins import PluginError, PluginHost, default_host
from radixserve.core.profiler import EngineProfiler, ProfilerError
from radixserve.core.request import FinishReason, InvalidRequest, Req, SamplingParams
from radixserve.entrypoints.gc_timer import freeze_if_asked, process_gc_timer
from radixserve.entrypoints.step_output import StepOutputBuilder

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 70  # EX_SOFTWARE
# Steps in a row that may fail with no request to end before the engine gives up.
MAX_FAILED_STEPS = 3


def run_engine(
    settings: dict[str, Any],
    inbound_addr: str,
    outbound_addr: str,
    rendezvous: Rendezvous | None = None,
) -> None:
    """Process entry point. ``settings`` are EngineConfig fields; the server binds both
    addresses, the engine connects. With tensor parallelism this is rank 0 (``rendezvous``);
    the server starts the other ranks beside it (entrypoints/tp_workers.py)."""
    # Ctrl-C reaches the whole process group; the server decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=str(settings.get("log_level", "warning")).upper(),
        format="%(asctime)s engine %(levelname)s %(name)s: %(message)s",
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)  # unbounded, like the server's side
    pull.connect(inbound_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(outbound_addr)
    core: EngineCore | None = None
    try:
        try:
            core = _build_core(settings, rendezvous)
        except (ConfigError, PluginError) as e:  # a bad setting: its one line says it all
            push.send(ipc.encode(ipc.EngineFailed(str(e))))
            return
        except Exception as e:  # noqa: BLE001 - reported to the server, which prints it
            logger.exception("engine failed to start")
            push.send(ipc.encode(ipc.EngineFailed(f"{type(e).__name__}: {e}")))
            return
        core.runner.platform.bind_server_engine()
        push.send(ipc.encode(_ready(core)))
        _isolate_grammar_compiles(core)
        freeze_if_asked()
        EngineLoop(core, pull, push).run()
    finally:
        if core is not None:
            core.runner.close()  # the other tensor-parallel ranks leave their step loops
        push.close(linger=2000)  # let a final message (EngineFailed) reach the server
        pull.close(linger=0)
        ctx.term()


def _build_core(settings: dict[str, Any], rendezvous: Rendezvous | None = None) -> EngineCore:
    host, model_dir, config = engine_config(settings)
    return EngineCore(model_dir, config, host, rendezvous)


def engine_config(settings: dict[str, Any]) -> tuple[PluginHost, Path, EngineConfig]:
    """The plugin host, the resolved model directory and the EngineConfig of ``settings``."""
    host = default_host(tuple(settings.get("plugin_allow") or ()))
    model_path = settings.get("model_path")
    resolved = host.hook.resolve_model_dir(model_path=model_path) or model_path
    if resolved is None or not Path(resolved).is_dir():
        raise ConfigError(f"model path '{model_path}' is not a model directory or a .gguf file")
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in settings.items() if k in names}
    values["model_path"] = str(resolved)
    values["plugins"] = tuple(values.get("plugins") or ())
    values["plugin_allow"] = tuple(values.get("plugin_allow") or ())
    return host, Path(resolved), EngineConfig(**values)


def _isolate_grammar_compiles(core: EngineCore) -> None:
    """Compile each new grammar in a capped sandbox process first (core/grammar_sandbox.py),
    so that no request's grammar can take the engine's time or memory."""
    grammars, config = core.grammars, core.config
    if grammars.backend_name == "none":
        return  # it refuses every grammar at once
    grammars.isolate(
        SandboxSpec(
            backend=grammars.backend_name,
            model_dir=str(config.model_path),
            vocab_size=core.runner.model_config.vocab_size,
            stop_token_ids=tuple(core.eos_token_ids),
            plugin_allow=tuple(config.plugin_allow),
            memory_mb=config.grammar_compile_memory,
        )
    )


def _ready(core: EngineCore) -> ipc.EngineReady:
    return ipc.EngineReady(
        model_dir=str(core.config.model_path),
        max_context=core.max_context,
        kv_size=core.runner.kv_size,
        vocab_size=core.runner.model_config.vocab_size,
        eos_token_ids=list(core.eos_token_ids),
        plugins=dict(core.runner.plugins.names),
        max_running_requests=core.runner.settings.max_running_requests,
        settings=core.runner.settings.describe(),
        speculative=core.spec_stats(),
        disaggregation_mode=core.config.disaggregation_mode,
    )


class EngineLoop:
    """Drives EngineCore from the socket; remembers what each live request has been sent."""

    def __init__(self, core: EngineCore, pull: zmq.Socket, push: zmq.Socket) -> None:
        self.core = core
        self.pull = pull
        self.push = push
        self.output = StepOutputBuilder()  # remembers what each live request has been sent
        self.poller = zmq.Poller()
        self.poller.register(pull, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        self.parent_sentinel = parent.sentinel if parent is not None else None
        if self.parent_sentinel is not None:
            self.poller.register(self.parent_sentinel, zmq.POLLIN)
        # disaggregation: the KV connector wakes the loop when a transfer ends
        wakeup = c.wakeup_fd if (c := connector_of(core)) is not None else None
        if wakeup is not None:
            self.poller.register(wakeup, zmq.POLLIN)
        self.step_started: float | None = None  # read by the watchdog thread
        self.failed_steps = 0  # in a row
        self.gen_rate = GenRate()  # EngineState.gen_throughput
        self.gc_timer = process_gc_timer()  # EngineState.gc
        self.profiler = EngineProfiler()  # /start_profile, /stop_profile
        # /update_weights_from_disk: waits (admission paused) until no request runs
        self.weight_update: ipc.UpdateWeightsRequest | None = None
        watchdog = threading.Thread(target=self._watchdog, name="engine-watchdog", daemon=True)
        watchdog.start()

    def _watchdog(self) -> None:
        """Kill the engine when one step stalls past --watchdog-timeout: the server notices the
        exit, answers 503 on /health, fails in-flight requests and exits non-zero. A stuck step
        cannot be interrupted from Python, so ending the process is the only way out."""
        limit = self.core.config.watchdog_timeout
        while True:
            time.sleep(min(0.5, limit / 4))
            started = self.step_started
            if started is not None and time.monotonic() - started > limit:
                logger.error("a model step stalled for more than %.1f s; engine exiting", limit)
                os._exit(WATCHDOG_EXIT_CODE)

    def run(self) -> None:
        try:
            while True:
                wait = self.core.idle_wait()  # only KV transfers to wait for: sleep on them
                if not self.core.has_work() or wait is not None:
                    # blocks until a message, a transfer's end, a deadline or parent death
                    timeout = None if wait is None else int(wait * 1000) + 1
                    events = dict(self.poller.poll(timeout))
                    if self.parent_sentinel is not None and self.parent_sentinel in events:
                        logger.warning("server process died; engine exiting")
                        return
                if not self._drain():
                    return
                if self.core.has_work():
                    self._step()
                self._flush()
                if self.weight_update is not None and self.core.drained():
                    self._update_weights(self.weight_update)
        except Exception as e:  # noqa: BLE001 - reported to the server, which fails its requests
            logger.exception("engine loop failed")
            self.push.send(ipc.encode(ipc.EngineFailed(f"engine loop failed: {e}")))

    def _step(self) -> None:
        """One engine step. A step that raises ends the requests that were running, each with
        an abort naming the error (500), and the engine goes on with the rest; only a failure
        it cannot recover from (KV still held afterwards, or steps failing with nothing to
        end) ends it."""
        self.step_started = time.monotonic()
        begin = time.perf_counter()
        try:
            changed = self.core.step()
            self.failed_steps = 0
        except AssertionError:
            raise  # a broken invariant (--debug-leak-check among them): the engine must stop
        except Exception as e:  # noqa: BLE001 - isolated below, or re-raised
            changed = self._recover(e)
        finally:
            self.step_started = None
        tokens = 0
        for req in changed:
            tokens += self.output.add(req)
        self.gen_rate.add_step(begin, time.perf_counter(), tokens)
        if self.profiler.active:
            self._profile_step()

    def _recover(self, error: Exception) -> list[Req]:
        logger.exception("an engine step failed; aborting the running requests")
        message = f"the engine failed while running this request ({type(error).__name__}: {error})"
        ended = []
        for req in list(self.core.scheduler.running):
            if self.core.abort(req.rid, message) is not None:
                req.failed = message
                ended.append(req)
        kv = self.core.scheduler.kv_accounting()
        if kv["in_use"] or kv["locked"]:
            raise RuntimeError(f"cannot recover from a failed step ({error!r}): KV held {kv}")
        if not ended:  # nothing to blame: a step that fails again and again is a broken engine
            self.failed_steps += 1
            if self.failed_steps > MAX_FAILED_STEPS:
                raise error
        return ended

    def _drain(self) -> bool:
        """Handle every queued message; False on shutdown."""
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                msg = ipc.decode_inbound(data)
            except msgspec.DecodeError as e:
                self._refuse_undecodable(data, e)
                continue
            if not self._handle(msg):
                return False

    def _refuse_undecodable(self, data: bytes, error: msgspec.DecodeError) -> None:
        """A message the engine cannot decode (the server validates, so this is a bug there):
        refuse its request, if it names one, rather than stop the engine."""
        logger.error("undecodable message from the server: %s", error)
        try:
            rid = msgspec.msgpack.decode(data).get("rid")
        except (msgspec.DecodeError, AttributeError):
            return
        if isinstance(rid, str):
            req = Req(rid, [], SamplingParams())
            req.finish(
                FinishReason("abort", message=f"the engine cannot read the request: {error}")
            )
            self.output.add(req, error_status=400)

    def _handle(self, msg: ipc.EngineInbound) -> bool:
        core = self.core
        if isinstance(msg, ipc.GenerateRequest):
            req = Req(msg.rid, msg.input_ids, msg.sampling, msg.extra_key)
            req.logprob_start_len = msg.logprob_start_len
            req.pooling, req.label_token_ids = msg.pooling, msg.label_token_ids
            req.bootstrap = msg.bootstrap
            try:
                core.add_request(req)
            except InvalidRequest as e:
                req.finish(FinishReason("abort", message=str(e)))
                self.output.add(req, error_status=400)
            except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
                logger.exception("request %s could not be queued", msg.rid)
                message = f"the engine failed to queue the request ({type(e).__name__}: {e})"
                req.finish(FinishReason("abort", message=message))
                self.output.add(req, error_status=500)
        elif isinstance(msg, ipc.CancelRoomRequest):
            peer = (msg.host, msg.port) if msg.host else None
            core.cancel_room(msg.room, msg.message, peer, refused=msg.client_error)
        elif isinstance(msg, ipc.AbortRequest):
            aborted = core.abort(msg.rid, msg.message)
            if aborted is not None:
                self.output.add(aborted)
        elif isinstance(msg, ipc.StateRequest):
            self._flush()  # replies never overtake the deltas before them
            self.push.send(ipc.encode(self._state(msg.call_id)))
        elif isinstance(msg, ipc.FlushCacheRequest):
            self._flush()
            self.push.send(ipc.encode(ipc.FlushCacheReply(msg.call_id, core.flush_cache())))
        elif isinstance(msg, ipc.ProfileRequest):
            self._flush()
            self.push.send(ipc.encode(self._profile(msg)))
        elif isinstance(msg, ipc.UpdateWeightsRequest):
            if self.weight_update is not None:  # one at a time: the server serializes them
                reply = ipc.UpdateWeightsReply(
                    call_id=msg.call_id, success=False, num_paused_requests=0,
                    message="another weight update is in progress; retry when it has finished",
                )  # fmt: skip
                self.push.send(ipc.encode(reply))
            else:
                self.weight_update = msg
                core.pause_admission(True)
        elif isinstance(msg, ipc.ShutdownRequest):
            if self.profiler.active:
                self.profiler.stop()  # the trace so far is written, not lost
            if (connector := connector_of(core)) is not None:
                connector.close()  # its server and transfer agent, in order
            return False
        return True

    def _update_weights(self, msg: ipc.UpdateWeightsRequest) -> None:
        """Load the new weights now that no request runs, then let the waiting ones in."""
        held = len(self.core.scheduler.waiting)
        success, message = self.core.update_weights(msg.model_path)
        self.weight_update = None
        self.core.pause_admission(False)
        reply = ipc.UpdateWeightsReply(
            call_id=msg.call_id, success=success, message=message, num_paused_requests=held
        )
        self.push.send(ipc.encode(reply))

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

    def _profile_step(self) -> None:
        """Count a profiled step; the last of ``num_steps`` writes the trace."""
        try:
            self.profiler.after_step()
        except (OSError, ValueError):  # e.g. a path the file system refuses
            logger.exception("cannot write the profile trace")

    def _flush(self) -> None:
        out = self.output.take()
        if out is not None:
            self.push.send(ipc.encode(out))

    def _state(self, call_id: int) -> ipc.EngineState:
        sched = self.core.scheduler
        return ipc.EngineState(
            call_id=call_id,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv=sched.kv_accounting(),
            cache_hit_rate=sched.stats.cache_hit_rate,
            retractions=sched.stats.retractions,
            steps=sched.stats.steps,
            speculative=self.core.spec_stats(),
            gen_throughput=self.gen_rate.per_second(),
            num_grammar_queue=len(self.core.grammars),
            steps_by_kind={k: v.to_json() for k, v in sched.stats.by_kind.items()},
            gc=self.gc_timer.to_json(),
        )
