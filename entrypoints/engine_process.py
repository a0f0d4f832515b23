"""The engine process: builds EngineCore and serves it over two ZMQ IPC sockets.

It runs the engine's one loop (entrypoints/engine_loop.py) over ``ZmqTransport``: block on the
inbound socket while idle (no busy polling; the parent's death also wakes it), drain every
queued message, run one step, push one ``StepOutput`` of what changed. A watchdog ends the
process when a step stalls. Started by the launcher with the multiprocessing spawn context; all
arguments are plain data.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.distributed import Rendezvous
from radixserve.core.engine_core import EngineCore
from radixserve.core.lora_strategy import lora_of
from radixserve.core.plugins import PluginError, PluginHost, default_host
from radixserve.core.request import FinishReason, Req, SamplingParams
from radixserve.entrypoints import ipc
from radixserve.entrypoints.engine_loop import EngineLoop, Inbound, Transport
from radixserve.entrypoints.gc_timer import freeze_if_asked, process_gc_timer
from radixserve.entrypoints.step_output import StepOutputBuilder

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 70  # EX_SOFTWARE


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
        core.bind_server_engine()
        push.send(ipc.encode(_ready(core)))
        # each new grammar compiles in a capped sandbox first: no request's grammar can take
        # the engine's time or memory
        core.isolate_grammar_compiles()
        freeze_if_asked()
        loop = server_loop(core, pull, push)
        start_watchdog(loop, core.config.watchdog_timeout)
        loop.run()
    finally:
        if core is not None:
            core.close_runner()  # the other tensor-parallel ranks leave their step loops
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


def _ready(core: EngineCore) -> ipc.EngineReady:
    return ipc.EngineReady(
        model_dir=str(core.config.model_path),
        max_context=core.max_context,
        kv_size=core.kv_size,
        vocab_size=core.vocab_size,
        eos_token_ids=list(core.eos_token_ids),
        plugins=core.plugin_names(),
        max_running_requests=core.max_running_requests,
        settings=core.settings_summary(),
        speculative=core.spec_stats(),
        disaggregation_mode=core.config.disaggregation_mode,
        lora_adapters=lora.names() if (lora := lora_of(core)) is not None else None,
        numerics=core.numerics(),
    )


def server_loop(core: EngineCore, pull: zmq.Socket, push: zmq.Socket) -> EngineLoop:
    """The engine loop over the server's sockets."""
    transport = ZmqTransport(core, pull, push)
    return EngineLoop(core, transport, isolate_failures=True, gc_timer=process_gc_timer())


def start_watchdog(loop: EngineLoop, limit: float) -> None:
    threading.Thread(
        target=_watchdog, args=(loop, limit), name="engine-watchdog", daemon=True
    ).start()


def _watchdog(loop: EngineLoop, limit: float) -> None:
    """Kill the engine when one step stalls past --watchdog-timeout: the server notices the
    exit, answers 503 on /health, fails in-flight requests and exits non-zero. A stuck step
    cannot be interrupted from Python, so ending the process is the only way out."""
    while True:
        time.sleep(min(0.5, limit / 4))
        started = loop.step_started
        if started is not None and time.monotonic() - started > limit:
            logger.error("a model step stalled for more than %.1f s; engine exiting", limit)
            os._exit(WATCHDOG_EXIT_CODE)


class ZmqTransport(Transport):
    """The server's side of the loop: msgspec messages over a PULL and a PUSH socket; the
    step's changes go out as one StepOutput per turn (StepOutputBuilder remembers what each
    live request has been sent)."""

    def __init__(self, core: EngineCore, pull: zmq.Socket, push: zmq.Socket) -> None:
        self.pull = pull
        self.push = push
        self.output = StepOutputBuilder()
        self.poller = zmq.Poller()
        self.poller.register(pull, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        self.parent_sentinel = parent.sentinel if parent is not None else None
        if self.parent_sentinel is not None:
            self.poller.register(self.parent_sentinel, zmq.POLLIN)
        # disaggregation: the KV connector wakes the loop when a transfer ends
        if core.wakeup_fd is not None:
            self.poller.register(core.wakeup_fd, zmq.POLLIN)

    def wait(self, timeout: float | None) -> bool:
        # blocks until a message, a transfer's end, a deadline or parent death
        events = dict(self.poller.poll(None if timeout is None else int(timeout * 1000) + 1))
        return self.parent_sentinel is None or self.parent_sentinel not in events

    def receive(self) -> Iterator[Inbound]:
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                yield ipc.decode_inbound(data)
            except msgspec.DecodeError as e:
                self._refuse_undecodable(data, e)

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

    def deliver(self, req: Req, error_status: int = 0) -> int:
        return self.output.add(req, error_status)

    def flush(self) -> None:
        out = self.output.take()
        if out is not None:
            self.push.send(ipc.encode(out))

    def reply(self, msg: ipc.EngineOutbound) -> None:
        self.push.send(ipc.encode(msg))

    def close(self, error: Exception | None, handling: Inbound | None) -> None:
        # the server fails every request it still has once it reads this (or sees the exit)
        if error is not None:
            self.push.send(ipc.encode(ipc.EngineFailed(f"engine loop failed: {error}")))
