"""The engine's recent generation rate (SGLang's ``gen_throughput`` gauge): output tokens per
second over the steps of the last few seconds, 0 once the engine has been idle that long."""

from __future__ import annotations

import time
from collections import deque

WINDOW_S = 5.0


class GenRate:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._steps: deque[tuple[float, float, int]] = deque()  # (start, end, tokens)

    def add_step(self, start: float, end: float, tokens: int) -> None:
        self._steps.append((start, end, tokens))
        self._forget(end)

    def per_second(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        self._forget(now)
        if not self._steps:
            return 0.0
        # NOTE: over the time the steps span (idle gaps between them included), never more
        # than the window, so a burst after a pause is not inflated.
        span = now - max(self._steps[0][0], now - self.window_s)
        tokens = sum(n for _, _, n in self._steps)
        return tokens / span if span > 0 else 0.0

    def _forget(self, now: float) -> None:
        while self._steps and self._steps[0][1] < now - self.window_s:
            self._steps.popleft()
