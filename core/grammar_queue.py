"""Grammar compilation off the scheduler's critical path.

A request with a constraint waits here, not in the scheduler, while a worker thread compiles its
grammar. Compiled grammars are kept in an LRU cache keyed by (backend, kind, spec); requests with
the same spec share one compilation, even while it is in flight. Each request gets its own
matcher (``Grammar.copy``). A compile error or a timeout ends only that request, with an abort
that names the problem.

The timeout is judged by when a compilation finished, not by when the engine next polls: a
compile that ends after the request's deadline is refused even if its result is already there,
so a request's outcome does not depend on poll timing.

In the server (``isolate``) each new spec is first compiled in a sandbox process capped in time
and memory (core/grammar_sandbox.py): a spec that runs away there is refused, and the engine
never compiles it. A compiled grammar whose every complete output is longer than the request's
``max_new_tokens`` is refused too: the output could only end cut off.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from radixserve.core.grammar_sandbox import GrammarSandbox, SandboxRefused, SandboxSpec
from radixserve.core.interfaces import Grammar, GrammarBackend
from radixserve.core.request import FinishReason, Req

CACHE_SIZE = 256
# Compiled grammars kept past this total (their own estimate) leave the cache, oldest first, so
# many large distinct grammars cannot grow the engine's memory without bound.
CACHE_BYTES = 256 << 20
WORKERS = 2  # one slow grammar does not hold up every other request's compilation
# Longest the engine sleeps waiting for a compilation when it has nothing else to run; new
# requests wait at most this long to be seen.
IDLE_WAIT_S = 0.02

GrammarKey = tuple[str, str, str]


@dataclass(slots=True)
class _Compile:
    """One compilation, shared by every request with its spec."""

    future: Future[Grammar] = field(init=False)
    # When a worker took it up: waiting for a free worker (behind other slow compiles) does
    # not count against a request's timeout, which judges the spec, not the queue.
    started_at: float = math.inf
    # NOTE: the worker stamps this before its future completes, so a done future always has it.
    finished_at: float = math.inf
    nbytes: int = 0  # the compiled grammar's size, once compiled
    # Fewest tokens of a complete output, once known (from the sandbox, before the compile
    # here ends): a request whose budget is smaller is refused without waiting for it.
    min_tokens: int | None = None


@dataclass(slots=True)
class _Pending:
    req: Req
    job: _Compile
    deadline: float


class GrammarQueue:
    """Requests whose grammar is compiling; ``pop_done`` hands them back ready or failed."""

    def __init__(
        self, backend_name: str, make_backend: Callable[[], GrammarBackend], timeout_s: float
    ) -> None:
        self.backend_name = backend_name
        self.timeout_s = timeout_s
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        # Building the backend (once) does not count against a request's timeout, nor does
        # starting a sandbox (a first one, or one replacing a sandbox a runaway ended).
        self._backend_ready = math.inf
        self._sandboxes_starting = 0
        self._cache: OrderedDict[GrammarKey, _Compile] = OrderedDict()
        self._cache_lock = threading.Lock()  # done-callbacks run on the worker threads
        self._pending: list[_Pending] = []
        self._pool: ThreadPoolExecutor | None = None
        self._sandbox: SandboxSpec | None = None
        self._idle_sandboxes: list[GrammarSandbox] = []

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use (building one can take a second)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
                self._backend_ready = time.monotonic()
            return self._backend

    def isolate(self, sandbox: SandboxSpec) -> None:
        """Compile every new spec in a sandbox process first (time and memory capped); only
        one that passes is compiled in this process."""
        self._sandbox = sandbox

    def submit(self, req: Req) -> None:
        """Start (or join) the compilation of ``req``'s grammar; the request waits here."""
        spec = req.sampling.grammar
        assert spec is not None
        key = (self.backend_name, *spec)
        with self._cache_lock:
            job = self._cache.get(key)
            if job is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(WORKERS, "radixserve-grammar")
                job = _Compile()
                job.future = self._pool.submit(self._compile, job, *spec)
                self._cache[key] = job
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        job.future.add_done_callback(lambda f: self._forget_failure(key, job))
        self._pending.append(_Pending(req, job, time.monotonic() + self.timeout_s))

    def _compile(self, job: _Compile, kind: str, spec: str) -> Grammar:
        job.started_at = time.monotonic()
        try:
            if self._sandbox is not None:
                job.min_tokens = self._probe(self._sandbox, kind, spec)
            grammar = self.backend.compile(kind, spec)
            job.nbytes, job.min_tokens = grammar.memory_bytes(), grammar.min_output_tokens()
            self._trim_cache(job)
            return grammar
        finally:
            job.finished_at = time.monotonic()

    def _trim_cache(self, keep: _Compile) -> None:
        with self._cache_lock:
            total = sum(j.nbytes for j in self._cache.values())
            for key in list(self._cache):
                if total <= CACHE_BYTES:
                    break
                job = self._cache[key]
                if job is not keep:
                    del self._cache[key]
                    total -= job.nbytes

    def _probe(self, sandbox: SandboxSpec, kind: str, spec: str) -> int:
        with self._cache_lock:
            box = self._idle_sandboxes.pop() if self._idle_sandboxes else None
        if box is None:
            with self._backend_lock:
                self._sandboxes_starting += 1
            try:
                box = GrammarSandbox(sandbox)
                self.backend  # noqa: B018 - built now too: no start-up counts against a timeout
            finally:
                with self._backend_lock:
                    self._sandboxes_starting -= 1
                    self._backend_ready = time.monotonic()
        try:
            return box.probe(kind, spec, self.timeout_s)
        finally:
            if box.alive:
                with self._cache_lock:
                    self._idle_sandboxes.append(box)

    def _forget_failure(self, key: GrammarKey, job: _Compile) -> None:
        # Errors are not cached: the next request with this spec compiles it again.
        if job.future.exception() is not None:
            with self._cache_lock:
                if self._cache.get(key) is job:
                    del self._cache[key]

    def pop_done(self) -> tuple[list[Req], list[Req]]:
        """(requests now holding their own matcher, requests finished with an abort)."""
        ready: list[Req] = []
        failed: list[Req] = []
        now = time.monotonic()
        still: list[_Pending] = []
        for p in self._pending:
            # Judge by when the compile finished, not by when we poll. NOTE: read ``finished``
            # after ``now`` (an unfinished compile ends after ``now``) and before the deadline
            # (a stamped compile has built the backend, so ``_backend_ready`` is set).
            finished = p.job.finished_at
            deadline = self._deadline(p)
            late = finished > deadline if finished < math.inf else now >= deadline
            too_short = _budget_problem(p.req, p.job.min_tokens)
            if too_short:
                self._refuse(p.req, too_short)
                failed.append(p.req)
            elif late:
                message = (
                    f"{_field(p.req)} did not compile within grammar_compile_timeout="
                    f"{self.timeout_s:g}s (grammar backend {self.backend_name}); simplify it "
                    "or raise the timeout"
                )
                self._refuse(p.req, message)
                failed.append(p.req)
            elif finished < math.inf and p.job.future.done():
                error = p.job.future.exception()
                if error is None:
                    p.req.grammar = p.job.future.result().copy()
                    ready.append(p.req)
                else:
                    message = compile_error_message(p.req, self.backend_name, error)
                    self._refuse(p.req, message)
                    failed.append(p.req)
            else:
                still.append(p)
        self._pending = still
        return ready, failed

    def _deadline(self, p: _Pending) -> float:
        # Building the backend or starting a sandbox does not count against a request's
        # timeout: none is due while one starts (its own start is bounded, START_TIMEOUT_S).
        # Nor does waiting for a worker: a compile still queued has no deadline yet (the ones
        # ahead of it are each bounded by the timeout in the sandbox).
        if self._sandboxes_starting:
            return math.inf
        started = max(p.job.started_at, self._backend_ready)
        return max(p.deadline, started + self.timeout_s)

    @staticmethod
    def _refuse(req: Req, message: str) -> None:
        req.refused = True  # the server answers 400: the request never ran
        req.finish(FinishReason("abort", message=message))

    def wait(self, timeout_s: float = IDLE_WAIT_S) -> None:
        """Sleep until a pending compilation finishes, a deadline passes or ``timeout_s``
        elapses. Only called when the engine has nothing else to run."""
        if not self._pending:
            return
        next_deadline = min(self._deadline(p) for p in self._pending) - time.monotonic()
        timeout = max(0.0, min(timeout_s, next_deadline))
        wait([p.job.future for p in self._pending], timeout=timeout, return_when=FIRST_COMPLETED)

    def abort(self, rid: str, message: str) -> Req | None:
        for p in self._pending:
            if p.req.rid == rid:
                self._pending.remove(p)
                p.req.finish(FinishReason("abort", message=message))
                return p.req
        return None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        with self._cache_lock:
            boxes, self._idle_sandboxes = self._idle_sandboxes, []
        for box in boxes:
            box.close()


def _field(req: Req) -> str:
    spec = req.sampling.grammar
    return "grammar" if spec is None else spec[0]


def compile_error_message(req: Req, backend: str, error: BaseException) -> str:
    """One line naming the constraint field, the backend and its complaint."""
    detail = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, SandboxRefused):
        return f"{_field(req)} refused (grammar backend {backend}): {detail}"
    if not isinstance(error, ValueError):  # not a bad spec: a backend failure
        detail = f"{type(error).__name__}: {detail}"
    return f"{_field(req)} rejected by grammar backend '{backend}': {detail}"


def _budget_problem(req: Req, floor: int | None) -> str | None:
    """Why ``req``'s budget cannot hold any complete output of its grammar (one needs at least
    ``floor`` tokens), if it cannot. A PD prefill's request is checked against the client's
    budget (the decode generates the rest), not the one token it samples."""
    asked = req.asked_max_new_tokens
    budget = req.sampling.max_new_tokens if asked is None else asked
    if floor is not None and 0 < budget < floor:
        return (
            f"every output {_field(req)} allows is at least {floor} tokens long, but "
            f"max_new_tokens is {budget}: the output could only end cut off. Raise "
            f"max_new_tokens (max_tokens) or shorten the {_field(req)}"
        )
    return None
