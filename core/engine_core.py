"""EngineCore: the engine's main loop in one place — validate, queue, and per step
``schedule -> run batch -> process output``. It is process-agnostic: the offline Engine drives
it from a thread, the server's engine process from its socket loop."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from radixserve.core.config import EngineConfig
from radixserve.core.grammar import GrammarMasker, GrammarStepper
from radixserve.core.grammar_queue import GrammarQueue
from radixserve.core.model_runner import ModelRunner
from radixserve.core.plugins import PluginHost
from radixserve.core.radix_cache import NoPrefixCache, RadixCache
from radixserve.core.request import InvalidRequest, Req
from radixserve.core.scheduler import Scheduler, SchedulerConfig
from radixserve.core.stop import StopChecker
from radixserve.core.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, model_dir: Path, config: EngineConfig, host: PluginHost) -> None:
        self.config = config
        self.host = host
        self.runner = ModelRunner(model_dir, config, host)
        self.tokenizer = Tokenizer(model_dir)
        mc = self.runner.model_config
        self.eos_token_ids = tuple(mc.eos_token_ids) or _eos_from_tokenizer(self.tokenizer)
        self.max_context = self.runner.max_context
        cache_cls = NoPrefixCache if config.disable_radix_cache else RadixCache
        self.cache = cache_cls(self.runner.allocator, self.runner.req_to_token)
        self.grammars = self._grammar_queue(host)
        self.runner.grammar_masker = GrammarMasker(
            lambda: self.grammars.backend, config.max_running_requests, mc.vocab_size
        )
        self.grammar_stepper = GrammarStepper(self.tokenizer, not config.disable_jump_forward)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running_requests=config.max_running_requests,
                chunked_prefill_size=config.chunked_prefill_size,
                schedule_policy=config.schedule_policy,
                max_context=self.max_context,
                random_seed=config.random_seed,
            ),
            self.runner.allocator,
            self.runner.req_to_token,
            self.cache,
            StopChecker(self.tokenizer, self.eos_token_ids, self.max_context),
            self.grammar_stepper,
        )
        info = {
            "model_path": str(model_dir),
            "plugins": dict(self.runner.plugins.names),
            "kv_tokens": self.runner.kv_size,
            "max_context": self.max_context,
        }
        logger.info("engine ready: %s", info)
        host.hook.engine_started(info=info)

    def _grammar_queue(self, host: PluginHost) -> GrammarQueue:
        name = self.runner.plugins.names["grammar"]
        factory = host.registries["grammar"].get(name).factory
        vocab, stops = self.runner.model_config.vocab_size, list(self.eos_token_ids)
        return GrammarQueue(
            name, lambda: factory(self.tokenizer, vocab, stops), self.config.grammar_compile_timeout
        )

    def validate(self, req: Req) -> None:
        """Raise InvalidRequest when ``req`` can never be served."""
        n = len(req.input_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty; send at least one token")
        vocab = self.runner.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in req.input_ids):
            raise InvalidRequest(f"input_ids must be token ids in [0, {vocab})")
        if n >= self.max_context:
            raise InvalidRequest(
                f"the prompt has {n} tokens; this model's context length is {self.max_context}"
            )
        if n >= self.runner.kv_size:
            raise InvalidRequest(
                f"the prompt has {n} tokens; the KV pool holds {self.runner.kv_size}"
            )
        req.sampling.validate(vocab)

    def add_request(self, req: Req) -> None:
        """Queue ``req``; one with a grammar first waits for it to compile (off this thread)."""
        self.validate(req)
        if req.sampling.grammar is not None:
            self.grammars.submit(req)
        else:
            self.scheduler.add_request(req)

    def abort(self, rid: str) -> Req | None:
        message = "aborted by the client"
        return self.grammars.abort(rid, message) or self.scheduler.abort(rid, message)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or len(self.grammars) > 0

    def step(self) -> list[Req]:
        """Run one step; return the requests with new tokens or a new finish."""
        start = time.perf_counter()
        changed = self._admit_compiled() if len(self.grammars) else []
        batch = self.scheduler.schedule()
        changed += self.scheduler.pop_ended()
        if batch is None:
            if len(self.grammars) and not self.scheduler.has_work():
                self.grammars.wait()  # idle until a grammar compiles: no busy loop
                return changed
            return changed + self._fail_unschedulable()
        sampled = self.runner.run(batch, self.scheduler.needs_sampling(batch), self.eos_token_ids)
        changed += self.scheduler.process_output(batch, sampled)
        self.host.hook.step_finished(
            stats={
                "num_decode": batch.num_decode,
                "num_prefill_tokens": sum(batch.extend_lens) - batch.num_decode,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "step_time_s": time.perf_counter() - start,
            }
        )
        if self.config.debug_leak_check and not self.scheduler.has_work():
            self.scheduler.check_no_leak()
        return changed

    def _admit_compiled(self) -> list[Req]:
        """Move requests whose grammar compiled to the scheduler, after jumping forward over
        any prefix the grammar forces; return those that finished (failed) instead."""
        ready, finished = self.grammars.pop_done()
        for req in ready:
            for token in self.grammar_stepper.forced_tokens(req):
                self.scheduler.stop_checker.append(req, token)
            if req.finished:
                finished.append(req)
            else:
                self.scheduler.add_request(req)
        return finished

    def shutdown(self) -> None:
        self.grammars.shutdown()

    def _fail_unschedulable(self) -> list[Req]:
        """Nothing could run although requests wait: the head can never fit; end it."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        req = self.scheduler.waiting[0]
        self.scheduler.abort(req.rid, "the request does not fit in the KV pool")
        return [req]

    def flush_cache(self) -> bool:
        """Drop every cached prefix; only allowed while no request runs."""
        if self.scheduler.has_work():
            return False
        self.cache.evict(1 << 62)
        return True


def _eos_from_tokenizer(tokenizer: Tokenizer) -> tuple[int, ...]:
    if tokenizer.eos_token is None:
        return ()
    token_id = tokenizer.token_to_id(tokenizer.eos_token)
    return () if token_id is None else (token_id,)
