"""The device loop's speculation policy (core/spec_loop.py, ``SpecLoop._judge``), without a
model: the loop's requests are judged as one, by a running deficit against what a restart
costs, and paused together with a backoff."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from radixserve.core.interfaces import Draft, SpeculativeAlgorithm
from radixserve.core.request import Req, ReqState, SamplingParams
from radixserve.core.spec_loop import FIRST_PAUSE, SpecLoop
from radixserve.core.speculative import Speculator


class Nothing(SpeculativeAlgorithm):
    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        return [Draft([]) for _ in reqs]


def _loop(batch: int, decode_s: float | None = 0.010, cycle_s: float = 0.014, **kw: Any):
    """A loop over ``batch`` decoding requests whose cycle costs ``cycle_s`` against a decode
    step of ``decode_s`` (None: no decode step measured yet)."""
    spec = Speculator(Nothing(), "nothing", 4, 32, vocab_size=100, **kw)
    if decode_s is not None:
        spec.observe_step(False, batch, decode_s)
    spec.observe_step(True, batch, cycle_s)
    loop = SpecLoop(SimpleNamespace(k=4), None, spec, max_context=1000)  # type: ignore[arg-type]
    reqs = [_decoding(f"r{i}") for i in range(batch)]
    loop.reqs = reqs
    return loop, spec, reqs


def _decoding(rid: str) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(temperature=0))
    req.state = ReqState.DECODE
    return req


def _cycles(loop: SpecLoop, reqs: list[Req], accepted: Sequence[Sequence[int]]) -> list[bool]:
    """Judge one cycle per entry (each request's accepted drafts); after each, whether the
    loop's requests may still draft."""
    out = []
    for row in accepted:
        loop._judge(reqs, row)
        out.append(loop._pays(reqs))
    return out


def test_a_few_poor_cycles_in_a_stretch_that_pays_do_not_stop_the_loop() -> None:
    """Break-even 1.4 tokens a cycle: four cycles gaining 1 lose 1.6 < MIN_DEFICIT, and good
    cycles pay the deficit back, so the loop goes on (JSON: values between keys)."""
    loop, spec, reqs = _loop(1)
    assert _cycles(loop, reqs, [[4], [0], [0], [0], [0], [3], [0], [0], [0], [0]]) == [True] * 10
    assert loop.verdicts == 0


def test_a_run_of_poor_cycles_stops_the_loop_and_pauses_every_request_together() -> None:
    loop, spec, reqs = _loop(2)
    poor = [[0, 0]] * 6  # a deficit of 0.4 a cycle: past 2.0 at the sixth
    assert _cycles(loop, reqs, poor) == [True] * 5 + [False]
    assert loop.verdicts == 1
    _cycles(loop, reqs, [[0, 0]])  # the cycle in flight at the verdict, committed at the stop
    assert loop.verdicts == 1 and loop._pause == 2 * FIRST_PAUSE  # is not judged again
    # both pause FIRST_PAUSE steps and resume at the same step
    for _ in range(FIRST_PAUSE):
        assert not spec.wants(reqs[0]) and not spec.wants(reqs[1])
    assert spec.wants(reqs[0]) and spec.wants(reqs[1])


def test_one_request_that_gains_keeps_its_batch_in_the_loop() -> None:
    """The batch's mean gain counts, not each request's: one request gaining 3 tokens a cycle
    beside three gaining 1 makes 1.5 a request, above break-even 1.4."""
    loop, _, reqs = _loop(4)
    assert all(_cycles(loop, reqs, [[2, 0, 0, 0]] * 40))


def test_a_costly_restart_needs_a_larger_deficit_to_stop() -> None:
    """With restarts measured at 50 ms against a 10 ms decode step, a stop must save 5 decode
    steps: 12 cycles losing 0.4 each (4.8) go on, the 13th stops."""
    loop, _, reqs = _loop(1)
    loop._restarts.append(0.050)
    assert _cycles(loop, reqs, [[0]] * 13) == [True] * 12 + [False]


def test_pauses_double_while_episodes_do_not_pay_and_start_over_after_one_that_did() -> None:
    loop, spec, reqs = _loop(1)

    def episode(accepted: list[list[int]]) -> int:
        """Run cycles until the loop stops; return the pause's length in steps."""
        loop._deficit = loop._episode = 0.0  # as start() does
        assert not all(_cycles(loop, reqs, accepted))
        steps = 0
        while not spec.wants(reqs[0]):
            steps += 1
        return steps

    never = [[0]] * 6
    assert [episode(never) for _ in range(6)] == [4, 8, 16, 32, 64, 64]
    # an episode that gained as a whole (30 good cycles, then a poor run) pauses briefly
    assert episode([[3]] * 30 + [[0]] * 6) == FIRST_PAUSE
    assert episode(never) == 2 * FIRST_PAUSE


def test_without_a_measured_decode_step_the_loop_pauses_once_to_measure_one() -> None:
    loop, spec, reqs = _loop(1, decode_s=None)
    assert _cycles(loop, reqs, [[4]]) == [False]  # a probe: all pause for a few steps
    assert loop.verdicts == 0
    while not spec.wants(reqs[0]):
        pass
    new = Req("new", [1, 2, 3], SamplingParams(temperature=0))
    assert spec.wants(new)  # a probe is no verdict: a request arriving next is not paused


def test_no_verdicts_with_pauses_disabled() -> None:
    """--speculative-disable-pause: the run that stops a loop with pauses on goes on."""
    poor = [[0]] * 50
    loop, _, reqs = _loop(1)
    assert not all(_cycles(loop, reqs, poor))
    loop, _, reqs = _loop(1, pause_unprofitable=False)
    assert all(_cycles(loop, reqs, poor))


def test_a_request_arriving_after_a_stop_starts_paused_unless_the_loop_paid_since() -> None:
    """A verdict is inherited by the next arrival (as a request's own verdict is); a later
    cycle that pays clears it: a stale verdict held every later request of a JSON run paused
    for its first steps, each then paying a restart."""
    loop, spec, reqs = _loop(1)
    assert not all(_cycles(loop, reqs, [[0]] * 6))
    assert not spec.may_draft(_decoding("after-stop"))
    while not spec.wants(reqs[0]):
        pass
    loop._deficit = loop._episode = 0.0  # the loop starts again
    assert all(_cycles(loop, reqs, [[4]]))
    assert spec.may_draft(_decoding("after-a-good-cycle"))
