"""The engine process loop's second line (issue 13), on a fake core over inproc sockets: a step
that raises ends the running requests with a 500 and the loop goes on; steps that keep failing
with nothing to end stop the engine (EngineFailed); a message the engine cannot decode is
refused alone."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from radixserve.core.request import FinishReason, Req, SamplingParams
from radixserve.entrypoints import ipc
from radixserve.entrypoints.engine_loop import MAX_FAILED_STEPS
from radixserve.entrypoints.engine_process import server_loop

HANG_GUARD_MS = 60_000


class FakeCore:
    """Runs requests for one step each; ``fail`` makes steps raise, ``busy`` makes it step with
    nothing running. Only EngineCore's public methods that the loop calls."""

    config = types.SimpleNamespace(watchdog_timeout=300.0)
    wakeup_fd = None  # not a prefill or decode server

    def __init__(self) -> None:
        self.running: list[Req] = []
        self.fail = False
        self.busy = False
        self.steps = 0

    def add_request(self, req: Req) -> None:
        self.running.append(req)

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                req.finish(FinishReason("abort", message=message))
                return req
        return None

    def running_rids(self) -> list[str]:
        return [req.rid for req in self.running]

    def kv_accounting(self) -> dict[str, int]:
        return {"in_use": 0, "locked": 0, "pinned": 0}

    def close_transfers(self) -> None:
        pass

    def has_work(self) -> bool:
        return self.busy or bool(self.running)

    def idle_wait(self) -> float | None:
        return None  # never only waiting for KV transfers

    def step(self) -> list[Req]:
        self.steps += 1
        if self.fail:
            raise RuntimeError("a bug in the step")
        done, self.running = self.running, []
        for req in done:
            req.output_ids.append(1)
            req.finish(FinishReason("length", length=1))
        return done


@pytest.fixture
def loop() -> Iterator[tuple[FakeCore, zmq.Socket, zmq.Socket, threading.Thread]]:
    ctx = zmq.Context()
    to_engine, engine_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_out, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_in.bind("inproc://in")
    to_engine.connect("inproc://in")
    from_engine.bind("inproc://out")
    engine_out.connect("inproc://out")
    core = FakeCore()
    thread = threading.Thread(target=server_loop(core, engine_in, engine_out).run, daemon=True)  # type: ignore[arg-type]
    thread.start()
    yield core, to_engine, from_engine, thread
    to_engine.send(ipc.encode(ipc.ShutdownRequest()))
    thread.join(HANG_GUARD_MS / 1000)
    for sock in (to_engine, engine_in, engine_out, from_engine):
        sock.close(linger=0)
    ctx.term()


def receive(sock: zmq.Socket) -> Any:
    assert sock.poll(HANG_GUARD_MS), "no message from the engine loop"
    return ipc.decode_outbound(sock.recv())


def only_output(out: ipc.StepOutput) -> tuple[str, ipc.ReqExtras]:
    """The rid and extras of a step output that holds one request."""
    (rid,) = out.rids
    return rid, out.extras[0]


def generate(rid: str) -> bytes:
    return ipc.encode(ipc.GenerateRequest(rid=rid, input_ids=[1, 2], sampling=SamplingParams()))


def test_a_failing_step_ends_the_running_requests_and_the_loop_goes_on(loop: Any) -> None:
    core, to_engine, from_engine, thread = loop
    core.fail = True
    to_engine.send(generate("victim"))
    rid, extras = only_output(receive(from_engine))
    assert rid == "victim" and extras.error_status == 500
    assert "the engine failed while running this request (RuntimeError: a bug" in (
        extras.finish.message
    )
    core.fail = False
    to_engine.send(generate("next"))
    rid, extras = only_output(receive(from_engine))
    assert rid == "next" and extras.error_status == 0 and extras.finish.type == "length"
    assert thread.is_alive()


def test_steps_failing_with_nothing_to_end_stop_the_engine(loop: Any) -> None:
    core, to_engine, from_engine, thread = loop
    core.fail = core.busy = True
    to_engine.send(ipc.encode(ipc.AbortRequest("nobody")))  # wakes the loop; nothing runs
    msg = receive(from_engine)
    assert isinstance(msg, ipc.EngineFailed)
    assert "a bug in the step" in msg.message
    thread.join(HANG_GUARD_MS / 1000)
    assert not thread.is_alive() and core.steps == MAX_FAILED_STEPS + 1


def test_an_undecodable_request_is_refused_alone(loop: Any) -> None:
    core, to_engine, from_engine, thread = loop
    bad = msgspec.msgpack.encode({"type": "generate", "rid": "odd", "input_ids": "not ids"})
    to_engine.send(bad)
    rid, extras = only_output(receive(from_engine))
    assert rid == "odd" and extras.error_status == 400
    assert "the engine cannot read the request" in extras.finish.message
    to_engine.send(generate("fine"))
    rid, extras = only_output(receive(from_engine))
    assert rid == "fine" and extras.error_status == 0
    assert thread.is_alive()
