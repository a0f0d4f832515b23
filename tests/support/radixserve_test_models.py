"""A third-party model plugin for tests, installed through its entry point like any package
(``model_gate.install_test_models``), so the server's engine process loads it the real way.

Both models are the built-in Llama with a test-controlled forward, tripped by a marker token
at a fixed prompt position: however the scheduler splits or caches a prompt, the step that
computes that position holds the marker there, and a generated token never sits that early in
a sequence (the test prompts are longer).

- ``StallingLlama``: a step holding STALL_TOKEN at position 1 never returns (a hung kernel, a
  deadlock).
- ``GatedLlama``: a step holding GATE_TOKEN at position 2 waits while the file ``closed``
  exists in the directory named by ``GATED_LLAMA_DIR``; each wait first appends a line to
  ``entered`` there. A test closes the gate, sends such a prompt, knows from ``entered`` that
  the request is inside a model step, and opens the gate when it wants the step to end.
  Nothing depends on how fast the machine generates. While the file ``paced`` exists there,
  every step (of any prompt) first sleeps PACE_S: a request of n tokens then runs for at least
  n * PACE_S seconds however fast the machine is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import radixserve
from radixserve.plugins.models.llama import LlamaForCausalLM

STALL_TOKEN, STALL_POSITION = 357, 1
GATE_TOKEN, GATE_POSITION = 358, 2
GATE_DIR_ENV = "GATED_LLAMA_DIR"
PACE_S = 0.05


def _holds(batch: Any, token: int, position: int) -> bool:
    return bool(((batch.input_ids == token) & (batch.positions == position)).any())


class StallingLlama(LlamaForCausalLM):
    def forward(self, batch: Any) -> Any:
        if _holds(batch, STALL_TOKEN, STALL_POSITION):
            time.sleep(3600)
        return super().forward(batch)


class GatedLlama(LlamaForCausalLM):
    def forward(self, batch: Any) -> Any:
        gate = os.environ.get(GATE_DIR_ENV)
        if gate and (Path(gate) / "paced").exists():
            time.sleep(PACE_S)
        if gate and _holds(batch, GATE_TOKEN, GATE_POSITION):
            closed = Path(gate) / "closed"
            if closed.exists():
                with open(Path(gate) / "entered", "a") as f:
                    f.write(f"{os.getpid()}\n")
                while closed.exists():
                    time.sleep(0.01)
        return super().forward(batch)


@radixserve.hookimpl
def register_models(register: Any) -> None:
    register("StallingLlama", StallingLlama, description=f"test: hangs on token {STALL_TOKEN}")
    register("GatedLlama", GatedLlama, description=f"test: token {GATE_TOKEN} waits for a gate")
