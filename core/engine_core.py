"""EngineCore: the engine's main loop in one place — validate, queue, and per step
``schedule -> run batch -> process output``. It is process-agnostic: the offline Engine drives
it from a thread, the server's engine process from its socket loop."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.disaggregation import DecodeSide, PrefillSide, transfers
from radixserve.core.distributed import Rendezvous
from radixserve.core.grammar import GrammarMasker, GrammarStepper
from radixserve.core.grammar_queue import GrammarQueue
from radixserve.core.interfaces import SpeculativeContext
from radixserve.core.model_runner import LaunchedStep, ModelRunner
from radixserve.core.plugins import PluginHost
from radixserve.core.radix_cache import NoPrefixCache, RadixCache
from radixserve.core.request import FinishReason, InvalidRequest, Req
from radixserve.core.scheduler import (
    RetractionNeeded,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    new_token_ratios,
)
from radixserve.core.spec_loop import LOOP_BATCH, DeviceVerify, SpecLoop
from radixserve.core.speculative import Speculator
from radixserve.core.stop import StopChecker
from radixserve.core.tokenizer import Tokenizer
from radixserve.core.validation import ServingLimits, check_request, fit_output_budget

logger = logging.getLogger(__name__)


class InFlightStep(NamedTuple):
    batch: ScheduledBatch
    launched: LaunchedStep
    launched_at: float  # time.perf_counter()
    scheduled_at: float  # when the step that launched it began (drafting included)
    overlapped: bool  # launched while the previous step was still on the device


class EngineCore:
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
        self.runner = ModelRunner(model_dir, config, host, rendezvous, usage)
        # From here on, every setting a platform may default is resolved.
        self.config = config = self.runner.config
        settings = self.runner.settings
        self.tokenizer = Tokenizer(model_dir)
        mc = self.runner.model_config
        self.eos_token_ids = tuple(mc.eos_token_ids) or _eos_from_tokenizer(self.tokenizer)
        self.max_context = self.runner.max_context
        cache_cls = NoPrefixCache if config.disable_radix_cache else RadixCache
        self.cache = cache_cls(self.runner.allocator, self.runner.req_to_token)
        self.grammars = self._grammar_queue(host)
        self.runner.grammar_masker = GrammarMasker(
            lambda: self.grammars.backend, settings.max_running_requests, mc.vocab_size
        )
        self.grammar_stepper = GrammarStepper(self.tokenizer, not config.disable_jump_forward)
        self.speculator = self._speculator(host, model_dir)
        self.runner.speculator = self.speculator
        algorithm = self.speculator.algorithm if self.speculator is not None else None
        if algorithm is not None and algorithm.capture_hidden_layers:
            consumer = algorithm.target_hidden if algorithm.target_hidden_capturable else None
            self.runner.keep_hidden_layers(algorithm.capture_hidden_layers, consumer)
        # Overlap scheduling: where the device runs asynchronously, step N+1 is scheduled and
        # queued while the device computes step N (see step()). A speculating step is not
        # overlapped (drafts need the last token on the host, and verify samples there), but
        # decode-only steps are, also with speculation on: while every request's drafting is
        # paused, decoding runs as fast as with speculation off.
        self.overlap = not config.disable_overlap_schedule and (
            self.runner.platform.asynchronous or config.enable_overlap_schedule
        )
        self._in_flight: InFlightStep | None = None
        self.overlapped_steps = 0  # steps launched while the previous one was on the device
        self._last_result_at = 0.0  # when the previous step's result came (timing per kind)
        self._drafted_last: frozenset[str] = frozenset()  # requests that drafted in that step
        self._changed_outside_step: list[Req] = []
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running_requests=settings.max_running_requests,
                chunked_prefill_size=settings.chunked_prefill_size,
                prefill_shrink_after_decodes=settings.prefill_shrink_after_decodes,
                prefill_gather_steps=settings.prefill_gather_steps,
                uniform_drafts=getattr(self.runner.step, "uniform_verify", False),
                mixed_chunk=not config.disable_mixed_chunk,
                schedule_policy=config.schedule_policy,
                max_context=self.max_context,
                random_seed=config.random_seed,
                **new_token_ratios(config.schedule_conservativeness),
            ),
            self.runner.allocator,
            self.runner.req_to_token,
            self.cache,
            StopChecker(self.tokenizer, self.eos_token_ids, self.max_context),
            self.grammar_stepper,
            self.speculator,
        )
        self.spec_loop = self._spec_loop()
        self.disagg = self._disaggregation(host)
        info = {
            "model_path": str(model_dir),
            "plugins": dict(self.runner.plugins.names),
            "kv_tokens": self.runner.kv_size,
            "max_context": self.max_context,
            "settings": settings.describe(),
        }
        logger.info("engine ready: %s", info)
        host.hook.engine_started(info=info)

    def _disaggregation(self, host: PluginHost) -> PrefillSide | DecodeSide | None:
        """The prefill or decode side of disaggregation, with its started KV connector."""
        config = self.config
        if config.disaggregation_mode == "null":
            return None
        name = self.runner.plugins.names["kv_transfer"]
        connector = host.registries["kv_transfer"].get(name).factory()
        connector.bootstrap_host = config.disaggregation_bootstrap_host or ""
        connector.start(
            config.disaggregation_mode,
            self.runner.kv_pool,
            config.disaggregation_bootstrap_port,
            config.disaggregation_transfer_timeout,
        )
        if config.disaggregation_mode == "prefill":
            return PrefillSide(connector, self.scheduler, self.abort)
        return DecodeSide(connector, self.scheduler, config.disaggregation_transfer_timeout)

    def _speculator(self, host: PluginHost, model_dir: Path) -> Speculator | None:
        name = self.runner.plugins.names["speculative"]
        if name == "none":
            return None
        runner, config = self.runner, self.config
        algorithm = runner.speculative_algorithm
        algorithm.setup(
            SpeculativeContext(
                config=config,
                model_config=runner.model_config,
                model_path=str(model_dir),
                host=host,
                platform=runner.platform,
                dtype=runner.dtype,
                device=runner.device,
                attention=runner.plugins.names["attention"],
                kv_size=runner.kv_size,
                page_size=config.page_size,
                req_to_token=runner.req_to_token,
                eos_token_ids=self.eos_token_ids,
                target_model=runner.model,
                free_counts=runner.allocator.free_counts,
            )
        )
        return Speculator(
            algorithm,
            name,
            config.draft_depth,
            runner.settings.speculative_disable_batch_size,
            runner.model_config.vocab_size,
            config.speculative_simulate_accept_len,
            config.random_seed,
            pause_unprofitable=not config.speculative_disable_pause,
            tree_nodes=config.tree_nodes,
        )

    def _spec_loop(self) -> SpecLoop | None:
        """The device-side speculative loop (core/spec_loop.py), where the plugin offers a
        cycle and the attention backend prepares from device tensors on an asynchronous
        device (FlashInfer plans on the host: no loop)."""
        sp, config, runner = self.speculator, self.config, self.runner
        if sp is None or config.disable_speculative_loop or sp.tree_nodes:
            return None
        if sp.simulate_accept_len is not None:
            return None
        asynchronous = runner.platform.asynchronous
        if not (asynchronous or config.enable_speculative_loop):
            return None
        attention = runner.attention
        if asynchronous and (
            not hasattr(attention, "prepare_verify_graph")
            or hasattr(attention, "plan_decode_graph")
        ):
            return None
        algorithm = sp.algorithm
        verify = DeviceVerify(
            runner.model, attention, runner.kv_pool, runner.req_to_token,
            tuple(algorithm.capture_hidden_layers), algorithm.target_hidden,
        )  # fmt: skip
        cycle = algorithm.device_cycle(verify, min(LOOP_BATCH, sp.disable_batch_size))
        if cycle is None:
            return None
        logger.info("speculation loops on the device for up to %d requests", cycle.max_batch)
        return SpecLoop(cycle, self.scheduler, sp, self.max_context)

    def spec_stats(self) -> dict[str, object] | None:
        """Speculation's settings and accept statistics (None when speculation is off)."""
        if self.speculator is None:
            return None
        sp = self.speculator
        return {
            "algorithm": sp.name,
            "num_draft_tokens": sp.num_draft,
            "disable_batch_size": sp.disable_batch_size,
            "simulated_accept_len": sp.simulate_accept_len,
            **sp.stats.to_json(),
        }

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
        limits = ServingLimits(self.runner.model_config.vocab_size, self.max_context, usable)
        check_request(
            req.input_ids, req.sampling, limits,
            pooling=req.pooling, label_token_ids=req.label_token_ids,
        )  # fmt: skip
        req.sampling = fit_output_budget(req.sampling, len(req.input_ids), usable)

    def add_request(self, req: Req) -> None:
        """Queue ``req``; one with a grammar first waits for it to compile (off this thread)."""
        b = req.bootstrap
        try:
            self.validate(req)
            if b is not None and (self.disagg is None or not transfers(req)):
                req.bootstrap = None  # nothing to transfer: the request runs whole here
            if req.bootstrap is not None and self.disagg is not None:
                compiling = req.sampling.grammar is not None
                if isinstance(self.disagg, DecodeSide) and compiling:
                    self.disagg.check(req)  # waits for its KV once its grammar compiled
                else:
                    self.disagg.add(req)
        except InvalidRequest as e:
            if b is not None:
                self.cancel_room(b.room, str(e), (b.host, b.port))
            raise
        if req.sampling.grammar is not None:
            self.grammars.submit(req)
        elif req.bootstrap is None or not isinstance(self.disagg, DecodeSide):
            self.scheduler.add_request(req)  # (a decode's waits for its KV in disagg)

    def cancel_room(
        self, room: int, message: str, peer: tuple[str, int] | None = None, refused: bool = True
    ) -> None:
        """This server refused a request of ``room`` (here or in the server): on a prefill the
        decode waiting for its KV learns why at once, and whether the request was at fault
        (``refused``: the decode answers 400; else 500, e.g. an overloaded prefill, which a
        router may retry elsewhere); on a decode the prefill at ``peer`` (its bootstrap server)
        does, and gives the room up. Rooms of live requests are left alone."""
        disagg = self.disagg
        if isinstance(disagg, PrefillSide) and room not in disagg.live:
            if refused:
                reason = f"the prefill server refused the request: {message}"
            else:
                reason = f"the prefill server could not take the request: {message}"
            disagg.connector.cancel(room, reason, refused=refused)
        elif isinstance(disagg, DecodeSide) and peer is not None and not disagg.holds(room):
            reason = f"the decode server refused the request: {message}"
            disagg.connector.refuse(room, peer, reason)

    def abort(self, rid: str, message: str = "aborted by the client") -> Req | None:
        self._sync()
        req = self.grammars.abort(rid, message) or self.scheduler.abort(rid, message)
        if self.disagg is not None:
            req = req or self.disagg.abort(rid, message)
            if req is not None:
                self.disagg.ended([req])
        return req

    def has_work(self) -> bool:
        return (
            self.scheduler.has_work()
            or self._looping()
            or len(self.grammars) > 0
            or self._in_flight is not None
            or bool(self._changed_outside_step)
            or (self.disagg is not None and self.disagg.has_work())
        )

    def idle_wait(self) -> float | None:
        """Seconds the engine may sleep on its sockets (and the KV connector's wakeup_fd)
        before stepping again, when its only work is waiting for KV transfers; None when it
        has a step to run."""
        if self.disagg is None or not self.disagg.has_work():
            return None
        if self.scheduler.has_work() or len(self.grammars) or self._in_flight is not None:
            return None
        if self._looping():
            return None
        return None if self._changed_outside_step else self.disagg.wait_timeout()

    def step(self) -> list[Req]:
        """Run one step; return the requests with new tokens or a new finish.

        With overlap scheduling the step is queued on the device and the previous step's
        tokens are committed while it runs, so what a step returns is one step old."""
        if self.disagg is None:
            return self._step()
        changed = self.disagg.step()  # transfers done, failed or late; cancelled prefills
        changed += self._step()
        self.disagg.ended(changed)
        return changed

    def _step(self) -> list[Req]:
        start = time.perf_counter()
        changed, self._changed_outside_step = self._changed_outside_step, []
        if len(self.grammars):
            changed += self._admit_compiled()
        if self._in_flight is not None and (
            not self._in_flight.launched.overlappable or self._drafts_next()
        ):
            changed += self._commit_in_flight()
        if self.spec_loop is not None and self._in_flight is None:
            looped, done = self._loop_step()
            changed += looped
            if done:
                return changed
        try:
            batch = self.scheduler.schedule(allow_retract=self._in_flight is None)
        except RetractionNeeded:
            changed += self._commit_in_flight()
            batch = self.scheduler.schedule()
        changed += self.scheduler.pop_ended()
        if batch is None:
            if self._in_flight is not None:
                return changed + self._commit_in_flight()
            if len(self.grammars) and not self.scheduler.has_work():
                self.grammars.wait()  # idle until a grammar compiles: no busy loop
                return changed
            return changed + self._fail_unschedulable()
        prev_ids = self._in_flight.launched.next_ids if self._in_flight is not None else None
        sample_rows = self.scheduler.needs_sampling(batch)
        launched_at = time.perf_counter()
        try:
            launched = self.runner.launch(batch, sample_rows, self.eos_token_ids, prev_ids)
        except Exception as e:  # noqa: BLE001 - a failing request must not end the engine
            return changed + self._fail_batch(batch, e)
        self.scheduler.advance(batch)
        overlapped = self._in_flight is not None
        if overlapped:
            self.overlapped_steps += 1
            changed += self._commit_in_flight()  # the device computes `batch` meanwhile
        self._in_flight = InFlightStep(batch, launched, launched_at, start, overlapped)
        if not self.overlap:
            changed += self._commit_in_flight()
        if any(r.failed for r in batch.reqs):  # the sampler could not serve these alone
            changed += self._end_failed(batch)
        self.host.hook.step_finished(
            stats={
                "num_decode": batch.num_decode,
                "num_prefill_tokens": sum(batch.extend_lens) - batch.num_decode,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "step_time_s": time.perf_counter() - start,
            }
        )
        if self.config.debug_leak_check and not self.has_work():
            self.scheduler.check_no_leak()
        return changed

    def _looping(self) -> bool:
        return self.spec_loop is not None and self.spec_loop.active

    def _loop_step(self) -> tuple[list[Req], bool]:
        """One cycle of the device-side speculative loop: stop it where it cannot go on, start
        it where it can, and launch a cycle while it runs. Returns the requests it changed and
        whether it ran this step (if not, the scheduler does)."""
        loop = self.spec_loop
        assert loop is not None
        if loop.active and (len(self.grammars) or not loop.can_continue()):
            return loop.stop(), False
        if not loop.active:
            reqs = None if len(self.grammars) else loop.eligible()
            if reqs is None:
                return [], False
            try:
                if not loop.start(reqs):
                    return [], False
            except Exception as e:  # noqa: BLE001 - a failing request must not end the engine
                return self._fail_loop(e), True
        start = time.perf_counter()
        try:
            changed = loop.advance()
        except Exception as e:  # noqa: BLE001
            return self._fail_loop(e), True
        self.host.hook.step_finished(
            stats={
                "num_decode": len(loop.reqs),
                "num_prefill_tokens": 0,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "step_time_s": time.perf_counter() - start,
            }
        )
        return changed, True

    def _fail_loop(self, error: Exception) -> list[Req]:
        """The loop's cycle raised: its requests end with an abort naming the error, as a
        failing step's do (``_fail_batch``)."""
        loop = self.spec_loop
        assert loop is not None
        reqs = loop.abandon()
        logger.error(
            "a speculative cycle of %d requests failed: %r; aborting them", len(reqs), error
        )
        message = f"the engine failed on this request's step ({type(error).__name__}: {error})"
        changed = []
        for req in reqs:
            if self.scheduler.abort(req.rid, message) is not None:
                req.failed = message
                changed.append(req)
        self.cache.evict(1 << 62)
        return changed

    def _commit_in_flight(self) -> list[Req]:
        """Wait for the step on the device and append its tokens."""
        assert self._in_flight is not None
        step, self._in_flight = self._in_flight, None
        changed = self.scheduler.commit(step.batch, step.launched.result())
        # A step's wall time: from its launch, or from the previous step's result where the
        # device was still on that one (overlap), to its own result.
        now = time.perf_counter()
        spent = now - max(step.launched_at, self._last_result_at)
        batch = step.batch
        if self.speculator is not None:
            drafted = frozenset(batch.reqs[i].rid for i in batch.drafts)
            catching_up = not drafted <= self._drafted_last
            self._drafted_last = drafted
            if self._is_reference_step(step):
                # What speculation costs against plain decoding, per step from its scheduling
                # (drafting included) or, overlapped, the last result.
                cycle = now - max(step.scheduled_at, self._last_result_at)
                verify = bool(batch.drafts)
                self.speculator.observe_step(
                    verify, len(batch.reqs), cycle, catching_up=catching_up
                )
        self._last_result_at = now
        self.scheduler.stats.by_kind[batch.kind].seconds += spent
        return changed

    def _is_reference_step(self, step: InFlightStep) -> bool:
        """Whether ``step`` measures a verify step or plain decoding for the speculation policy:
        only decodes (and verifies); with the overlap schedule, a decode-only step counts only
        when it overlapped the step before, as decoding does while no request drafts (one
        launched alone after a verify step costs the host's work on top)."""
        batch = step.batch
        if len(batch.reqs) != batch.num_decode + len(batch.drafts):
            return False
        return bool(batch.drafts) or step.overlapped or not self.overlap

    def _drafts_next(self) -> bool:
        """Whether the next step may draft for a running request, which needs its last token
        on the host: the step in flight is then committed before scheduling."""
        sp = self.speculator
        if sp is None:
            return False
        running = self.scheduler.running
        return sp.draft_length(len(running)) > 0 and any(sp.may_draft(r) for r in running)

    def _fail_batch(self, batch: ScheduledBatch, error: Exception) -> list[Req]:
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
        self.cache.evict(1 << 62)
        return changed

    def _end_failed(self, batch: ScheduledBatch) -> list[Req]:
        ended = [r for r in batch.reqs if r.failed and not r.finished]
        for req in ended:
            self.abort(req.rid, str(req.failed))
        return ended

    def _sync(self) -> None:
        """Commit any step in flight (its requests are reported by the next ``step``), so the
        scheduler's state is whole before it is changed from outside a step."""
        if self._in_flight is not None:
            self._changed_outside_step += self._commit_in_flight()
        if self._looping():
            assert self.spec_loop is not None
            self._changed_outside_step += self.spec_loop.stop()

    def _admit_compiled(self) -> list[Req]:
        """Move requests whose grammar compiled to the scheduler, after jumping forward over
        any prefix the grammar forces; return those that finished (failed) instead."""
        ready, finished = self.grammars.pop_done()
        for req in ready:
            if req.bootstrap is not None and self.disagg is not None:
                # Disaggregated: no jump-forward before the first token, which the prefill
                # samples under the grammar (it sends the KV of the prompt alone).
                if self._admit_transfer(req):
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
        if isinstance(self.disagg, DecodeSide):  # the prefill need not keep their KV
            for req in finished:
                b, why = req.bootstrap, req.finish_reason
                if b is not None and why is not None:
                    self.cancel_room(b.room, why.message or why.type, (b.host, b.port))
        return finished

    def _admit_transfer(self, req: Req) -> bool:
        """A disaggregated request whose grammar compiled: the prefill runs it, the decode
        starts waiting for its KV. True when it ended instead (its room got taken meanwhile)."""
        if isinstance(self.disagg, PrefillSide):
            self.scheduler.add_request(req)
            return False
        assert self.disagg is not None
        try:
            self.disagg.add(req)
        except InvalidRequest as e:
            req.finish(FinishReason("abort", message=str(e)))
            return True
        return False

    def shutdown(self) -> None:
        """Stop the grammar workers and let go of everything on the device (model, KV pool,
        step executor, cached prefixes), then have the platform give cached memory back, so
        another engine can start in this process at once. The core cannot step afterwards."""
        self.grammars.shutdown()
        disagg = getattr(self, "disagg", None)
        if disagg is not None:
            disagg.connector.close()
            self.disagg = None
        if not hasattr(self, "runner"):
            return  # already shut down
        platform = self.runner.platform
        self.runner.close()  # the engine's other ranks stop with this one
        self._in_flight = None
        self.spec_loop = None  # it holds the plugin's cycle graphs
        self._changed_outside_step = []
        if self.speculator is not None:
            self.speculator.close()
        # NOTE: these three hold every device tensor (and the speculator's algorithm did). Some
        # sit in reference cycles (closures over this core), so collect before the platform
        # empties its cache.
        del self.runner, self.scheduler, self.cache
        gc.collect()
        platform.empty_cache()
        platform.release()

    def _fail_unschedulable(self) -> list[Req]:
        """Nothing could run although requests wait: the one admission stopped at can never
        fit (nothing runs to free KV); end it. Not the oldest: the policy may have tried a
        larger one first (lpm), and the oldest may fit once that one is gone."""
        sched = self.scheduler
        req = sched.blocked
        if req is None or sched.running or sched.paused or all(r is not req for r in sched.waiting):
            return []
        sched.abort(req.rid, "the request does not fit in the KV pool")
        return [req]

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
        self.cache.evict(1 << 62)
        logger.info("loaded weights from %s", model_path)
        return True, f"loaded weights from '{model_path}'"

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only allowed while no request runs."""
        self._sync()
        if self.scheduler.has_work():
            return False
        self.cache.evict(1 << 62)
        return True

    # -- what the entrypoints read and ask of the core ---------------------------------------
    # The offline Engine and the server's engine process use these, never the core's parts
    # (scheduler, runner, disaggregation side, grammar queue, speculator) directly.

    @property
    def vocab_size(self) -> int:
        return self.runner.model_config.vocab_size

    @property
    def kv_size(self) -> int:
        """Token slots in the KV pool."""
        return self.runner.kv_size

    @property
    def max_running_requests(self) -> int:
        return self.runner.settings.max_running_requests

    def settings_summary(self) -> dict[str, dict[str, Any]]:
        """The resolved runtime settings, as the start-up banner and /server_info show them."""
        return self.runner.settings.describe()

    def plugin_names(self) -> dict[str, str]:
        """Plugin kind -> the name of the plugin chosen for it."""
        return dict(self.runner.plugins.names)

    @property
    def spec_num_draft(self) -> int | None:
        """Draft tokens per request and verify step; None when speculation is off."""
        return None if self.speculator is None else self.speculator.num_draft

    @property
    def num_grammar_queue(self) -> int:
        """Requests waiting for their grammar to compile."""
        return len(self.grammars)

    def isolate_grammar_compiles(self) -> None:
        """Compile each new grammar in a capped sandbox process first (core/grammar_sandbox.py),
        so that no request's grammar can take the engine's time or memory."""
        from radixserve.core.grammar_sandbox import SandboxSpec  # here: a server's choice

        grammars, config = self.grammars, self.config
        if grammars.backend_name == "none":
            return  # it refuses every grammar at once
        grammars.isolate(
            SandboxSpec(
                backend=grammars.backend_name,
                model_dir=str(config.model_path),
                vocab_size=self.vocab_size,
                stop_token_ids=tuple(self.eos_token_ids),
                plugin_allow=tuple(config.plugin_allow),
                memory_mb=config.grammar_compile_memory,
            )
        )

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def running_rids(self) -> list[str]:
        """The running requests' ids, in the scheduler's order."""
        return [req.rid for req in self.scheduler.running]

    def kv_accounting(self) -> dict[str, int]:
        return self.scheduler.kv_accounting()

    def scheduler_counters(self) -> dict[str, Any]:
        """The scheduler's counters since start: cache_hit_rate, retractions, steps and
        steps_by_kind (each kind's counts as JSON)."""
        stats = self.scheduler.stats
        return {
            "cache_hit_rate": stats.cache_hit_rate,
            "retractions": stats.retractions,
            "steps": stats.steps,
            "steps_by_kind": {k: v.to_json() for k, v in stats.by_kind.items()},
        }

    @property
    def wakeup_fd(self) -> int | None:
        """A descriptor that becomes readable when a KV transfer ends (disaggregation), for
        the caller to wait on beside its inbox; None without one."""
        return None if self.disagg is None else self.disagg.connector.wakeup_fd

    def bind_server_engine(self) -> None:
        """Let the hardware platform place this process as a server's engine."""
        self.runner.platform.bind_server_engine()

    def close_transfers(self) -> None:
        """Close the KV connector (its server and transfer agent, in order), if there is one;
        once (shutdown does not close it again)."""
        if self.disagg is not None:
            self.disagg.connector.close()
            self.disagg = None

    def close_runner(self) -> None:
        """The other tensor-parallel ranks leave their step loops."""
        self.runner.close()


def _eos_from_tokenizer(tokenizer: Tokenizer) -> tuple[int, ...]:
    if tokenizer.eos_token is None:
        return ()
    token_id = tokenizer.token_to_id(tokenizer.eos_token)
    return () if token_id is None else (token_id,)
