"""Speculative algorithm ``eagle3``: an EAGLE-3 draft head (``eagle3_head.py``) drafts a chain
of k tokens from three of the target's layers, fused.

The drafting, the feature pool and the draft KV are shared with ``eagle`` (``head_draft.py``).
Here: the target keeps three layers' outputs (the head's ``aux_layers``), their concatenation
is the feature a slot holds (3d values), and the head's argmax over its reduced draft
vocabulary is mapped to target ids.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.core.config import ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import SpeculativeContext
from radixserve.plugins.speculative.eagle3_head import Eagle3Head, load_head
from radixserve.plugins.speculative.head_draft import HEADS_DIR, HeadDraft
from radixserve.plugins.speculative.head_layer import HeadConfig

__all__ = ["HEADS_DIR", "DEFAULT_HEADS", "Eagle3Draft"]

DEFAULT_HEADS = {
    # (hidden_size, num_layers, vocab_size): head directory under HEADS_DIR
    (576, 30, 49152): "smollm2-135m-instruct-eagle3",
}


class Eagle3Draft(HeadDraft):
    name = "eagle3"
    kind = "EAGLE-3"
    default_heads = DEFAULT_HEADS
    head: Eagle3Head

    def feature_width(self, hc: HeadConfig) -> int:
        return len(hc.aux_layers) * hc.target_hidden_size

    def check_fits(self, hc: HeadConfig, target: ModelConfig) -> list[str]:
        problems = []
        if hc.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {hc.vocab_size} (target {target.vocab_size})")
        if hc.target_hidden_size != target.hidden_size:
            problems.append(
                f"target_hidden_size {hc.target_hidden_size} (target {target.hidden_size})"
            )
        if not hc.aux_layers or any(not 0 <= i < target.num_layers for i in hc.aux_layers):
            problems.append(
                f"aux layers {list(hc.aux_layers)} (the target has {target.num_layers} layers)"
            )
        return problems

    def load(self, path: str, context: SpeculativeContext) -> Eagle3Head:
        max_context = context.model_config.max_context
        head = load_head(path, max_context, context.dtype, context.device)
        self.capture_hidden_layers = head.config.aux_layers
        self.target_ids = head.target_ids()
        return head

    def feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([hidden[i] for i in self.capture_hidden_layers], dim=-1)


@hookimpl
def register_speculative_algorithms(register: Any) -> None:
    register(
        "eagle3",
        Eagle3Draft,
        description="an EAGLE-3 draft head over the target's hidden states "
        "(--speculative-draft-model-path, or the head shipped for SmolLM2)",
    )
