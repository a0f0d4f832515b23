"""Speculative algorithm ``eagle``: an EAGLE (EAGLE-1/2) draft head (``eagle_head.py``) drafts
a chain of k tokens from the target's last hidden state, through the target's own LM head.

The drafting, the feature pool and the draft KV are shared with ``eagle3`` (``head_draft.py``).
Here: the target keeps its last layer's output (the residual stream, before the final norm:
what ``capture_hidden_layers`` hands over) and the plugin applies the target's final norm, so a
slot holds exactly the hidden state the target's LM head reads (d values), as EAGLE's training
saw it. The head's logits are the target's LM head over the full vocabulary; no id mapping.

Chains only: draft trees (``--speculative-eagle-topk`` > 1, EAGLE-2's dynamic tree) are not
built; the engine refuses a topk other than 1 at start-up.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import SpeculativeContext
from radixserve.plugins.speculative.eagle_head import ARCHITECTURE, EagleHead, load_eagle_head
from radixserve.plugins.speculative.head_draft import HeadDraft
from radixserve.plugins.speculative.head_layer import HeadConfig

DEFAULT_HEADS = {
    # (hidden_size, num_layers, vocab_size): head directory under head_draft.HEADS_DIR
    (576, 30, 49152): "smollm2-135m-instruct-eagle",
}


class EagleDraft(HeadDraft):
    name = "eagle"
    kind = "EAGLE"
    default_heads = DEFAULT_HEADS
    head: EagleHead

    def feature_width(self, hc: HeadConfig) -> int:
        return hc.target_hidden_size

    def check_fits(self, hc: HeadConfig, target: ModelConfig) -> list[str]:
        problems = []
        if hc.architecture != ARCHITECTURE:
            problems.append(f"architecture '{hc.architecture}' (an EAGLE head is {ARCHITECTURE})")
        if hc.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {hc.vocab_size} (target {target.vocab_size})")
        if hc.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {hc.hidden_size} (target {target.hidden_size})")
        return problems

    def load(self, path: str, context: SpeculativeContext) -> EagleHead:
        target = context.target_model
        if not (hasattr(target, "logits") and hasattr(target, "norm")):
            raise ConfigError(
                "speculative algorithm 'eagle' needs the target's final norm and LM head "
                "(norm, logits())"
            )
        max_context = context.model_config.max_context
        head = load_eagle_head(path, max_context, context.dtype, context.device)
        head.bind_lm_head(target.logits)
        self.final_norm = target.norm
        self.capture_hidden_layers = (context.model_config.num_layers - 1,)
        return head

    def feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        return self.final_norm(hidden[self.capture_hidden_layers[0]])


@hookimpl
def register_speculative_algorithms(register: Any) -> None:
    register(
        "eagle",
        EagleDraft,
        description="an EAGLE draft head over the target's last hidden state, chains "
        "(--speculative-draft-model-path, or the head shipped for SmolLM2)",
    )
