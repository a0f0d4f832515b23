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
from radixserve.core.request import FinishReason, Req, SamplingParams

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


# -- the messages, the budget check, the cache bound's edges, sandboxes (mutation run 11) --


class SizedBackend(FakeBackend):
    """Records each compile's kind; a spec's compiled size and shortest output come from its
    name ("big" 200 bytes, "huge" 300, others 100; "longN": N tokens at least), and a compile
    takes ``took`` seconds of the workers' clock."""

    def __init__(self, clock: SplitClock | None = None, took: float = 0.0) -> None:
        super().__init__()
        self.kinds: list[str] = []
        self.threads: list[str] = []
        self.clock, self.took = clock, took

    def compile(self, kind: str, spec: str) -> Grammar:
        self.kinds.append(kind)
        self.threads.append(threading.current_thread().name)
        grammar = super().compile(kind, spec)
        if self.clock is not None:
            self.clock.worker += self.took
        size = 300 if spec.startswith("huge") else 200 if spec.startswith("big") else 100
        floor = int(spec[4:]) if spec.startswith("long") else 0
        grammar.memory_bytes = lambda: size  # type: ignore[method-assign]
        grammar.min_output_tokens = lambda: floor  # type: ignore[method-assign]
        return grammar


def budget_req(rid: str, spec: str, max_new_tokens: int, asked: int | None = None) -> Req:
    r = Req(rid, [1, 2, 3], SamplingParams(regex=spec, max_new_tokens=max_new_tokens))
    r.asked_max_new_tokens = asked
    return r


@pytest.mark.parametrize(
    ("max_new_tokens", "asked", "refused_at"),
    [(4, None, 4), (1, None, 1), (5, None, None), (0, None, None), (1, 10, None), (10, 4, 4)],
)
def test_a_budget_shorter_than_every_output_is_refused(
    max_new_tokens: int, asked: int | None, refused_at: int | None
) -> None:
    """A grammar whose outputs are all at least 5 tokens: a budget of 1 to 4 is refused (a PD
    prefill's request is judged by the client's budget, ``asked_max_new_tokens``); 0 (no
    output asked) and 5 or more pass."""
    queue = make_queue(SizedBackend())
    r = budget_req("r", "long5", max_new_tokens, asked)
    queue.submit(r)
    ready, failed = drain(queue, 1)
    if refused_at is None:
        assert ready == [r] and not failed and not r.refused
        return
    assert failed == [r] and not ready and r.refused
    assert r.finish_reason == FinishReason(
        "abort",
        message=f"every output regex allows is at least 5 tokens long, but max_new_tokens is "
        f"{refused_at}: the output could only end cut off. Raise max_new_tokens (max_tokens) "
        "or shorten the regex",
    )


def test_each_compile_gets_its_grammars_kind() -> None:
    backend = SizedBackend()
    queue = make_queue(backend)
    queue.submit(req("a", "x"))
    queue.submit(Req("b", [1], SamplingParams(json_schema='{"type": "integer"}')))
    assert len(drain(queue, 2)[0]) == 2
    assert sorted(backend.kinds) == ["json_schema", "regex"]
    # on the queue's own named worker threads
    assert all(name.startswith("radixserve-grammar_") for name in backend.threads)


def test_compile_error_messages() -> None:
    regex, plain = req("r", "x"), Req("p", [1], SamplingParams())
    message = grammar_queue.compile_error_message
    assert message(regex, "xg", ValueError("bad\n  spec ")) == (
        "regex rejected by grammar backend 'xg': bad spec"
    )
    assert (
        message(regex, "xg", ValueError("")) == "regex rejected by grammar backend 'xg': ValueError"
    )
    assert message(regex, "xg", RuntimeError("out of\tmemory")) == (
        "regex rejected by grammar backend 'xg': RuntimeError: out of memory"
    )
    assert message(regex, "xg", KeyError()) == (
        "regex rejected by grammar backend 'xg': KeyError: KeyError"
    )
    assert message(plain, "xg", ValueError("x")) == "grammar rejected by grammar backend 'xg': x"
    assert message(regex, "xg", grammar_queue.SandboxRefused("ran out of time")) == (
        "regex refused (grammar backend xg): ran out of time"
    )


def test_refusals_mark_the_request_refused(backend: FakeBackend, clock: SplitClock) -> None:
    queue = make_queue(backend)
    queue.submit(req("bad", "bad["))
    _, failed = drain(queue, 1)
    assert failed[0].refused and failed[0].finish_reason.type == "abort"  # type: ignore[union-attr]
    # an abort by the client is not a refusal
    backend.release.clear()
    queue.submit(req("slow", "slow3"))
    aborted = queue.abort("slow", "aborted by the client")
    assert aborted is not None and not aborted.refused
    assert aborted.finish_reason == FinishReason("abort", message="aborted by the client")
    backend.release.set()
    queue.shutdown()


def test_the_exact_timeout_message_and_a_compile_ending_on_its_deadline(clock: SplitClock) -> None:
    backend = SizedBackend(clock, took=1.0)  # each compile takes 1 s of the workers' clock
    queue = make_queue(backend, timeout_s=1.0)
    assert queue.backend is backend  # built at t=0: the deadline is t=1
    queue.submit(req("on-the-deadline", "x"))  # from t=0 to t=1: in time
    ready, failed = drain(queue, 1)
    assert [r.rid for r in ready] == ["on-the-deadline"] and not failed
    clock.engine = 1.0
    backend.took = 1.5  # from t=1 to t=2.5, past the deadline t=2
    queue.submit(req("late", "y"))
    ready, failed = drain(queue, 1)
    assert not ready and failed[0].refused
    assert failed[0].finish_reason.message == (  # type: ignore[union-attr]
        "regex did not compile within grammar_compile_timeout=1s (grammar backend fake); "
        "simplify it or raise the timeout"
    )


def test_the_cache_bound_is_inclusive_and_may_drop_several(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grammar_queue, "CACHE_BYTES", 300)
    backend = SizedBackend()
    queue = make_queue(backend)
    for spec in ("a", "b", "c"):  # 300 bytes: exactly the bound, all kept
        queue.submit(req(spec, spec))
        drain(queue, 1)
    assert [key[2] for key in queue._cache] == ["a", "b", "c"]
    queue.submit(req("big", "big"))  # 500 bytes: the two oldest go
    drain(queue, 1)
    assert [key[2] for key in queue._cache] == ["c", "big"]
    queue.submit(req("huge", "huge"))  # 600: the others go, the new one stays alone
    drain(queue, 1)
    assert [key[2] for key in queue._cache] == ["huge"]
    # a grammar larger than the whole bound stays (the one just compiled always does)
    monkeypatch.setattr(grammar_queue, "CACHE_BYTES", 250)
    queue.submit(req("huge2", "huge2"))
    drain(queue, 1)
    assert [key[2] for key in queue._cache] == ["huge2"]


class RecordingSandbox:
    """Stands in for GrammarSandbox: records what each is built with and probes; a spec with
    "longN" in it reports an N-token floor, "runaway" ends the sandbox."""

    made: list[Any] = []
    probes: list[tuple[str, str, float]] = []

    def __init__(self, spec: Any) -> None:
        self.alive = True
        RecordingSandbox.made.append(spec)

    def probe(self, kind: str, spec: str, timeout_s: float) -> int:
        RecordingSandbox.probes.append((kind, spec, timeout_s))
        if spec == "runaway":
            self.alive = False
            raise grammar_queue.SandboxRefused("stopped")
        return int(spec.partition("long")[2]) if "long" in spec else 0

    def close(self) -> None:
        self.alive = False


@pytest.fixture
def sandboxes(monkeypatch: pytest.MonkeyPatch) -> type[RecordingSandbox]:
    monkeypatch.setattr(grammar_queue, "GrammarSandbox", RecordingSandbox)
    RecordingSandbox.made, RecordingSandbox.probes = [], []
    return RecordingSandbox


def test_a_sandbox_is_reused_until_a_runaway_ends_it(
    backend: FakeBackend, sandboxes: type[RecordingSandbox]
) -> None:
    spec = object()
    queue = make_queue(backend, timeout_s=7.0)
    queue.isolate(spec)  # type: ignore[arg-type]
    for i, name in enumerate(["x", "y", "runaway", "z"]):
        queue.submit(req(str(i), name))
        drain(queue, 1)
    assert sandboxes.made == [spec, spec]  # one for x, y and the runaway; one after it
    assert sandboxes.probes == [
        ("regex", "x", 7.0),
        ("regex", "y", 7.0),
        ("regex", "runaway", 7.0),
        ("regex", "z", 7.0),
    ]
    assert "runaway" not in backend.compiled
    queue.shutdown()


def test_the_sandboxs_floor_refuses_a_short_budget_before_the_compile_ends(
    sandboxes: type[RecordingSandbox],
) -> None:
    backend = SizedBackend()
    backend.release.clear()
    queue = make_queue(backend)
    queue.isolate(object())  # type: ignore[arg-type]
    r = budget_req("r", "slow-held", 3)
    queue.submit(budget_req("short", "slowlong9", 3))  # its compile is held
    ready, failed = drain(queue, 1)  # refused on the sandbox's floor, the compile still held
    assert not any(job.future.done() for job in queue._cache.values())
    assert not ready and [f.rid for f in failed] == ["short"] and failed[0].refused
    queue.submit(r)
    backend.release.set()
    assert drain(queue, 1)[0] == [r]
    queue.shutdown()


def test_timeouts_apply_once_a_sandbox_has_started(
    backend: FakeBackend, clock: SplitClock, sandboxes: type[RecordingSandbox]
) -> None:
    backend.release.clear()
    queue = make_queue(backend, timeout_s=1.0)
    queue.isolate(object())  # type: ignore[arg-type]
    queue.submit(req("slow", "slow4"))
    deadline = time.monotonic() + HANG_GUARD_S
    while not backend.compiled and time.monotonic() < deadline:
        time.sleep(0.001)  # the sandbox is up (t=0) and the compile runs
    clock.engine = 1.0
    ready, failed = queue.pop_done()
    assert not ready and [r.rid for r in failed] == ["slow"]
    backend.release.set()
    queue.shutdown()


def test_a_request_joining_a_compile_in_flight_gets_its_own_full_timeout(
    backend: FakeBackend, clock: SplitClock
) -> None:
    backend.release.clear()
    queue = make_queue(backend, timeout_s=10.0)
    assert queue.backend is backend  # built at t=0
    queue.submit(req("first", "slow5"))  # taken up at t=0: due at t=10
    deadline = time.monotonic() + HANG_GUARD_S
    while not backend.compiled and time.monotonic() < deadline:
        time.sleep(0.001)  # until a worker has taken it up, at t=0
    clock.engine = 5.0
    queue.submit(req("joined", "slow5"))  # the same compile, joined at t=5: due at t=15
    clock.engine = 12.0
    ready, failed = queue.pop_done()
    assert not ready and [r.rid for r in failed] == ["first"] and len(queue) == 1
    backend.release.set()
    assert [r.rid for r in drain(queue, 1)[0]] == ["joined"]
    queue.shutdown()


def test_wait_returns_when_any_one_compile_finishes(backend: FakeBackend) -> None:
    backend.release.clear()
    queue = make_queue(backend, timeout_s=3600.0)
    queue.submit(req("held", "slow6"))
    queue.submit(req("quick", "q"))
    waiter = threading.Thread(target=queue.wait, kwargs={"timeout_s": 3600.0}, daemon=True)
    waiter.start()
    waiter.join(HANG_GUARD_S)
    assert not waiter.is_alive(), "wait() did not return when one of two compiles finished"
    assert [r.rid for r in queue.pop_done()[0]] == ["quick"]
    backend.release.set()
    queue.shutdown()


def test_shutdown_cancels_queued_compiles_without_waiting_for_running_ones(
    backend: FakeBackend,
) -> None:
    backend.release.clear()
    queue = make_queue(backend)
    held = [f"slow-held{i}" for i in range(grammar_queue.WORKERS)]
    for name in held:
        queue.submit(req(name, name))
    queue.submit(req("queued", "never"))
    queued = queue._cache[("fake", "regex", "never")].future
    closer = threading.Thread(target=queue.shutdown, daemon=True)
    closer.start()
    closer.join(HANG_GUARD_S)
    assert not closer.is_alive(), "shutdown() waited for the running compiles"
    assert queued.cancelled()
    with pytest.raises(RuntimeError):
        queue.submit(req("late", "another"))
    backend.release.set()
    assert "never" not in backend.compiled
