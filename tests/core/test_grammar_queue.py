"""GrammarQueue: compilation on worker threads, the shared LRU cache, errors and timeouts, with a
fake backend whose compile can be held."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from allow_all_grammar import AllowAllGrammar

from radixserve.core import grammar_queue
from radixserve.core.grammar_queue import GrammarQueue
from radixserve.core.interfaces import Grammar, GrammarBackend
from radixserve.core.request import Req, SamplingParams

HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it


class FakeGrammar(AllowAllGrammar):
    def __init__(self, spec: str) -> None:
        self.spec = spec

    def copy(self) -> Grammar:
        return FakeGrammar(self.spec)


class FakeBackend(GrammarBackend):
    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.release = threading.Event()
        self.release.set()

    def compile(self, kind: str, spec: str) -> Grammar:
        self.compiled.append(spec)
        if spec.startswith("slow"):
            self.release.wait(HANG_GUARD_S)
        if spec.startswith("bad"):
            raise ValueError(f"no such thing as {spec!r}")
        return FakeGrammar(spec)


def req(rid: str, regex: str) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams(regex=regex))


def drain(queue: GrammarQueue, n: int) -> tuple[list[Req], list[Req]]:
    ready: list[Req] = []
    failed: list[Req] = []
    deadline = time.monotonic() + HANG_GUARD_S
    while len(ready) + len(failed) < n and time.monotonic() < deadline:
        queue.wait()
        r, f = queue.pop_done()
        ready += r
        failed += f
    return ready, failed


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def make_queue(backend: FakeBackend, timeout_s: float = 5.0) -> GrammarQueue:
    return GrammarQueue("fake", lambda: backend, timeout_s)


def test_same_spec_compiles_once_and_each_request_gets_its_own_matcher(
    backend: FakeBackend,
) -> None:
    queue = make_queue(backend)
    reqs = [req("a", "x+"), req("b", "x+"), req("c", "y+")]
    for r in reqs:
        queue.submit(r)
    ready, failed = drain(queue, 3)
    assert not failed and {r.rid for r in ready} == {"a", "b", "c"}
    assert sorted(backend.compiled) == ["x+", "y+"]
    assert reqs[0].grammar is not reqs[1].grammar and reqs[0].grammar.spec == "x+"
    queue.submit(req("d", "x+"))  # cached: no new compilation
    assert drain(queue, 1)[0][0].rid == "d" and sorted(backend.compiled) == ["x+", "y+"]
    assert len(queue) == 0


def test_compile_error_ends_only_that_request_and_is_not_cached(backend: FakeBackend) -> None:
    queue = make_queue(backend)
    queue.submit(req("bad", "bad["))
    queue.submit(req("good", "z"))
    ready, failed = drain(queue, 2)
    assert [r.rid for r in ready] == ["good"] and [r.rid for r in failed] == ["bad"]
    reason = failed[0].finish_reason
    assert reason is not None and reason.type == "abort"
    assert reason.message == "regex rejected by grammar backend 'fake': no such thing as 'bad['"
    queue.submit(req("bad2", "bad["))
    assert drain(queue, 1)[1][0].rid == "bad2"
    assert backend.compiled.count("bad[") == 2


def test_timeout_ends_the_request_and_others_go_on(backend: FakeBackend, clock: SplitClock) -> None:
    """A compile still running at its deadline ends its request; another one compiles on. The
    split clock sets the times, so no outcome depends on how fast the threads run."""
    backend.release.clear()
    queue = make_queue(backend, timeout_s=1.0)
    assert queue.backend is backend  # built at t=0, so the deadline is t=1
    queue.submit(req("slow", "slow+"))
    queue.submit(req("fast", "f"))
    ready, failed = drain(queue, 1)  # at t=0: "fast" is ready, "slow" still compiling
    assert [r.rid for r in ready] == ["fast"] and not failed
    clock.engine = 1.0  # the deadline, with "slow" still held
    ready, failed = queue.pop_done()
    assert not ready and [r.rid for r in failed] == ["slow"]
    message = failed[0].finish_reason.message  # type: ignore[union-attr]
    assert "regex did not compile within grammar_compile_timeout=1s" in message
    backend.release.set()
    queue.shutdown()


def test_wait_returns_when_a_compile_finishes(
    backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wait() returns when the compile ends, long before its own timeout or the deadline (an
    hour each here): the waiting thread finishes although wait() could sleep an hour."""
    waiting = threading.Event()
    real_wait = grammar_queue.wait

    def traced_wait(*args: Any, **kwargs: Any) -> Any:
        waiting.set()
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(grammar_queue, "wait", traced_wait)
    backend.release.clear()
    queue = make_queue(backend, timeout_s=3600.0)
    queue.submit(req("slow", "slow1"))
    waiter = threading.Thread(target=queue.wait, kwargs={"timeout_s": 3600.0}, daemon=True)
    waiter.start()
    assert waiting.wait(HANG_GUARD_S)
    backend.release.set()  # the compile ends while wait() sleeps
    waiter.join(HANG_GUARD_S)
    assert not waiter.is_alive(), "wait() did not return when the compile finished"
    assert [r.rid for r in queue.pop_done()[0]] == ["slow"]


def test_abort_while_compiling(backend: FakeBackend) -> None:
    backend.release.clear()
    queue = make_queue(backend)
    queue.submit(req("slow", "slow2"))
    aborted = queue.abort("slow", "aborted by the client")
    assert aborted is not None and aborted.finished and len(queue) == 0
    assert queue.abort("slow", "again") is None
    backend.release.set()


def test_lru_evicts_the_least_recently_used(
    backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grammar_queue, "CACHE_SIZE", 2)
    queue = make_queue(backend)
    for i, spec in enumerate(["a", "b", "a", "c", "a", "b"]):
        queue.submit(req(str(i), spec))
        drain(queue, 1)
    # "b" was least recently used when "c" came in, so it compiles twice; "a" stays cached.
    assert backend.compiled == ["a", "b", "c", "b"]


class SplitClock:
    """``time`` for grammar_queue: the engine (main) thread and the compile workers each read
    their own clock, so a test sets how long a compile took and when the engine polls."""

    def __init__(self) -> None:
        self.engine = 0.0
        self.worker = 0.0

    def monotonic(self) -> float:
        main = threading.current_thread() is threading.main_thread()
        return self.engine if main else self.worker


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SplitClock:
    split = SplitClock()
    monkeypatch.setattr(grammar_queue, "time", split)
    return split


def test_a_compile_that_ends_after_the_deadline_is_refused_however_early_the_poll(
    backend: FakeBackend, clock: SplitClock
) -> None:
    backend.release.clear()
    queue = make_queue(backend, timeout_s=1.0)
    assert queue.backend is backend  # built at t=0, so the deadline is t=1
    queue.submit(req("late", "slow+"))
    deadline = time.monotonic() + HANG_GUARD_S
    while not backend.compiled and time.monotonic() < deadline:
        time.sleep(0.001)  # until a worker has taken it up, at t=0
    clock.worker = 2.0  # the compile finishes at t=2
    backend.release.set()
    ready, failed = drain(queue, 1)  # every poll at t=0: the result is there before the deadline
    assert not ready and [r.rid for r in failed] == ["late"]
    message = failed[0].finish_reason.message  # type: ignore[union-attr]
    assert "regex did not compile within grammar_compile_timeout=1s" in message


def test_a_compile_that_ends_in_time_is_accepted_however_late_the_poll(
    backend: FakeBackend, clock: SplitClock
) -> None:
    queue = make_queue(backend, timeout_s=10.0)
    assert queue.backend is backend  # built at t=0
    clock.worker = 5.0  # finishes at t=5, within the deadline t=10
    queue.submit(req("on-time", "x+"))
    queue.wait(timeout_s=5.0)  # returns once the compile is done (the engine clock stays at 0)
    clock.engine = 50.0  # the engine polls long after the deadline
    ready, failed = queue.pop_done()
    assert [r.rid for r in ready] == ["on-time"] and not failed


def test_the_cache_is_bounded_by_the_compiled_grammars_size(
    backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many large distinct grammars cannot grow the engine's memory without bound: past
    CACHE_BYTES the oldest compiled grammars leave the cache (issue 13)."""
    monkeypatch.setattr(grammar_queue, "CACHE_BYTES", 250)
    monkeypatch.setattr(FakeGrammar, "memory_bytes", lambda self: 100, raising=False)
    queue = make_queue(backend)
    for i in range(5):
        queue.submit(req(f"r{i}", f"a{i}"))
        assert drain(queue, 1)[0][0].rid == f"r{i}"
    assert [key[2] for key in queue._cache] == ["a3", "a4"]
    queue.submit(req("again", "a0"))  # left the cache: compiled anew
    drain(queue, 1)
    assert backend.compiled.count("a0") == 2


class HeldSandbox:
    """Stands in for GrammarSandbox: a start that waits for the test (``starts``) and a probe
    that a spec named "runaway" ends as a sandbox past its limits does."""

    starts: list[threading.Event] = []
    starting = threading.Event()  # set once a held start has begun

    def __init__(self, spec: Any) -> None:
        self.alive = True
        if HeldSandbox.starts:
            HeldSandbox.starting.set()
            HeldSandbox.starts.pop(0).wait(HANG_GUARD_S)

    def probe(self, kind: str, spec: str, timeout_s: float) -> int:
        if spec == "runaway":
            self.alive = False
            raise grammar_queue.SandboxRefused("it did not compile in time; stopped")
        return 0


def test_starting_a_sandbox_that_replaces_a_stopped_one_does_not_count_against_a_timeout(
    backend: FakeBackend, clock: SplitClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runaway ends its sandbox; the next spec waits for a new one to start (imports, on a
    loaded machine, for seconds). However late the engine polls meanwhile, that request is not
    refused; its timeout runs from when the sandbox is up."""
    monkeypatch.setattr(grammar_queue, "GrammarSandbox", HeldSandbox)
    queue = make_queue(backend, timeout_s=1.0)
    queue.isolate(object())  # type: ignore[arg-type]
    queue.submit(req("runaway", "runaway"))
    _, failed = drain(queue, 1)
    assert [r.rid for r in failed] == ["runaway"]
    start = threading.Event()
    HeldSandbox.starts = [start]
    queue.submit(req("next", "x+"))  # its compile waits for the replacement sandbox
    assert HeldSandbox.starting.wait(HANG_GUARD_S)
    clock.engine = 100.0  # polled far past the request's own deadline while it starts
    queue.wait(timeout_s=0.05)
    ready, failed = queue.pop_done()
    assert not ready and not failed
    clock.worker = 100.0  # the replacement is up at t=100: the timeout runs from there
    start.set()
    ready, failed = drain(queue, 1)
    assert [r.rid for r in ready] == ["next"] and not failed


def test_waiting_for_a_free_worker_does_not_count_against_a_timeout(
    backend: FakeBackend, clock: SplitClock
) -> None:
    """Every worker is held by a slow compile; a spec queued behind them is not refused however
    late the engine polls meanwhile: its timeout runs from when a worker takes it up."""
    backend.release.clear()
    queue = make_queue(backend, timeout_s=1.0)
    assert queue.backend is backend  # built at t=0
    held = [f"slow{i}" for i in range(grammar_queue.WORKERS)]
    for name in held:
        queue.submit(req(name, name))
    queue.submit(req("queued", "x+"))
    clock.engine = 5.0  # every request's own deadline (t=1) is long past
    ready, failed = queue.pop_done()
    assert not ready and sorted(r.rid for r in failed) == held
    clock.worker = 5.0  # the workers come free at t=5: "queued" compiles then, in no time
    backend.release.set()
    ready, failed = drain(queue, 1)
    assert [r.rid for r in ready] == ["queued"] and not failed
    queue.shutdown()
