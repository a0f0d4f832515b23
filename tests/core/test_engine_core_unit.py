"""EngineCore's loop on the tiny random Llama (CPU, a core in ~0.2 s), its fixed points driven by
small test strategies and plugins: validation and refusal, holding strategies, aborts, the idle
wait, strategies running their own step, a failing step, overlap scheduling, the step hooks,
grammar admission with jump-forward, weights updates, cache flushes and shutdown. (The
scheduler's own behaviour through the engine is in test_scheduler*.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import transformers.models.llama.modeling_llama  # noqa: F401 - see below
from allow_all_grammar import AllowAllGrammar
from platform_choice import on_cpu
from scheduler_checks import check_accounting, greedy, tokens
from tiny_models import make_tiny_llama_dir

from radixserve.core.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Grammar, GrammarBackend, StepStrategy
from radixserve.core.plugins import PluginHost
from radixserve.core.request import InvalidRequest, Req, ReqState, SamplingParams

POOL = 256  # KV tokens of every core here

# transformers' Llama (the tiny model's builder and the reference forward use it) is imported
# at collection, not at first use: mutmut's fork server (tests/support/mutation.py) then loads
# it once, not once per mutant (~6 s each on the shared VM).


def make_core(model_dir: Path, *plugins: object, **settings: Any) -> EngineCore:
    settings.setdefault("max_total_tokens", POOL)
    host = PluginHost(extra_plugins=[(f"test{i}", p) for i, p in enumerate(plugins)])
    return EngineCore(model_dir, EngineConfig(**on_cpu(settings)), host)


def add(core: EngineCore, rid: str, n: int = 6, max_new_tokens: int = 3, **kw: Any) -> Req:
    req = Req(rid, tokens(sum(map(ord, rid)) * 31 + n, n), greedy(max_new_tokens))
    for name, value in kw.items():
        setattr(req.sampling, name, value)
    core.add_request(req)
    return req


def run_to_idle(core: EngineCore) -> list[list[str]]:
    """Step until idle; the rids each step returned."""
    seen = []
    for _ in range(200):
        if not core.has_work():
            return seen
        seen.append([r.rid for r in core.step()])
        check_accounting(core)
    raise AssertionError("no progress")


class Recorder:
    """Records the engine's plugin hooks."""

    def __init__(self) -> None:
        self.started: list[dict[str, Any]] = []
        self.stats: list[dict[str, Any]] = []
        self.aliases: dict[str, str] = {}

    @hookimpl
    def engine_started(self, info: dict[str, Any]) -> None:
        self.started.append(info)

    @hookimpl
    def step_finished(self, stats: dict[str, Any]) -> None:
        self.stats.append(stats)

    @hookimpl
    def resolve_model_dir(self, model_path: str | None) -> str | None:
        return self.aliases.get(model_path or "")


# -- requests in and out ---------------------------------------------------------------------


def test_a_request_runs_to_its_length_and_each_step_reports_it(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    req = add(core, "a", max_new_tokens=3)
    assert core.has_work()
    assert run_to_idle(core) == [["a"], ["a"], ["a"]]
    assert len(req.output_ids) == 3 and req.finish_reason.type == "length"
    assert not core.has_work() and core.drained()


def test_engine_started_tells_the_model_plugins_and_sizes(tiny_llama_dir: Path) -> None:
    rec = Recorder()
    core = make_core(tiny_llama_dir, rec)
    [info] = rec.started
    assert info["model_path"] == str(tiny_llama_dir)
    assert info["plugins"] == dict(core.runner.plugins.names)
    assert info["plugins"]["hardware"] == "cpu"
    assert info["kv_tokens"] == POOL and info["max_context"] == 512 == core.max_context
    assert info["settings"] == core.runner.settings.describe()
    assert core.eos_token_ids == (0,)


def test_step_finished_counts_each_steps_decodes_prefill_and_queue(tiny_llama_dir: Path) -> None:
    rec = Recorder()
    core = make_core(tiny_llama_dir, rec, max_running_requests=1)
    add(core, "a", n=6, max_new_tokens=2)
    add(core, "bb", n=4, max_new_tokens=1)
    started = time.perf_counter()
    run_to_idle(core)
    wall = time.perf_counter() - started
    counts = [{k: v for k, v in s.items() if k != "step_time_s"} for s in rec.stats]
    assert counts == [
        {"num_decode": 0, "num_prefill_tokens": 6, "num_running": 1, "num_waiting": 1},
        {"num_decode": 1, "num_prefill_tokens": 0, "num_running": 0, "num_waiting": 1},
        {"num_decode": 0, "num_prefill_tokens": 4, "num_running": 0, "num_waiting": 0},
    ]
    assert all(0 < s["step_time_s"] <= wall for s in rec.stats)
    kinds = core.scheduler.stats.by_kind
    spent = sum(k.seconds for k in kinds.values())
    assert 0 < spent <= wall


def test_an_out_of_vocabulary_prompt_is_refused_and_the_strategies_told(
    tiny_llama_dir: Path,
) -> None:
    refused: list[tuple[str, str]] = []

    class Refusals(StepStrategy):
        def refused(self, req: Req, message: str) -> None:
            refused.append((req.rid, message))

    core = make_core(tiny_llama_dir)
    core.strategies.append(Refusals())
    vocab = core.runner.model_config.vocab_size
    with pytest.raises(InvalidRequest) as e:
        core.add_request(Req("bad", [3, vocab], greedy(2)))
    assert refused == [("bad", str(e.value))] and str(vocab) in str(e.value)
    assert not core.has_work()


def test_a_strategy_prepares_a_request_before_it_is_validated(tiny_llama_dir: Path) -> None:
    class Rewrite(StepStrategy):
        def prepare(self, req: Req) -> None:
            if req.rid == "fix":
                req.input_ids = [3, 4, 5]
            else:
                raise InvalidRequest("no such session")

    refused: list[str] = []

    class Refusals(StepStrategy):
        def refused(self, req: Req, message: str) -> None:
            refused.append(message)

    core = make_core(tiny_llama_dir)
    core.strategies.extend([Rewrite(), Refusals()])
    req = Req("fix", [10**6], greedy(1))
    core.add_request(req)  # valid once rewritten
    assert list(core.scheduler.waiting) == [req]
    with pytest.raises(InvalidRequest, match="no such session"):
        core.add_request(Req("other", [3], greedy(1)))
    assert refused == ["no such session"]


def test_the_output_budget_is_cut_to_what_the_pool_holds(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir, max_total_tokens=40)
    req = Req("big", tokens(1, 10), SamplingParams(max_new_tokens=100, min_new_tokens=50))
    core.add_request(req)
    assert (req.sampling.max_new_tokens, req.sampling.min_new_tokens) == (30, 30)
    fits = Req("fits", tokens(2, 10), SamplingParams(max_new_tokens=30))
    core.add_request(fits)
    assert fits.sampling.max_new_tokens == 30


def test_the_default_seed_is_given_to_requests_without_one(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir, random_seed=7, enable_deterministic_inference=True)
    req = add(core, "s")
    assert req.sampling.seed is not None
    plain = make_core(tiny_llama_dir)
    assert add(plain, "s").sampling.seed is None


def test_a_holding_strategy_keeps_the_request_from_the_scheduler(tiny_llama_dir: Path) -> None:
    admitted: list[tuple[str, bool]] = []

    class Hold(StepStrategy):
        def admit(self, req: Req, compiling: bool) -> bool:
            admitted.append((req.rid, compiling))
            return req.rid == "held"

    core = make_core(tiny_llama_dir)
    core.strategies.append(Hold())
    held = add(core, "held")
    assert not core.scheduler.waiting and not core.has_work()
    free = add(core, "free")
    assert list(core.scheduler.waiting) == [free]
    assert admitted == [("held", False), ("free", False)]
    assert held.state == ReqState.WAITING


def test_abort_ends_a_waiting_request_and_tells_the_strategies(tiny_llama_dir: Path) -> None:
    ended: list[list[str]] = []

    class Ends(StepStrategy):
        def ended(self, reqs: list[Req]) -> None:
            ended.append([r.rid for r in reqs])

    core = make_core(tiny_llama_dir)
    core.strategies.append(Ends())
    req = add(core, "a")
    assert core.abort("nobody") is None and ended == []
    assert core.abort("a") is req
    assert req.finish_reason.type == "abort"
    assert req.finish_reason.message == "aborted by the client"
    assert ended == [["a"]] and not core.has_work()
    other = add(core, "b")
    core.step()
    assert core.abort("b", "gone") is other and other.finish_reason.message == "gone"


def test_abort_reaches_a_request_a_strategy_holds(tiny_llama_dir: Path) -> None:
    kept = Req("kept", [3, 4], greedy(1))
    asked: list[tuple[str, str]] = []

    class Keeper(StepStrategy):
        def abort(self, rid: str, message: str) -> Req | None:
            asked.append((rid, message))
            return kept if rid == "kept" else None

    class Second(StepStrategy):
        def abort(self, rid: str, message: str) -> Req | None:
            raise AssertionError("a request found is not looked for again")

    core = make_core(tiny_llama_dir)
    core.strategies.extend([Keeper(), Second()])
    assert core.abort("kept", "bye") is kept
    assert asked == [("kept", "bye")]


def test_has_work_counts_a_strategys_own_work(tiny_llama_dir: Path) -> None:
    class Busy(StepStrategy):
        busy = True

        def has_work(self) -> bool:
            return self.busy

    core = make_core(tiny_llama_dir)
    busy = Busy()
    core.strategies.append(busy)
    assert core.has_work()
    busy.busy = False
    assert not core.has_work()


def test_cancel_room_and_spec_stats_reach_the_strategies(tiny_llama_dir: Path) -> None:
    rooms: list[tuple[Any, ...]] = []

    class Rooms(StepStrategy):
        def cancel_room(self, room: int, message: str, peer: Any, refused: bool) -> None:
            rooms.append((room, message, peer, refused))

    class Stats(StepStrategy):
        def spec_stats(self) -> dict[str, object] | None:
            return {"accepted": 3}

    core = make_core(tiny_llama_dir)
    assert core.spec_stats() is None
    core.strategies.extend([Rooms(), Stats()])
    core.cancel_room(5, "no")
    core.cancel_room(6, "busy", ("h", 1), refused=False)
    assert rooms == [(5, "no", None, True), (6, "busy", ("h", 1), False)]
    assert core.spec_stats() == {"accepted": 3}


# -- the idle wait ---------------------------------------------------------------------------


class Waits(StepStrategy):
    def __init__(self, wait: float | None, busy: bool = True) -> None:
        self.wait, self.busy = wait, busy

    def wait_timeout(self) -> float | None:
        return self.wait

    def has_work(self) -> bool:
        return self.busy


def test_idle_wait_is_the_shortest_strategy_wait_when_nothing_else_runs(
    tiny_llama_dir: Path,
) -> None:
    core = make_core(tiny_llama_dir)
    assert core.idle_wait() is None
    core.strategies.append(Waits(None, busy=False))
    assert core.idle_wait() is None  # nobody waits
    core.strategies.extend([Waits(0.5), Waits(0.25)])
    assert core.idle_wait() == 0.25
    core.strategies.append(Waits(None, busy=True))  # runs steps itself
    assert core.idle_wait() is None
    core.strategies.pop()
    add(core, "a")
    assert core.idle_wait() is None  # the scheduler has a step to run
    core.abort("a")  # nothing was in flight: nothing is left to report
    assert core.idle_wait() == 0.25


def test_idle_wait_is_none_while_a_step_is_in_flight_or_changes_wait(
    tiny_llama_dir: Path,
) -> None:
    core = make_core(tiny_llama_dir, enable_overlap_schedule=True)
    core.strategies.append(Waits(0.5))
    req = add(core, "a", max_new_tokens=1)
    core.step()  # the prefill is in flight
    core.scheduler.waiting.clear()
    assert core._in_flight is not None and core.idle_wait() is None
    core.abort("nobody")  # commits the step in flight: its request waits to be reported
    assert core._in_flight is None and req.finished
    assert core.has_work() and core.idle_wait() is None
    assert [r.rid for r in core.step()] == ["a"]
    assert not core.scheduler.has_work() and core.idle_wait() == 0.5


# -- the step's fixed points -----------------------------------------------------------------


def test_polled_requests_are_reported_and_every_change_ends_at_the_strategies(
    tiny_llama_dir: Path,
) -> None:
    outside = Req("outside", [3], greedy(1))
    ended: list[list[str]] = []

    class Poll(StepStrategy):
        def poll(self) -> list[Req]:
            return [outside]

        def ended(self, reqs: list[Req]) -> None:
            ended.append([r.rid for r in reqs])

    core = make_core(tiny_llama_dir)
    core.strategies.append(Poll())
    add(core, "a", max_new_tokens=1)
    assert [r.rid for r in core.step()] == ["outside", "a"]
    assert ended == [["outside", "a"]]


def test_a_strategy_that_runs_its_own_step_replaces_the_scheduler(tiny_llama_dir: Path) -> None:
    calls: list[bool] = []
    other = Req("own", [3], greedy(1))

    class Own(StepStrategy):
        ran = True

        def run_own_step(self, scheduler: Any, hold: bool) -> tuple[list[Any], bool]:
            assert scheduler is core.scheduler
            calls.append(hold)
            return [other], self.ran

    class NotMe(StepStrategy):
        def run_own_step(self, scheduler: Any, hold: bool) -> tuple[list[Any], bool]:
            return [], False

    core = make_core(tiny_llama_dir)
    own = Own()
    core.strategies.extend([NotMe(), own, NotMe()])
    req = add(core, "a", max_new_tokens=1)
    assert core.step() == [other]
    assert req.state == ReqState.WAITING and calls == [False]
    own.ran = False
    assert [r.rid for r in core.step()] == ["own", "a"]
    assert req.finished


def test_a_failing_step_aborts_its_requests_and_the_engine_goes_on(tiny_llama_dir: Path) -> None:
    class Boom(StepStrategy):
        armed = True

        def before_forward(self, batch: Any) -> None:
            if self.armed:
                self.armed = False
                raise RuntimeError("boom")

    core = make_core(tiny_llama_dir)
    add(core, "warm", max_new_tokens=1)
    run_to_idle(core)
    assert core.scheduler.cache.evictable_size > 0
    core.strategies.append(Boom())
    a, b = add(core, "a"), add(core, "bb")
    assert {r.rid for r in core.step()} == {"a", "bb"}
    message = "the engine failed on this request's step (RuntimeError: boom)"
    for req in (a, b):
        assert req.failed == message
        assert req.finish_reason.type == "abort" and req.finish_reason.message == message
    assert core.scheduler.cache.evictable_size == 0  # nothing the step wrote is trusted
    check_accounting(core)
    c = add(core, "c", max_new_tokens=2)
    run_to_idle(core)
    assert len(c.output_ids) == 2 and c.failed is None


def test_a_failing_step_in_overlap_first_commits_the_step_in_flight(tiny_llama_dir: Path) -> None:
    class Boom(StepStrategy):
        armed = False

        def before_forward(self, batch: Any) -> None:
            if self.armed:
                raise RuntimeError("late")

    core = make_core(tiny_llama_dir, enable_overlap_schedule=True)
    boom = Boom()
    core.strategies.append(boom)
    req = add(core, "a", max_new_tokens=4)
    assert core.step() == []  # the prefill is in flight
    boom.armed = True
    changed = core.step()  # the prefill's token is committed, then the request aborted
    assert set(changed) == {req} and len(req.output_ids) == 1
    assert req.failed.endswith("(RuntimeError: late)")
    assert core._in_flight is None and not core.has_work()
    check_accounting(core)


def test_a_request_the_sampler_failed_is_aborted_with_its_message(tiny_llama_dir: Path) -> None:
    class FailOne(StepStrategy):
        def sample_rows(self, logits: Any, batch: Any, plans: Any, rows: Any, eos: Any) -> None:
            for req in batch.reqs:
                if req.rid == "bad":
                    req.failed = "no token for this row"

    core = make_core(tiny_llama_dir)
    core.strategies.append(FailOne())
    bad, good = add(core, "bad"), add(core, "good", max_new_tokens=2)
    first = core.step()
    assert bad in first and good in first
    assert bad.finish_reason.type == "abort"
    assert bad.finish_reason.message == "no token for this row"
    run_to_idle(core)
    assert len(good.output_ids) == 2 and good.finish_reason.type == "length"


def test_step_done_gets_each_plan_its_time_and_whether_it_overlapped(
    tiny_llama_dir: Path,
) -> None:
    done: list[tuple[str, float, bool]] = []

    class Done(StepStrategy):
        def step_done(self, plan: Any, seconds: float, overlapped: bool) -> None:
            done.append((plan.kind, seconds, overlapped))

    for overlap in (False, True):
        done.clear()
        core = make_core(tiny_llama_dir, enable_overlap_schedule=overlap)
        core.strategies.append(Done())
        add(core, "a", max_new_tokens=3)
        started = time.perf_counter()
        run_to_idle(core)
        wall = time.perf_counter() - started
        assert [d[2] for d in done] == ([False, True, True] if overlap else [False] * 3)
        assert all(0 < d[1] <= wall for d in done)
        assert core.overlapped_steps == (2 if overlap else 0)
        assert sum(d[1] for d in done) <= wall


# -- overlap scheduling ----------------------------------------------------------------------


def test_overlap_reports_a_step_late_with_the_outputs_of_the_sync_loop(
    tiny_llama_dir: Path,
) -> None:
    outputs = {}
    for overlap in (False, True):
        core = make_core(tiny_llama_dir, enable_overlap_schedule=overlap)
        assert core.overlap is overlap
        reqs = [add(core, "a", n=5, max_new_tokens=4), add(core, "bb", n=7, max_new_tokens=2)]
        seen = run_to_idle(core)
        outputs[overlap] = [r.output_ids for r in reqs]
        if overlap:
            assert seen[0] == [] and core.overlapped_steps > 0
        else:
            assert seen[0] == ["a", "bb"]
    assert outputs[True] == outputs[False]
    assert make_core(tiny_llama_dir, enable_overlap_schedule=True, disable_overlap_schedule=True)
    assert not make_core(tiny_llama_dir).overlap  # the CPU runs synchronously


def test_a_strategy_needing_host_tokens_stops_the_overlap(tiny_llama_dir: Path) -> None:
    class Host(StepStrategy):
        def needs_host_tokens(self, scheduler: Any) -> bool:
            return True

    core = make_core(tiny_llama_dir, enable_overlap_schedule=True)
    core.strategies.append(Host())
    req = add(core, "a", max_new_tokens=3)
    run_to_idle(core)
    assert core.overlapped_steps == 0 and len(req.output_ids) == 3


def test_requests_with_logprobs_are_not_overlapped(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir, enable_overlap_schedule=True)
    req = add(core, "a", max_new_tokens=3, logprobs=True)
    run_to_idle(core)
    assert core.overlapped_steps == 0 and len(req.output_logprobs) == 3


def test_retraction_in_overlap_commits_the_step_in_flight_first(tiny_llama_dir: Path) -> None:
    outputs = {}
    for overlap in (False, True):
        core = make_core(
            tiny_llama_dir, enable_overlap_schedule=overlap, max_total_tokens=64,
            schedule_conservativeness=0.0,
        )  # fmt: skip
        reqs = [add(core, f"r{i}", n=20, max_new_tokens=16) for i in range(3)]
        run_to_idle(core)
        assert core.scheduler.stats.retractions > 0
        outputs[overlap] = [r.output_ids for r in reqs]
        assert all(len(o) == 16 for o in outputs[overlap])
    assert outputs[True] == outputs[False]


# -- grammar admission -----------------------------------------------------------------------


class Forced(AllowAllGrammar):
    """Forces its spec's text, then allows anything."""

    def __init__(self, text: str) -> None:
        self.text = text

    def accept_token(self, token_id: int) -> bool:
        self.text = ""
        return True

    def forced_string(self) -> str:
        return self.text

    def copy(self) -> Grammar:
        return Forced(self.text)


class ForcedBackend(GrammarBackend):
    def compile(self, kind: str, spec: str) -> Grammar:
        if spec == "bad":
            raise ValueError("bad spec")
        return Forced(spec)


class ForcedPlugin:
    """Registers grammar backend ``forced``, recording what each build of it was given; with
    ``release``, a compile first waits for it."""

    def __init__(self, release: threading.Event | None = None) -> None:
        self.release = release
        self.made: list[tuple[Any, int, list[int]]] = []

    @hookimpl
    def register_grammar_backends(self, register: Any) -> None:
        def build(tokenizer: Any, vocab: int, stops: list[int]) -> ForcedBackend:
            self.made.append((tokenizer, vocab, stops))
            backend = ForcedBackend()
            if self.release is not None:
                release, compile_now = self.release, backend.compile

                def compile_later(kind: str, spec: str) -> Grammar:
                    assert release.wait(30)
                    return compile_now(kind, spec)

                backend.compile = compile_later  # type: ignore[method-assign]
            return backend

        register("forced", build)


def grammar_core(model_dir: Path, **settings: Any) -> EngineCore:
    return make_core(model_dir, ForcedPlugin(), grammar_backend="forced", **settings)


def test_a_compiled_grammar_jumps_forward_before_the_request_is_scheduled(
    tiny_llama_dir: Path,
) -> None:
    core = grammar_core(tiny_llama_dir)
    text = "The quick brown fox jumps"
    forced = core.tokenizer.encode(text, add_special_tokens=False)[:-1]
    assert len(forced) >= 2
    req = add(core, "g", max_new_tokens=len(forced) + 2, regex=text)
    assert len(core.grammars) == 1 and core.has_work() and core.idle_wait() is None
    assert not core.scheduler.waiting
    run_to_idle(core)
    assert req.output_ids[: len(forced)] == forced and len(req.output_ids) == len(forced) + 2
    assert core.grammar_stepper.jump_forward_tokens >= len(forced)


def test_forced_tokens_past_the_budget_end_the_request_before_it_runs(
    tiny_llama_dir: Path,
) -> None:
    unscheduled: list[str] = []

    class Unscheduled(StepStrategy):
        def ended_unscheduled(self, reqs: list[Req]) -> None:
            unscheduled.extend(r.rid for r in reqs)

    core = grammar_core(tiny_llama_dir)
    core.strategies.append(Unscheduled())
    req = add(core, "g", max_new_tokens=1, regex="The quick brown fox jumps")
    bad = add(core, "bad", regex="bad")
    seen = run_to_idle(core)
    assert sorted(r for s in seen for r in s) == ["bad", "g"]
    assert len(req.output_ids) == 1 and req.finish_reason.type == "length"
    assert bad.finish_reason.type == "abort" and "bad spec" in bad.finish_reason.message
    assert sorted(unscheduled) == ["bad", "g"]
    assert core.scheduler.stats.steps == 0  # neither ever ran


def test_without_jump_forward_the_model_samples_every_token(tiny_llama_dir: Path) -> None:
    core = grammar_core(tiny_llama_dir, disable_jump_forward=True)
    req = add(core, "g", max_new_tokens=2, regex="The quick brown fox jumps")
    run_to_idle(core)
    assert len(req.output_ids) == 2 and core.grammar_stepper.jump_forward_tokens == 0


def test_a_strategy_may_take_or_end_a_compiled_request(tiny_llama_dir: Path) -> None:
    class Take(StepStrategy):
        def admit_compiled(self, req: Req) -> bool | None:
            return {"taken": False, "ended": True}.get(req.rid)

    core = grammar_core(tiny_llama_dir)
    core.strategies.append(Take())
    taken = add(core, "taken", regex="x")
    ended = add(core, "ended", regex="x")
    plain = add(core, "plain", max_new_tokens=1, regex="x")
    seen = run_to_idle(core)
    assert sorted(r for s in seen for r in s) == ["ended", "plain"]
    assert taken.state == ReqState.WAITING and not taken.output_ids
    assert ended.output_ids == [] and plain.finished


def test_abort_of_a_compiling_request(tiny_llama_dir: Path) -> None:
    core = grammar_core(tiny_llama_dir)
    req = add(core, "g", regex="x")
    assert core.abort("g", "stop") is req and req.finish_reason.message == "stop"
    assert len(core.grammars) == 0


# -- outside the steps -----------------------------------------------------------------------


def test_paused_admission_keeps_waiting_requests_waiting(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    core.pause_admission(True)
    req = add(core, "a", max_new_tokens=1)
    core.step()
    assert req.state == ReqState.WAITING and core.drained()
    core.pause_admission(False)
    run_to_idle(core)
    assert req.finished


def test_drained_commits_a_step_in_flight(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir, enable_overlap_schedule=True)
    add(core, "a", max_new_tokens=1)
    assert core.step() == []
    assert not core.drained()  # the request is running
    core.step()  # the decode that ends it is in flight... or it finished with the prefill
    assert core.drained() and core._in_flight is None


def test_flush_cache_only_while_quiet(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    add(core, "a", max_new_tokens=1)
    run_to_idle(core)
    assert core.scheduler.cache.evictable_size > 0
    add(core, "b", max_new_tokens=1)
    assert not core.flush_cache() and not core.clear_cache_storage()
    assert core.scheduler.cache.evictable_size > 0
    run_to_idle(core)
    assert core.flush_cache()
    assert core.scheduler.cache.evictable_size == 0
    assert not core.clear_cache_storage()  # no storage tier


def test_update_weights_reports_a_bad_path_and_loads_a_good_one(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    rec = Recorder()
    core = make_core(tiny_llama_dir, rec)
    first = add(core, "a", max_new_tokens=3)
    run_to_idle(core)
    ok, message = core.update_weights(str(tmp_path / "none"))
    assert not ok
    assert message == (
        f"weights not loaded, the old ones still serve: '{tmp_path / 'none'}' is not a "
        "model directory or a .gguf file"
    )
    assert core.scheduler.cache.evictable_size > 0  # the cache stays
    other = make_tiny_llama_dir(tmp_path / "other", seed=1)
    rec.aliases["alias"] = str(other)
    assert core.update_weights("alias") == (True, "loaded weights from 'alias'")
    assert core.scheduler.cache.evictable_size == 0
    again = Req("a2", list(first.input_ids), greedy(3))
    core.add_request(again)
    run_to_idle(core)
    assert again.output_ids != first.output_ids
    assert core.update_weights(str(tiny_llama_dir))[0]
    back = Req("a3", list(first.input_ids), greedy(3))
    core.add_request(back)
    run_to_idle(core)
    assert back.output_ids == first.output_ids


def test_shutdown_closes_the_strategies_once(tiny_llama_dir: Path) -> None:
    closed: list[str] = []

    class Closes(StepStrategy):
        def close(self) -> None:
            closed.append("x")

    core = make_core(tiny_llama_dir)
    core.strategies.append(Closes())
    strategies = core.strategies
    core.shutdown()
    assert closed == ["x"] and len(strategies) == 0
    assert not hasattr(core, "runner") and not hasattr(core, "scheduler")
    core.shutdown()  # again: nothing left to do
    assert closed == ["x"]


# -- what the mutation run showed (tests/TESTING.md, run 17) ---------------------------------


class Clock:
    """time.perf_counter for the engine core: one second later at each reading."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("overlap", [False, True])
def test_each_steps_time_from_a_clock_that_ticks_per_reading(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    import radixserve.core.engine_core as engine_core

    done: list[tuple[str, float, bool]] = []

    class Done(StepStrategy):
        def step_done(self, plan: Any, seconds: float, overlapped: bool) -> None:
            done.append((plan.kind, seconds, overlapped))

    rec = Recorder()
    core = make_core(tiny_llama_dir, rec, enable_overlap_schedule=overlap)
    core.strategies.append(Done())
    add(core, "a", max_new_tokens=4)
    monkeypatch.setattr(engine_core, "time", Clock())
    run_to_idle(core)
    kinds = core.scheduler.stats.by_kind
    times = [s["step_time_s"] for s in rec.stats]
    if not overlap:  # per step: start, launch, result, stats
        assert done == [("prefill", 2.0, False)] + [("decode", 2.0, False)] * 3
        assert times == [3.0] * 4
        assert (kinds["prefill"].seconds, kinds["decode"].seconds) == (1.0, 3.0)
    else:  # a result comes during the next step (the last one's in a step planning nothing),
        # timed from its launch or the previous result, whichever came later
        assert done == [
            ("prefill", 5.0, False), ("decode", 4.0, True), ("decode", 4.0, True),
            ("decode", 3.0, True),
        ]  # fmt: skip
        assert times == [2.0, 3.0, 3.0, 3.0]
        assert (kinds["prefill"].seconds, kinds["decode"].seconds) == (4.0, 11.0)


def test_changes_made_outside_a_step_are_reported_by_the_next_one(tiny_llama_dir: Path) -> None:
    outside = Req("outside", [3], greedy(1))
    drained: list[Any] = []

    class Drain(StepStrategy):
        def drain(self, scheduler: Any) -> list[Req]:
            drained.append(scheduler)
            return [outside] if len(drained) == 1 else []

    core = grammar_core(tiny_llama_dir)
    core.strategies.append(Drain())
    assert not core.has_work()
    core.abort("nobody")  # the strategy hands a request back
    assert drained == [core.scheduler] and core.has_work()
    forced = add(core, "g", max_new_tokens=1, regex="The quick brown fox jumps")
    core.grammars.wait(30.0)  # until it compiled (on a worker thread)
    assert sorted(r.rid for r in core.step()) == ["g", "outside"]
    assert forced.finished and not core.has_work()


def test_a_compiled_request_ending_at_admission_is_reported_beside_the_step_in_flight(
    tiny_llama_dir: Path,
) -> None:
    asked: list[Any] = []

    class Host(StepStrategy):
        def needs_host_tokens(self, scheduler: Any) -> bool:
            asked.append(scheduler)
            return True

    core = grammar_core(tiny_llama_dir, enable_overlap_schedule=True)
    core.strategies.append(Host())
    add(core, "a", max_new_tokens=3)
    assert core.step() == []  # the prefill is in flight
    add(core, "g", max_new_tokens=1, regex="The quick brown fox jumps")
    core.grammars.wait(30.0)  # until it compiled (on a worker thread)
    assert sorted(r.rid for r in core.step()) == ["a", "g"]
    assert asked and all(s is core.scheduler for s in asked)


def test_idle_wait_is_none_while_a_grammar_compiles(tiny_llama_dir: Path) -> None:
    core = grammar_core(tiny_llama_dir)
    core.strategies.append(Waits(0.5))
    add(core, "g", regex="x")
    assert core.idle_wait() is None
    core.abort("g")
    assert core.idle_wait() == 0.5


def test_the_sampler_is_given_the_engines_stop_tokens(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    first = add(core, "a", max_new_tokens=1)
    run_to_idle(core)
    [token] = first.output_ids
    core.eos_token_ids = (token,)  # the sampler's stop tokens (the stop checker keeps its own)
    again = Req("b", list(first.input_ids), SamplingParams(max_new_tokens=1, min_new_tokens=1))
    again.sampling.temperature, again.sampling.ignore_eos = 0.0, True
    core.add_request(again)
    run_to_idle(core)
    assert again.failed is None and again.finish_reason.type == "length"
    assert len(again.output_ids) == 1 and again.output_ids != [token]  # masked: min_new_tokens


def test_the_leak_check_runs_only_when_asked_and_idle(tiny_llama_dir: Path) -> None:
    for check in (False, True):
        core = make_core(tiny_llama_dir, debug_leak_check=check)
        add(core, "a", max_new_tokens=1)
        add(core, "bb", max_new_tokens=3)
        core.step()  # "a" ended: work is left
        core.scheduler.allocator.alloc(4)  # slots nobody holds: a leak
        core.step()
        if check:
            with pytest.raises(AssertionError, match="KV leak at idle"):
                core.step()
        else:
            core.step()
            assert not core.has_work()


def test_failures_are_logged(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Boom(StepStrategy):
        def before_forward(self, batch: Any) -> None:
            raise RuntimeError("boom")

    core = make_core(tiny_llama_dir)
    boom = Boom()
    core.strategies.append(boom)
    add(core, "a"), add(core, "bb")
    with caplog.at_level("INFO", logger="radixserve.core.engine_core"):
        core.step()
        core.strategies.remove(boom)
        assert not core.update_weights("/nonexistent")[0]
        assert core.update_weights(str(tiny_llama_dir))[0]
    assert [r.getMessage() for r in caplog.records] == [
        "a step of 2 requests failed: RuntimeError('boom'); aborting them",
        "weights from /nonexistent not loaded: '/nonexistent' is not a model directory or a "
        ".gguf file",
        f"loaded weights from {tiny_llama_dir}",
    ]


def test_weights_are_updated_only_when_drained(tiny_llama_dir: Path) -> None:
    core = make_core(tiny_llama_dir)
    add(core, "a")
    core.step()
    with pytest.raises(AssertionError, match="^update the weights only when no request runs$"):
        core.update_weights(str(tiny_llama_dir))


def test_the_engines_settings_reach_its_parts(tiny_llama_dir: Path) -> None:
    core = grammar_core(
        tiny_llama_dir, chunked_prefill_size=64, max_running_requests=5, schedule_policy="fcfs",
        random_seed=3, enable_priority_scheduling=True, schedule_low_priority_values_first=True,
        priority_aging_steps=7, schedule_conservativeness=0.5, disable_mixed_chunk=True,
        prefill_shrink_after_decodes=3, prefill_gather_steps=2, context_length=300,
        grammar_compile_timeout=12.0, session_pin_ratio=0.25,
    )  # fmt: skip
    cfg = core.scheduler.config
    assert (cfg.max_running_requests, cfg.chunked_prefill_size) == (5, 64)
    assert (cfg.prefill_shrink_after_decodes, cfg.prefill_gather_steps) == (3, 2)
    assert (cfg.mixed_chunk, cfg.schedule_policy, cfg.max_context) == (False, "fcfs", 300)
    assert cfg.random_seed == 3 and cfg.enable_priority_scheduling
    assert cfg.schedule_low_priority_values_first and cfg.priority_aging_steps == 7
    assert cfg.init_new_token_ratio == pytest.approx(0.35)
    assert cfg.min_new_token_ratio == pytest.approx(0.35 * 0.14)
    stop = core.scheduler.stop_checker
    assert stop.eos_token_ids == {0} and stop.max_context == 300 == core.max_context
    assert core.scheduler.grammar is core.grammar_stepper
    assert core.grammar_stepper.tokenizer is core.tokenizer
    assert core.scheduler.cache is core.cache and core.scheduler.allocator is core.runner.allocator
    assert core.scheduler.req_to_token is core.runner.req_to_token
    assert core.scheduler.strategies is core.strategies is core.runner.strategies
    assert core.strategies[-1] is core.sessions and core.sessions.pin_limit == POOL // 4
    masker = core.runner.grammar_masker
    assert (masker.rows, masker.vocab_size) == (5, core.runner.model_config.vocab_size)
    assert (core.grammars.backend_name, core.grammars.timeout_s) == ("forced", 12.0)
    default = make_core(tiny_llama_dir)
    assert default.scheduler.config.mixed_chunk and default.grammar_stepper.jump_forward


def test_the_callers_defaults_and_the_ready_log(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = EngineConfig(**on_cpu({"max_total_tokens": POOL}))
    with caplog.at_level("INFO", logger="radixserve.core.engine_core"):
        core = EngineCore(
            tiny_llama_dir, config, PluginHost(), usage=("test", {"chunked_prefill_size": 96})
        )
    assert core.scheduler.config.chunked_prefill_size == 96
    assert core.runner.settings.origins["chunked_prefill_size"] == "test default"
    [ready] = [r.getMessage() for r in caplog.records]
    assert ready.startswith(f"engine ready: {{'model_path': '{tiny_llama_dir}', 'plugins': ")


def test_stop_tokens_from_the_model_config_else_the_tokenizer(tmp_path: Path) -> None:
    own = make_core(make_tiny_llama_dir(tmp_path / "own", eos_token_id=5))
    assert own.eos_token_ids == (5,) and own.scheduler.stop_checker.eos_token_ids == {5}
    none = make_core(make_tiny_llama_dir(tmp_path / "none", eos_token_id=None))
    assert none.eos_token_ids == none.tokenizer.eos_token_ids() != ()


@pytest.mark.parametrize(
    ("pooling", "labels", "message"),
    [
        ("max", None, "pooling must be one of ('last', 'mean'), got 'max'"),
        (None, [3, 10**6], "label_token_ids must be token ids in [0, "),
    ],
)
def test_pooling_and_labels_are_validated(
    tiny_llama_dir: Path, pooling: str | None, labels: list[int] | None, message: str
) -> None:
    core = make_core(tiny_llama_dir)
    req = Req("e", [3, 4], SamplingParams(max_new_tokens=0))
    req.pooling, req.label_token_ids = pooling, labels
    with pytest.raises(InvalidRequest) as e:
        core.add_request(req)
    assert str(e.value).startswith(message)


def test_a_strategys_own_step_holds_while_a_grammar_compiles(tiny_llama_dir: Path) -> None:
    holds: list[bool] = []

    class Own(StepStrategy):
        def run_own_step(self, scheduler: Any, hold: bool) -> tuple[list[Any], bool]:
            holds.append(hold)
            return [], True

    release = threading.Event()
    plugin = ForcedPlugin(release)
    core = make_core(tiny_llama_dir, plugin, grammar_backend="forced")
    core.strategies.append(Own())
    add(core, "g", regex="x")
    core.step()
    release.set()
    core.grammars.wait(30.0)
    core.step()
    assert holds == [True, False]
    [(tokenizer, vocab, stops)] = plugin.made
    assert tokenizer is core.tokenizer and stops == [0]
    assert vocab == core.runner.model_config.vocab_size
