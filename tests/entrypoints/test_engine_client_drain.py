"""The server's receive loop applies every engine output already queued before its streams
run, so a server behind the engine sends each stream one event with all its new tokens instead
of one event per engine step (which kept it behind: H200, bench/HISTORY.md)."""

from __future__ import annotations

import asyncio
import time

import zmq

from radixserve.entrypoints import ipc
from radixserve.entrypoints.engine_client import EngineClient

QUEUED = 5


async def _receive_with_a_rival(client: EngineClient) -> list[str]:
    """Run the receive loop beside a task that notes each time it gets the loop."""
    log: list[str] = []
    client.on_step = lambda out: log.append(out.rids[0])

    async def rival() -> None:
        while True:
            log.append("rival")
            await asyncio.sleep(0)

    other = asyncio.create_task(rival())
    await asyncio.sleep(0)  # the rival runs first
    await asyncio.wait_for(client._receive_loop(), 30)  # ends at EngineFailed
    other.cancel()
    return log


def test_queued_outputs_are_applied_without_letting_streams_run_between() -> None:
    client = EngineClient()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(f"ipc://{client.ipc_dir}/engine_out")
    try:
        for i in range(QUEUED):
            step = ipc.StepOutput(rids=[f"r{i}"], num_tokens=[1], token_ids=[i], text_deltas=[""])
            push.send(ipc.encode(step))
        push.send(ipc.encode(ipc.EngineFailed("test over")))
        time.sleep(0.5)  # let the IPC socket take them all in before the loop starts
        log = asyncio.run(_receive_with_a_rival(client))
        steps = [i for i, x in enumerate(log) if x != "rival"]
        assert [log[i] for i in steps] == [f"r{i}" for i in range(QUEUED)]
        assert steps == list(range(steps[0], steps[0] + QUEUED)), log  # no rival between
        assert client.dead == "test over"
    finally:
        push.close(linger=0)
        client.shutdown()
