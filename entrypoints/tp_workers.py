"""The ranks 1..N-1 of a tensor-parallel engine: starting them, their process loop, and telling
why one ended.

Rank 0 is the engine itself (the server's engine process, or the offline Engine's thread); it
schedules and broadcasts each step (core/tp_step.py). The other ranks only build their share of
the model and follow. Whoever starts the ranks (the server's EngineClient, the offline Engine)
watches every rank's process sentinel: one rank's death ends the engine at once, and the
parent kills the rest, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # core.distributed imports torch; --help and the server process need not
    from radixserve.core.distributed import Rendezvous

logger = logging.getLogger(__name__)

#: exit code of a rank that stops because its parent (the server or the Engine's process) died
ORPHANED_EXIT_CODE = 75


def world_size(settings: dict[str, Any]) -> int:
    """The engine's ranks for EngineConfig fields ``settings``: tp_size x pp_size."""
    return int(settings.get("tp_size") or 1) * int(settings.get("pp_size") or 1)


def rank_label(rank: int, size: int, pp_size: int) -> str:
    """How a rank is named where it ended: its tensor-parallel rank, and with pipeline stages
    also its engine rank and stage (rank = stage * tp_size + tensor-parallel rank)."""
    if pp_size == 1:
        return f"tensor-parallel rank {rank}"
    stage, tp_rank = divmod(rank, size // pp_size)
    return f"engine rank {rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"


def rendezvous(size: int, timeout_s: float, pp_size: int = 1) -> list[Rendezvous]:
    """One Rendezvous per rank, meeting through a file store in a private (0700) directory:
    no TCP key-value store listens on the host for anyone to write into. (gloo's and NCCL's own
    connections between the ranks stay on loopback.)"""
    from radixserve.core.distributed import Rendezvous

    directory = tempfile.mkdtemp(prefix="radixserve-tp-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    init = f"file://{directory}/store"
    return [Rendezvous(init, r, size, timeout_s, pp_size) for r in range(size)]


#: Why a spawned rank that died before reaching ``run_worker`` most likely did (describe_exit).
UNGUARDED_MAIN_HINT = (
    "before it started: a spawned rank first re-imports the main module of the program that "
    "started it, so a script that creates the engine at its top level must do so under "
    '`if __name__ == "__main__":` (and a program read from stdin cannot start '
    "tensor-parallel ranks: save it to a file); the rank's traceback is above"
)


def start_workers(settings: dict[str, Any], ranks: Sequence[Rendezvous]) -> list[BaseProcess]:
    """Spawn one process per rank in ``ranks`` (not rank 0); ``settings`` are EngineConfig
    fields, as the engine process gets them. Each rank says when it has started (its main
    module imported): ``wait_started``, ``describe_exit``."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rdv in ranks:
        started, tell = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=run_worker, args=(settings, rdv, tell), name=f"radixserve-tp{rdv.rank}",
            daemon=True,
        )  # fmt: skip
        proc.start()
        tell.close()  # the rank holds the only writer: its death reads as end of file
        proc._radixserve_label = rank_label(rdv.rank, rdv.size, rdv.pp_size)  # type: ignore[attr-defined]
        proc._radixserve_started = started  # type: ignore[attr-defined]
        procs.append(proc)
    return procs


def wait_started(procs: Sequence[tuple[int, BaseProcess]], timeout_s: float) -> None:
    """Return once every rank of ``procs`` ((rank, process) pairs from ``start_workers``) has
    started, or ``timeout_s`` passed; RuntimeError (``describe_exit``) as soon as one died
    before it started. Rank 0 calls this before it waits for the others in the rendezvous,
    which would otherwise only end at its timeout (minutes) when a rank died at start-up."""
    deadline = time.monotonic() + timeout_s
    for rank, proc in procs:
        if _started(proc, max(0.0, deadline - time.monotonic())) is False:
            proc.join(5)  # its end of the pipe closed as it exited: the exit code follows
            raise RuntimeError(describe_exit(rank, proc))


def _started(proc: BaseProcess, timeout_s: float = 0.0) -> bool | None:
    """Whether ``proc`` (from ``start_workers``) said it started (True) or ended without a
    word (False), waiting up to ``timeout_s`` for either; None while it is still starting."""
    known: bool | None = getattr(proc, "_radixserve_started_known", None)
    conn = getattr(proc, "_radixserve_started", None)
    if known is not None or conn is None:  # decided, or not one of ours: nothing to tell
        return True if conn is None else known
    if not wait([conn], timeout_s):
        return None
    try:
        known = bool(conn.recv())
    except (EOFError, OSError):  # the process is gone without a word
        known = False
    proc._radixserve_started_known = known  # type: ignore[attr-defined]
    conn.close()
    return known


def run_worker(settings: dict[str, Any], rdv: Rendezvous, started: Any = None) -> None:
    """Process entry of rank ``rdv.rank`` > 0: build this rank's ModelRunner, then run the
    steps rank 0 broadcasts until it says stop. ``started``: a connection told once this
    process has got this far (its main module imported)."""
    if started is not None:
        started.send(True)
        started.close()
    from radixserve.core.config import ConfigError
    from radixserve.core.distributed import teardown
    from radixserve.core.model_runner import ModelRunner
    from radixserve.core.plugins import PluginError
    from radixserve.entrypoints.engine_process import engine_config
    from radixserve.entrypoints.process_exit import exit_now

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks stop
    logging.basicConfig(
        level=str(settings.get("log_level", "warning")).upper(),
        format=f"%(asctime)s engine rank {rdv.rank} %(levelname)s %(name)s: %(message)s",
    )
    _exit_with_parent()
    try:
        host, model_dir, config = engine_config(settings)
        runner = ModelRunner(model_dir, config, host, rdv)
    except (ConfigError, PluginError) as e:  # rank 0 meets the same setting and reports it
        logger.error("rank %d not started: %s", rdv.rank, e)
        teardown()
        sys.exit(2)
    try:
        steps = runner.ranks.follow(runner.req_to_token, runner.kv_pool, runner.device,
                                    runner.step)  # fmt: skip
        logger.info("rank %d stopped after %d steps", rdv.rank, steps)
    finally:
        runner.close()  # captured collectives go before the group does
    # Nothing of this process is needed any more: skip the interpreter's finalisers (device
    # and communicator destructors have hung at exit after CUDA graphs held collectives).
    exit_now(0)


def _exit_with_parent() -> None:
    """End this rank as soon as its parent process dies (a SIGKILLed server runs no cleanup),
    whatever the rank is waiting in."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(ORPHANED_EXIT_CODE)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def watch(procs: Sequence[tuple[int, BaseProcess]], on_death: Callable[[str], None]) -> None:
    """Call ``on_death(reason)`` from a daemon thread when the first of ``procs`` ((rank,
    process) pairs) exits, whatever its exit code: ranks only stop when told to, and the
    parent stops watching first (``stop_watching``)."""
    sentinels = {p.sentinel: (rank, p) for rank, p in procs}

    def run() -> None:
        ready = wait(list(sentinels))
        rank, proc = sentinels[ready[0]]  # type: ignore[index]
        proc.join(1)
        if not getattr(proc, "_radixserve_stopping", False):
            on_death(describe_exit(rank, proc))

    threading.Thread(target=run, name="tp-rank-watch", daemon=True).start()


def stop_watching(procs: Sequence[BaseProcess]) -> None:
    """An orderly stop follows: the exits of ``procs`` are expected now."""
    for p in procs:
        p._radixserve_stopping = True  # type: ignore[attr-defined]


def describe_exit(rank: int, proc: BaseProcess) -> str:
    """One line: which rank ended and how (exit code or signal)."""
    code = proc.exitcode
    if code is None:
        how = "stopped responding"
    elif code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    if code is not None and _started(proc) is False:
        how += f" {UNGUARDED_MAIN_HINT}"
    label = getattr(proc, "_radixserve_label", None) or f"tensor-parallel rank {rank}"
    return f"{label} (pid {proc.pid}) {how}"


def first_dead(procs: Sequence[tuple[int, BaseProcess]]) -> str | None:
    """``describe_exit`` of the first process of ``procs`` that is no longer alive, else None."""
    for rank, proc in procs:
        if not proc.is_alive():
            return describe_exit(rank, proc)
    return None


def end_all(procs: Sequence[BaseProcess], grace_s: float) -> None:
    """Wait up to ``grace_s`` for ``procs`` to exit, then terminate, then kill what is left."""
    stop_watching(procs)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.kill()
            p.join()
