"""A third-party plugin for the hardening tests, installed through its entry point
(``model_gate.install_plugin``) so the server's engine process, and its grammar sandbox, load it
the real way.

- ``FaultyLlama``: the built-in Llama, whose forward raises when a prefill holds FAULT_TOKEN (a
  request that makes the engine raise although it passed validation).
- grammar backend ``runaway``: xgrammar, except that the regex SLEEP_SPEC compiles forever and
  GROW_SPEC allocates memory until it fails (a grammar that runs away in time or memory).
"""

from __future__ import annotations

import time
from typing import Any

import radixserve
from radixserve.core.interfaces import Grammar
from radixserve.plugins.grammar.xgrammar_backend import XGrammarBackend
from radixserve.plugins.models.llama import LlamaForCausalLM

FAULT_TOKEN = 359
SLEEP_SPEC = "(runaway-sleep)"
GROW_SPEC = "(runaway-grow)"
GROW_LIMIT = 8 << 30  # a safety stop, should the memory cap ever be missing


class FaultyLlama(LlamaForCausalLM):
    def forward(self, batch: Any) -> Any:
        if bool((batch.input_ids[batch.num_decode :] == FAULT_TOKEN).any()):
            raise RuntimeError(f"test fault: the prompt holds token {FAULT_TOKEN}")
        return super().forward(batch)


class RunawayGrammar(XGrammarBackend):
    def compile(self, kind: str, spec: str) -> Grammar:
        if spec == SLEEP_SPEC:
            time.sleep(3600)
        if spec == GROW_SPEC:
            hog = []
            while len(hog) * (64 << 20) < GROW_LIMIT:
                hog.append(bytearray(64 << 20))  # zero-filled: really resident
            raise ValueError("runaway-grow was never stopped")
        return super().compile(kind, spec)


@radixserve.hookimpl
def register_models(register: Any) -> None:
    register("FaultyLlama", FaultyLlama, description=f"test: raises on token {FAULT_TOKEN}")


@radixserve.hookimpl
def register_grammar_backends(register: Any) -> None:
    register("runaway", RunawayGrammar, description="test: xgrammar with two runaway regexes")
