"""A third-party model plugin for tests, installed through its entry point like any package
(``model_gate.install_test_models``), so the server's engine process loads it the real way.

Both models are the built-in Llama with a test-controlled forward. They look only at prefill
tokens (decodes come first in a batch, one token each), so a generated token never trips them.

- ``StallingLlama``: a prefill holding STALL_TOKEN never returns (a hung kernel, a deadlock).
- ``GatedLlama``: a prefill holding GATE_TOKEN waits while the file ``closed`` exists in the
  directory named by ``GATED_LLAMA_DIR``; each wait first appends a line to ``entered`` there.
  A test closes the gate, sends a prompt ending in GATE_TOKEN, knows from ``entered`` that the
  request is inside a model step, and opens the gate when it wants the step to end. Nothing
  depends on how fast the machine generates.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import radixserve
from radixserve.plugins.models.llama import LlamaForCausalLM

STALL_TOKEN = 357
GATE_TOKEN = 358
GATE_DIR_ENV = "GATED_LLAMA_DIR"


def _prefill_holds(batch: Any, token: int) -> bool:
    return bool((batch.input_ids[batch.num_decode :] == token).any())


class StallingLlama(LlamaForCausalLM):
    def forward(self, batch: Any) -> Any:
        if _prefill_holds(batch, STALL_TOKEN):
            time.sleep(3600)
        return super().forward(batch)


class GatedLlama(LlamaForCausalLM):
    def forward(self, batch: Any) -> Any:
        gate = os.environ.get(GATE_DIR_ENV)
        if gate and _prefill_holds(batch, GATE_TOKEN):
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
