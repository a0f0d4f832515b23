"""Priority scheduling (``--enable-priority-scheduling``): the scheduler's policy object for
the order of the waiting queue, which running requests give way, and per-priority counts.

A request's ``priority`` is an int; larger values run first (``--schedule-low-priority-
values-first`` turns that round). Its *rank* is its priority in that direction plus one level
for every ``aging_steps`` engine steps since it arrived (aging, counted in steps, not seconds):
- the waiting queue is admitted in rank order (the queue policy's order among equal ranks);
- before each step, when the first waiting request in rank order would not fit (the KV pool,
  or the running limit, is full), running requests of a strictly lower rank are retracted,
  lowest rank and then newest first, until it fits: it is admitted in that very step;
- fairness: a retracted request keeps its arrival step, so its rank grows while it waits and
  while it runs. After ``gap * aging_steps`` steps a request ranks with requests ``gap``
  levels above it that arrive now, and from then on it is neither passed over nor retracted
  by them: no request waits forever.

Disabled, the policy keeps the scheduler's own order and victims (newest first) and never
retracts for rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from radixserve.core.request import Req
from radixserve.core.step_plan import RetractionNeeded


@dataclass(slots=True)
class PriorityStats:
    """Counts of one priority value since start."""

    admitted: int = 0  # requests admitted (first admission only)
    queue_seconds: float = 0.0  # their time from arrival to first admission, summed
    preempted: int = 0  # retractions to make room for a higher rank

    def to_json(self) -> dict[str, float]:
        return {
            "admitted": self.admitted,
            "queue_seconds": self.queue_seconds,
            "preempted": self.preempted,
        }


class PriorityPolicy:
    def __init__(
        self, enabled: bool = False, low_values_first: bool = False, aging_steps: int = 100
    ) -> None:
        self.enabled = enabled
        self.sign = -1 if low_values_first else 1
        self.aging_steps = max(1, aging_steps)
        self.step = 0  # schedule() calls so far
        self.by_priority: dict[int, PriorityStats] = {}

    def rank(self, req: Req) -> int:
        waited = self.step - req.arrival_step if req.arrival_step >= 0 else 0
        return self.sign * req.priority + waited // self.aging_steps

    def arrived(self, req: Req) -> None:
        """``req`` joins the waiting queue (again, if retracted: its arrival step stays)."""
        if req.arrival_step < 0:
            req.arrival_step = self.step

    def admitted(self, req: Req) -> None:
        """``req`` was admitted; count it under its priority the first time."""
        if req.num_retractions == 0:
            stats = self._stats(req.priority)
            stats.admitted += 1
            stats.queue_seconds += time.perf_counter() - req.arrival_time

    def _stats(self, priority: int) -> PriorityStats:
        stats = self.by_priority.get(priority)
        if stats is None:
            stats = self.by_priority[priority] = PriorityStats()
        return stats

    def order(self, ordered: list[Req]) -> list[Req]:
        """The waiting requests in admission order: by rank, ties in ``ordered``'s order."""
        if not self.enabled or len(ordered) <= 1:
            return ordered
        return sorted(ordered, key=lambda r: -self.rank(r))

    def victim(self, running: list[Req]) -> Req:
        """The running request to retract under KV pressure: the newest of the lowest rank
        (the newest, without priorities)."""
        if not self.enabled:
            return max(running, key=lambda r: r.arrival_time)
        return min(running, key=lambda r: (self.rank(r), -r.arrival_time))

    def preempt(self, scheduler: Any, allow_retract: bool = True) -> list[Req]:
        """Called once per step before planning: retract running requests of a lower rank
        than the first waiting one in rank order until that one fits; return them (retracted
        through ``scheduler.retract``). Raises RetractionNeeded where it would retract but
        ``allow_retract`` is False (a step is in flight: the engine commits it first)."""
        self.step += 1
        if not self.enabled or not scheduler.waiting or not scheduler.running:
            return []
        if scheduler.paused:
            return []
        top = max(scheduler.waiting, key=self.rank)  # the first of the highest rank
        top_rank = self.rank(top)
        lower = sorted(
            (r for r in scheduler.running if self.rank(r) < top_rank),
            key=lambda r: (self.rank(r), -r.arrival_time),
        )
        if lower and not allow_retract and not scheduler.would_fit(top):
            self.step -= 1  # the engine plans this step again once the one in flight commits
            raise RetractionNeeded
        victims: list[Req] = []
        while lower and not scheduler.would_fit(top):
            victim = lower.pop(0)
            scheduler.retract(victim, preempted=True)
            self._stats(victim.priority).preempted += 1
            victims.append(victim)
        return victims

    def to_json(self) -> dict[str, dict[str, float]]:
        """Per priority value (as a string key): PriorityStats.to_json()."""
        return {str(p): s.to_json() for p, s in sorted(self.by_priority.items())}
