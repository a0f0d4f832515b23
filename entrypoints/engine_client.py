"""The server side of the engine sockets: starting the engine process, sending requests and
receiving its outputs in an asyncio task.

The server binds both IPC sockets in a private temporary directory before it spawns the engine,
so nothing is lost whichever side comes up first. No TCP, no pickle.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from radixserve.entrypoints import ipc, multinode, tp_workers

logger = logging.getLogger(__name__)


# Queued engine messages applied in a row before the loop lets other tasks run.
MAX_DRAINED = 256
# The engine process's entry, by name: the new process imports it, so this one (the HTTP
# process) never imports torch or the model code to start it.
ENGINE_ENTRY = "radixserve.entrypoints.engine_process:run_engine"
# Replies to ``call``, matched to their caller by call_id.
_REPLIES = (
    ipc.EngineState, ipc.FlushCacheReply, ipc.ProfileReply, ipc.UpdateWeightsReply, ipc.LoraReply,
    ipc.SessionReply,
)  # fmt: skip


class EngineDied(RuntimeError):
    """The engine process failed or exited; the message says why."""


class EngineClient:
    """Owns the engine process and both sockets. ``on_step`` receives every StepOutput;
    ``on_death`` is called once if the engine fails or exits."""

    def __init__(self) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="radixserve-ipc-")
        self.ctx = zmq.asyncio.Context()
        # No high-water marks: a full queue must never drop or refuse a request or an output.
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.bind(f"ipc://{self.ipc_dir}/engine_in")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(f"ipc://{self.ipc_dir}/engine_out")
        self.process: BaseProcess | None = None
        self.workers: list[BaseProcess] = []  # tensor-parallel ranks 1..N-1 (of this node)
        self.nodes: multinode.NodeWatch | None = None  # node 0 of several: the other nodes
        self.dead: str | None = None
        self.on_step: Callable[[ipc.StepOutput], None] = lambda _: None
        self.on_death: Callable[[str], None] = lambda _: None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._task: asyncio.Task[None] | None = None

    def start_process(self, settings: dict[str, Any]) -> None:
        from radixserve.entrypoints.process_exit import run_then_exit

        ctx = multiprocessing.get_context("spawn")
        size, pp = tp_workers.world_size(settings), int(settings.get("pp_size") or 1)
        if multinode.nodes(settings) > 1:  # this node's ranks; the others follow elsewhere
            self.nodes = multinode.NodeWatch(settings)
            ranks = multinode.rendezvous(settings)
        else:  # (with one rank, none: torch.distributed is not imported here)
            timeout = float(settings.get("watchdog_timeout") or 300)
            ranks = tp_workers.rendezvous(size, timeout, pp) if size > 1 else []
        self.process = ctx.Process(
            target=run_then_exit,  # no interpreter teardown after the engine stopped
            args=(
                ENGINE_ENTRY, settings,
                f"ipc://{self.ipc_dir}/engine_in", f"ipc://{self.ipc_dir}/engine_out",
                ranks[0] if ranks else None,
            ),
            name="radixserve-engine",
            daemon=True,
        )  # fmt: skip
        self.process.start()
        self.process._radixserve_label = tp_workers.rank_label(0, size, pp)  # type: ignore[attr-defined]
        if len(ranks) > 1:
            self.workers = tp_workers.start_workers(settings, ranks[1:])

    def _ranks(self) -> list[tuple[int, BaseProcess]]:
        procs = [] if self.process is None else [self.process, *self.workers]
        return list(enumerate(procs))

    async def wait_ready(self) -> ipc.EngineReady:
        """Wait (as long as the engine lives) for its ready message; EngineDied otherwise."""
        while True:
            if await self.pull.poll(1000):
                msg = ipc.decode_outbound(await self.pull.recv())
                if isinstance(msg, ipc.EngineReady):
                    return msg
                if isinstance(msg, ipc.EngineFailed):
                    raise EngineDied(msg.message)
                raise EngineDied(f"unexpected first message from the engine: {type(msg).__name__}")
            if not self._alive():
                why = self._why_dead()
                # a rank that refused a setting: rank 0 refuses it too, and says why
                rank0 = self.process is not None and self.process.is_alive()
                if self.workers and rank0 and await self.pull.poll(3000):
                    continue
                raise EngineDied(why)

    def start_receiving(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._receive_loop())
        if self.workers:  # one rank's death ends the engine now, not at the next poll
            tp_workers.watch(self._ranks(), lambda why: loop.call_soon_threadsafe(self._die, why))
        if self.nodes is not None:  # so does another node's
            self.nodes.on_death = lambda why: loop.call_soon_threadsafe(self._die, why)
            if self.nodes.dead is not None:
                self._die(self.nodes.dead)

    def send(self, message: Any) -> None:
        self.send_encoded(ipc.encode(message))

    def send_encoded(self, data: bytes) -> None:
        """Send a message already encoded with ``ipc.encode``."""
        if self.dead is not None:
            raise EngineDied(self.dead)
        # A PUSH socket with a live peer never blocks here; NOBLOCK keeps the loop safe anyway.
        self.push.send(data, zmq.NOBLOCK)

    async def call(self, make: Callable[[int], Any], timeout: float = 30.0) -> Any:
        """Send a request built from a fresh call id and await the engine's reply to it."""
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self.send(make(call_id))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def _receive_loop(self) -> None:
        while self.dead is None:
            # The timeout only serves to notice an engine that vanished without a word.
            if not await self.pull.poll(2000):
                if not self._alive():
                    self._die(self._why_dead())
                continue
            self._dispatch(ipc.decode_outbound(await self.pull.recv()))
            # Apply every output already queued before the streams run: each await above lets
            # all of them send an event, so a server that fell behind the engine (256 streams,
            # a step every 3 ms) sent one event per stream per step and stayed behind, seconds
            # late on H200; drained, each stream sends one event with all its new tokens.
            for _ in range(MAX_DRAINED):
                if self.dead is not None:
                    break
                try:
                    data = await self.pull.recv(zmq.NOBLOCK)  # done at once: no yield
                except zmq.Again:
                    break
                self._dispatch(ipc.decode_outbound(data))

    def _dispatch(self, msg: ipc.EngineOutbound) -> None:
        if isinstance(msg, ipc.StepOutput):
            self.on_step(msg)
        elif isinstance(msg, _REPLIES):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, ipc.EngineFailed):
            # rank 0 fails when another rank died under it: name the cause
            why = tp_workers.first_dead(self._ranks()[1:])
            if why is None and self.nodes is not None:  # one of another node's, maybe
                why = self.nodes.word(multinode.WORD_WAIT_S)
            self._die(why or msg.message)

    def check_alive(self) -> str | None:
        """Notice a vanished engine now (health probes must not wait for the receive loop's
        poll timeout); return why it is dead, or None."""
        if self.dead is None and self.process is not None and not self._alive():
            self._die(self._why_dead())
        return self.dead

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        logger.error("engine died: %s", reason)
        self.dead = reason
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDied(reason))
        self.on_death(reason)

    def _alive(self) -> bool:
        if self.nodes is not None and self.nodes.dead is not None:
            return False
        return self.process is not None and all(p.is_alive() for _, p in self._ranks())

    def _why_dead(self) -> str:
        if self.nodes is not None and self.nodes.dead is not None:
            return self.nodes.dead
        if not self.workers:
            code = None if self.process is None else self.process.exitcode
            return f"the engine process exited with code {code}"
        return tp_workers.first_dead(self._ranks()) or "the engine process exited"

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (politely, then by force) and remove the sockets."""
        if self._task is not None:
            self._task.cancel()
        proc = self.process
        tp_workers.stop_watching([p for _, p in self._ranks()])  # exits are expected now
        if self.nodes is not None:  # and so are the other nodes' (rank 0 stops them)
            if self.dead is None:
                self.nodes.announce_stop()
            self.nodes.stopping = True
        if self.dead is not None and (self.workers or self.nodes is not None):
            # a rank died: the others may wait in a collective for it; end them now
            tp_workers.end_all([p for _, p in self._ranks()], 0.0)
        if proc is not None and proc.is_alive():
            if self.dead is None:
                try:
                    self.push.send(ipc.encode(ipc.ShutdownRequest()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the socket is gone; terminate below
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self.workers:  # rank 0 stopped them on its way out; any left are ended
            tp_workers.end_all(self.workers, timeout)
        if self.nodes is not None:
            self.nodes.close()
        self.push.close(linger=0)
        self.pull.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
