"""EngineCore: the engine's main loop in one place — validate, queue, and per step
``plan -> execute -> commit``: the scheduler plans (core/step_plan.py), the model runner
executes the plan, the scheduler commits its result; the step strategies (core/interfaces.py,
``StepStrategy``; core/strategies.py builds them) plug in at fixed points of that loop. It is
process-agnostic: the offline Engine drives it from a thread, the server's engine process
from its socket loop."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from radixserve.core import deterministic
from radixserve.core.cache_setup import build_cache
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.distributed import Rendezvous
from radixserve.core.engine_views import EngineViews
from radixserve.core.grammar import GrammarMasker, GrammarStepper
from radixserve.core.grammar_queue import GrammarQueue
from radixserve.core.model_runner import LaunchedStep, ModelRunner
from radixserve.core.multimodal_strategy import text_ids
from radixserve.core.plugins import PluginHost
from radixserve.core.request import InvalidRequest, Req
from radixserve.core.scheduler import Scheduler, SchedulerConfig, new_token_ratios
from radixserve.core.sessions import SessionTable
from radixserve.core.step_plan import RetractionNeeded, StepPlan
from radixserve.core.stop import StopChecker
from radixserve.core.strategies import build_all
from radixserve.core.strategy_list import StrategyList
from radixserve.core.tokenizer import Tokenizer
from radixserve.core.validation import ServingLimits, check_request, fit_output_budget

logger = logging.getLogger(__name__)


class InFlightStep(NamedTuple):
    batch: StepPlan
    launched: LaunchedStep
    launched_at: float  # time.perf_counter()
    scheduled_at: float  # when the step that launched it began (its strategies' work included)
    overlapped: bool  # launched while the previous step was still on the device


class EngineCore(EngineViews):
    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        host: PluginHost,
        rendezvous: Rendezvous | None = None,
        usage: tuple[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """``rendezvous``: this process as rank 0 of an engine of several ranks, whose other
        ranks were started beside it (see ModelRunner); ``usage``: the caller's defaults (see
        ModelRunner)."""
        self.host = host
        self.strategies = StrategyList()  # built once the scheduler exists
        self.runner = ModelRunner(model_dir, config, host, rendezvous, usage)
        # From here on, every setting a platform may default is resolved.
        self.config = config = self.runner.config
        settings = self.runner.settings
        self.tokenizer = Tokenizer(model_dir)
        mc = self.runner.model_config
        self.eos_token_ids = tuple(mc.eos_token_ids) or self.tokenizer.eos_token_ids()
        self.max_context = self.runner.max_context
        self.cache = build_cache(self.runner, config, host, str(model_dir))
        self.grammars = self._grammar_queue(host)
        self.runner.grammar_masker = GrammarMasker(
            lambda: self.grammars.backend, settings.max_running_requests, mc.vocab_size
        )
        self.grammar_stepper = GrammarStepper(self.tokenizer, not config.disable_jump_forward)
        # Overlap scheduling: where the device runs asynchronously, step N+1 is scheduled and
        # queued while the device computes step N (see step()). A step whose strategy needs
        # the last tokens on the host is not overlapped (``needs_host_tokens``), but plain
        # steps are, also with such a strategy enabled.
        self.overlap = not config.disable_overlap_schedule and (
            self.runner.platform.asynchronous or config.enable_overlap_schedule
        )
        self._in_flight: InFlightStep | None = None
        self.overlapped_steps = 0  # steps launched while the previous one was on the device
        self._last_result_at = 0.0  # when the previous step's result came (timing per kind)
        self._changed_outside_step: list[Req] = []
        self.scheduler = self._scheduler()
        # The step strategies (core/strategies.py), called at the loop's fixed points; the
        # sessions that keep their KV pinned between turns (core/sessions.py) are one.
        size = self.runner.allocator.size
        self.sessions = SessionTable(self.cache, size, config.session_pin_ratio)
        self.strategies = StrategyList(build_all(self, host, model_dir) + [self.sessions])
        self.scheduler.strategies = self.runner.strategies = self.strategies
        info = {
            "model_path": str(model_dir),
            "plugins": dict(self.runner.plugins.names),
            "kv_tokens": self.runner.kv_size,
            "max_context": self.max_context,
            "settings": settings.describe(),
        }
        logger.info("engine ready: %s", info)
        host.hook.engine_started(info=info)

    def _scheduler(self) -> Scheduler:
        config, settings = self.config, self.runner.settings
        return Scheduler(
            SchedulerConfig(
                max_running_requests=settings.max_running_requests,
                chunked_prefill_size=settings.chunked_prefill_size,
                prefill_shrink_after_decodes=settings.prefill_shrink_after_decodes,
                prefill_gather_steps=settings.prefill_gather_steps,
                mixed_chunk=not config.disable_mixed_chunk,
                schedule_policy=config.schedule_policy,
                max_context=self.max_context,
                random_seed=config.random_seed,
                enable_priority_scheduling=config.enable_priority_scheduling,
                schedule_low_priority_values_first=config.schedule_low_priority_values_first,
                priority_aging_steps=config.priority_aging_steps,
                **new_token_ratios(config.schedule_conservativeness),
            ),
            self.runner.allocator,
            self.runner.req_to_token,
            self.cache,
            StopChecker(self.tokenizer, self.eos_token_ids, self.max_context),
            self.grammar_stepper,
        )

    def spec_stats(self) -> dict[str, object] | None:
        """The step strategies' stats for /server_info (None when no strategy keeps them)."""
        return next((x for s in self.strategies if (x := s.spec_stats()) is not None), None)

    def _grammar_queue(self, host: PluginHost) -> GrammarQueue:
        name = self.runner.plugins.names["grammar"]
        factory = host.registries["grammar"].get(name).factory
        vocab, stops = self.runner.model_config.vocab_size, list(self.eos_token_ids)
        return GrammarQueue(
            name, lambda: factory(self.tokenizer, vocab, stops), self.config.grammar_compile_timeout
        )

    def validate(self, req: Req) -> None:
        """Raise InvalidRequest when ``req`` can never be served (core/validation.py); cut its
        output budget to what the KV pool holds beside its prompt."""
        usable = self.runner.allocator.size  # whole pages only
        limits = ServingLimits(
            self.runner.model_config.vocab_size, self.max_context, usable,
            deterministic.default_seed(self.config),
        )  # fmt: skip
        check_request(
            text_ids(req), req.sampling, limits,
            pooling=req.pooling, label_token_ids=req.label_token_ids,
        )  # fmt: skip
        req.sampling = fit_output_budget(req.sampling, len(req.input_ids), usable)

    def add_request(self, req: Req) -> None:
        """Queue ``req``; one with a grammar first waits for it to compile (off this thread);
        a strategy may hold it instead (e.g. until its KV arrived)."""
        compiling = req.sampling.grammar is not None
        try:
            for strategy in self.strategies:
                strategy.prepare(req)
            self.validate(req)
            held = [s.admit(req, compiling) for s in self.strategies]
        except InvalidRequest as e:
            for strategy in self.strategies:
                strategy.refused(req, str(e))
            raise
        if compiling:
            self.grammars.submit(req)
        elif not any(held):
            self.scheduler.add_request(req)

    def cancel_room(
        self, room: int, message: str, peer: tuple[str, int] | None = None, refused: bool = True
    ) -> None:
        """This server refused a request of ``room`` (here or in the server): on a prefill the
        peer waiting for its KV learns why at once, and whether the request was at fault
        (``refused``: the peer answers 400; else 500, e.g. an overloaded prefill, which a
        router may retry elsewhere); on a decode the prefill at ``peer`` does, and gives the
        room up. Rooms of live requests are left alone."""
        for strategy in self.strategies:
            strategy.cancel_room(room, message, peer, refused)

    def abort(self, rid: str, message: str = "aborted by the client") -> Req | None:
        self._sync()
        req = self.grammars.abort(rid, message) or self.scheduler.abort(rid, message)
        for strategy in self.strategies:
            req = req or strategy.abort(rid, message)
        if req is not None:
            for strategy in self.strategies:
                strategy.ended([req])
        return req

    def has_work(self) -> bool:
        return (
            self.scheduler.has_work()
            or len(self.grammars) > 0
            or self._in_flight is not None
            or bool(self._changed_outside_step)
            or any(s.has_work() for s in self.strategies.on.has_work)
        )

    def idle_wait(self) -> float | None:
        """Seconds the engine may sleep on its sockets (and the KV connector's wakeup_fd)
        before stepping again, when its only work is waiting for something outside it (KV
        arriving); None when it has a step to run."""
        waiting = self.strategies.on.wait_timeout
        waits = [t for s in waiting if (t := s.wait_timeout()) is not None]
        if not waits:
            return None
        if self.scheduler.has_work() or len(self.grammars) or self._in_flight is not None:
            return None
        if any(s.has_work() and s.wait_timeout() is None for s in waiting):
            return None  # a strategy runs steps itself
        return None if self._changed_outside_step else min(waits)

    def step(self) -> list[Req]:
        """Run one step; return the requests with new tokens or a new finish.

        With overlap scheduling the step is queued on the device and the previous step's
        tokens are committed while it runs, so what a step returns is one step old."""
        on = self.strategies.on
        changed = [r for s in on.poll for r in s.poll()] if on.poll else []  # e.g. KV arrived
        changed += self._step()
        for strategy in on.ended:
            strategy.ended(changed)
        return changed

    def _step(self) -> list[Req]:
        """plan -> execute -> commit: the strategies may run the step themselves; else the
        scheduler plans it, the runner launches it and its result is committed (at once, or
        during the next step with overlap scheduling)."""
        start = time.perf_counter()
        changed, self._changed_outside_step = self._changed_outside_step, []
        if len(self.grammars):
            changed += self._admit_compiled()
        wants_tokens = self.strategies.on.needs_host_tokens
        if self._in_flight is not None and (
            not self._in_flight.launched.overlappable
            or any(s.needs_host_tokens(self.scheduler) for s in wants_tokens)
        ):
            changed += self._commit_in_flight()
        if self._in_flight is None:
            ran = False
            for strategy in self.strategies.on.run_own_step:
                own, done = strategy.run_own_step(self.scheduler, len(self.grammars) > 0)
                changed += own
                ran = ran or done
            if ran:
                return changed
        try:
            plan = self.scheduler.schedule(allow_retract=self._in_flight is None)
        except RetractionNeeded:
            changed += self._commit_in_flight()
            plan = self.scheduler.schedule()
        changed += self.scheduler.pop_ended()
        if plan is None:
            return changed + self._nothing_planned()
        return changed + self._execute(plan, start)

    def _nothing_planned(self) -> list[Req]:
        if self._in_flight is not None:
            return self._commit_in_flight()
        if len(self.grammars) and not self.scheduler.has_work():
            self.grammars.wait()  # idle until a grammar compiles: no busy loop
            return []
        return self.scheduler.end_unschedulable()

    def _execute(self, plan: StepPlan, start: float) -> list[Req]:
        """Launch ``plan`` on the device; commit the step before it meanwhile (overlap) or
        ``plan`` itself at once."""
        prev_ids = self._in_flight.launched.next_ids if self._in_flight is not None else None
        sample_rows = self.scheduler.needs_sampling(plan)
        launched_at = time.perf_counter()
        try:
            launched = self.runner.launch(plan, sample_rows, self.eos_token_ids, prev_ids)
        except Exception as e:  # noqa: BLE001 - a failing request must not end the engine
            return self._fail_batch(plan, e)
        self.scheduler.advance(plan)
        changed: list[Req] = []
        overlapped = self._in_flight is not None
        if overlapped:
            self.overlapped_steps += 1
            changed += self._commit_in_flight()  # the device computes `plan` meanwhile
        self._in_flight = InFlightStep(plan, launched, launched_at, start, overlapped)
        if not self.overlap:
            changed += self._commit_in_flight()
        if any(r.failed for r in plan.reqs):  # the sampler could not serve these alone
            changed += self._end_failed(plan)
        self.host.hook.step_finished(
            stats={
                "num_decode": plan.num_decode,
                "num_prefill_tokens": sum(plan.extend_lens) - plan.num_decode,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "step_time_s": time.perf_counter() - start,
            }
        )
        if self.config.debug_leak_check and not self.has_work():
            self.scheduler.check_no_leak()
        return changed

    def _commit_in_flight(self) -> list[Req]:
        """Wait for the step on the device and append its tokens."""
        assert self._in_flight is not None
        step, self._in_flight = self._in_flight, None
        changed = self.scheduler.commit(step.batch, step.launched.result())
        # A step's wall time: from its launch, or from the previous step's result where the
        # device was still on that one (overlap), to its own result; for the strategies, from
        # its planning.
        now = time.perf_counter()
        spent = now - max(step.launched_at, self._last_result_at)
        cycle = now - max(step.scheduled_at, self._last_result_at)
        for strategy in self.strategies.on.step_done:
            strategy.step_done(step.batch, cycle, step.overlapped)
        self._last_result_at = now
        self.scheduler.stats.by_kind[step.batch.kind].seconds += spent
        return changed

    def _fail_batch(self, batch: StepPlan, error: Exception) -> list[Req]:
        """Launching ``batch`` raised: end its requests with an abort naming the error (the
        server answers 500) and go on with the rest. The step's slots are accounted as if it
        ran, then every unlocked prefix leaves the cache: what the step wrote is not trusted."""
        logger.error("a step of %d requests failed: %r; aborting them", len(batch.reqs), error)
        self.scheduler.advance(batch)
        changed = self._commit_in_flight() if self._in_flight is not None else []
        message = f"the engine failed on this request's step ({type(error).__name__}: {error})"
        for req in batch.reqs:
            if self.scheduler.abort(req.rid, message) is not None:
                req.failed = message
                changed.append(req)
        self.cache.flush()
        return changed

    def _end_failed(self, batch: StepPlan) -> list[Req]:
        ended = [r for r in batch.reqs if r.failed and not r.finished]
        for req in ended:
            self.abort(req.rid, str(req.failed))
        return ended

    def _sync(self) -> None:
        """Commit any step in flight (its requests are reported by the next ``step``), so the
        scheduler's state is whole before it is changed from outside a step."""
        if self._in_flight is not None:
            self._changed_outside_step += self._commit_in_flight()
        for strategy in self.strategies:
            self._changed_outside_step += strategy.drain(self.scheduler)

    def _admit_compiled(self) -> list[Req]:
        """Move requests whose grammar compiled to the scheduler (or to a strategy that takes
        them), after jumping forward over any prefix the grammar forces; return those that
        finished (failed) instead."""
        ready, finished = self.grammars.pop_done()
        for req in ready:
            taken = [t for s in self.strategies if (t := s.admit_compiled(req)) is not None]
            if taken:
                if any(taken):
                    finished.append(req)
                continue
            for token in self.grammar_stepper.forced_tokens(req):
                self.scheduler.stop_checker.append(req, token)
                if req.finished:  # a stop (or the length) ends the forced text here
                    break
            if req.finished:
                finished.append(req)
            else:
                self.scheduler.add_request(req)
        for strategy in self.strategies:
            strategy.ended_unscheduled(finished)
        return finished

    def shutdown(self) -> None:
        """Stop the grammar workers and let go of everything on the device (model, KV pool,
        step executor, cached prefixes), then have the platform give cached memory back, so
        another engine can start in this process at once. The core cannot step afterwards."""
        self.grammars.shutdown()
        self._close_strategies()
        if not hasattr(self, "runner"):
            return  # already shut down
        platform = self.runner.platform
        self.runner.close()  # the engine's other ranks stop with this one
        self._in_flight = None
        self._changed_outside_step = []
        # NOTE: these three hold every device tensor (and the strategies did). Some
        # sit in reference cycles (closures over this core), so collect before the platform
        # empties its cache.
        del self.runner, self.scheduler, self.cache
        gc.collect()
        platform.empty_cache()
        platform.release()

    def _close_strategies(self) -> None:
        """Close and drop every strategy (the scheduler and runner share the list): no
        reference to one outlives this call (shutdown empties the device's cache next)."""
        for strategy in self.strategies:
            strategy.close()
        self.strategies.clear()

    def pause_admission(self, paused: bool) -> None:
        """Stop (or resume) admitting waiting requests; running ones go on to the end."""
        self.scheduler.paused = paused

    def drained(self) -> bool:
        """No request runs and no step is on the device (waiting ones may be queued)."""
        if self.scheduler.running:
            return False
        self._sync()
        return not self.scheduler.running

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        """Load new weights in place once drained; every cached prefix is dropped (its KV came
        from the old weights). On failure the old weights keep serving.
        Returns (success, message)."""
        assert self.drained(), "update the weights only when no request runs"
        try:
            resolved = self.host.hook.resolve_model_dir(model_path=model_path) or model_path
            if not Path(resolved).is_dir():
                raise ConfigError(f"'{model_path}' is not a model directory or a .gguf file")
            self.runner.reload_weights(Path(resolved))
        except Exception as e:  # noqa: BLE001 - any failure leaves the old weights; it is reported
            logger.warning("weights from %s not loaded: %s", model_path, e)
            return False, f"weights not loaded, the old ones still serve: {e}"
        self.sessions.unpin_all()  # their KV came from the old weights
        self.cache.flush()
        self.cache.clear_storage()  # its pages hold the old weights' KV
        logger.info("loaded weights from %s", model_path)
        return True, f"loaded weights from '{model_path}'"

    def flush_cache(self) -> bool:
        """Drop every cached prefix (device and host tiers); only allowed while no request
        runs."""
        if not self._quiet():
            return False
        self.sessions.unpin_all()  # sessions stay open; their next turn computes again
        self.cache.flush()
        return True

    def clear_cache_storage(self) -> bool:
        """Drop the pages of the hierarchical cache's storage tier; only allowed while no
        request runs, and False where there is no such tier."""
        return self._quiet() and self.cache.clear_storage()

    def _quiet(self) -> bool:
        """True when, the step in flight committed, no request is left running or waiting."""
        self._sync()
        return not self.scheduler.has_work()
