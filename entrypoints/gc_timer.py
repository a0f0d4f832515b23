"""Time Python's garbage collector in a process: collections and seconds per generation.

A full (generation 2) collection walks every tracked object; in a server process holding
many (a radix tree's keys, hundreds of live requests) it pauses everything for that long.
/server_info reports both processes' figures, so a benchmark can tell whether a stall was one.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

# A measurement's switch, not a setting: 1 moves every object alive after start-up out of the
# collector's sight (gc.freeze), so later full collections walk only what came since.
GC_FREEZE_ENV = "RADIXSERVE_GC_FREEZE"


class GcTimer:
    """Installs a ``gc.callbacks`` hook that counts collections and sums their wall time."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        gen = info["generation"]
        self.collections[gen] += 1
        self.seconds[gen] += time.perf_counter() - self._started

    def to_json(self) -> dict[str, list[Any]]:
        return {
            "collections": list(self.collections),
            "seconds": [round(s, 6) for s in self.seconds],
        }


_PROCESS_TIMER: GcTimer | None = None


def process_gc_timer() -> GcTimer:
    """This process's one timer (installed on first use: one hook however many callers)."""
    global _PROCESS_TIMER
    if _PROCESS_TIMER is None:
        _PROCESS_TIMER = GcTimer()
    return _PROCESS_TIMER


def freeze_if_asked() -> bool:
    """gc.freeze() after a collection, when RADIXSERVE_GC_FREEZE=1; whether it froze."""
    if os.environ.get(GC_FREEZE_ENV) != "1":
        return False
    gc.collect()
    gc.freeze()
    return True
