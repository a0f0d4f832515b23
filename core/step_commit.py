"""The scheduler's side of a launched step: its bookkeeping before the result (``advance``)
and appending the sampled tokens (``commit``), with grammars, stops and the strategies'
commit hooks. A base of ``core.scheduler.Scheduler``."""

from __future__ import annotations

from radixserve.core.grammar import GrammarStepper
from radixserve.core.kv_slots import KVSlots
from radixserve.core.request import FinishReason, Req, ReqState
from radixserve.core.step_plan import Extra, SampledToken, SchedulerStats, StepPlan
from radixserve.core.stop import StopChecker, TopLogprobs


class StepCommit(KVSlots):
    """Advancing and committing a plan's requests."""

    stats: SchedulerStats
    grammar: GrammarStepper
    stop_checker: StopChecker

    def process_output(self, batch: StepPlan, sampled: dict[int, SampledToken]) -> list[Req]:
        """Advance requests after a forward; ``sampled`` maps batch index -> (token id,
        logprob, top logprobs).
        Returns the requests that produced a token or finished this step."""
        self.advance(batch)
        return self.commit(batch, sampled)

    def advance(self, batch: StepPlan) -> None:
        """The bookkeeping of a launched step that needs no sampled token: KV lengths, prompt
        sharing, states. Each request that samples gets one pending token until ``commit``,
        so the next step can be scheduled while the device still computes this one."""
        self.stats.steps += 1
        sample_row = 0  # rows of the step's sampled ids, in batch order
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True)):
            req.kv_len += n
            if i in batch.extra:  # commit keeps the positions of kept tokens, frees the rest
                req.num_pending += 1
                req.pending_row = sample_row
                sample_row += 1
                continue
            if req.kv_len < req.seq_len:
                self._cache_of(req).cache_unfinished_req(req)  # chunked prefill goes on
                continue
            if req.state == ReqState.PREFILL:
                self._cache_of(req).cache_unfinished_req(req)  # share the prompt while it decodes
            if req.sampling.max_new_tokens > 0:
                req.state = ReqState.DECODE
                req.num_pending += 1
                req.pending_row = sample_row
                sample_row += 1

    def commit(self, batch: StepPlan, sampled: dict[int, SampledToken]) -> list[Req]:
        """Append ``batch``'s sampled tokens (after ``advance``) and finish what must finish.
        Requests that ended since the step was launched (a stop found one step late) are
        skipped: their token for this step is discarded.
        Returns the requests that produced a token or finished."""
        changed: list[Req] = []
        outcomes: list[tuple[Req, Extra, int, int]] = []
        for i, req in enumerate(batch.reqs):
            if req.finished:
                continue
            token = sampled.get(i)
            if i in batch.extra:
                assert isinstance(token, list), "an entry with extra rows samples a list"
                extra = batch.extra[i]
                for strategy in self.strategies:
                    strategy.before_commit(self, req, extra, token)
                kept = self._commit_tokens(req, batch.extend_lens[i], token)
                outcomes.append((req, extra, len(token), kept))
            elif token is not None:
                req.num_pending -= 1
                self._append_sampled(req, *token)
            elif req.sampling.max_new_tokens == 0 and req.kv_len >= req.seq_len:
                req.finish(FinishReason("length", length=0))
            else:
                assert req.kv_len < req.seq_len, f"{req} reached its end but sampled nothing"
                continue  # a prefill chunk; the prompt continues next step
            if req.finished:
                self._release(req)
            changed.append(req)
        if outcomes:
            for strategy in self.strategies:
                strategy.committed(batch, outcomes)
        return changed

    def _commit_tokens(self, req: Req, n: int, tokens: list[SampledToken]) -> int:
        """Append an extended entry's emitted tokens in order, up to a stop (or a grammar's
        jump-forward), keep the KV of the positions they follow and free the rest. Returns
        how many tokens were appended."""
        start = req.kv_len - n  # the position of the step's first input (the last token)
        req.num_pending -= 1
        committed = 0
        for token in tokens:
            self._append_sampled(req, *token)
            committed += 1
            if req.finished or req.state == ReqState.PREFILL:
                break
        req.kv_len = start + committed
        self.free_positions(req, req.kv_len, start + n)
        return committed

    def append_received(
        self, req: Req, token: int, lp: float | None, top: TopLogprobs | None
    ) -> None:
        """Append a token sampled elsewhere (a prefill server's first token, under the
        request's grammar if it has one) as if sampled here: grammar, stops, jump-forward."""
        self._append_sampled(req, token, lp, top)

    def _append_sampled(
        self, req: Req, token: int, lp: float | None, top: TopLogprobs | None
    ) -> None:
        if req.grammar is not None and not self.grammar.accept(req, token):
            return  # finished with an abort naming the grammar problem
        self.stop_checker.append(req, token, lp, top)
        done = req.grammar is None or req.finished
        forced = [] if done else self.grammar.after_token(req)
        for t in forced:  # jump-forward: the next step extends over these tokens
            self.stop_checker.append(req, t)
            if req.finished:
                return
        if forced:
            req.state = ReqState.PREFILL

    def needs_sampling(self, batch: StepPlan) -> list[int]:
        """Batch indices whose forward reaches the end of their tokens and must sample."""
        return [
            i
            for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens, strict=True))
            if (req.kv_len + n == req.seq_len or i in batch.extra)
            and req.sampling.max_new_tokens > 0
        ]
