"""Random draft heads for a test target: large enough weights for clear argmaxes, and a draft
vocabulary that is a shuffled half of the target's (so EAGLE-3's d2t mapping matters)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from radixserve.core.config import ModelConfig
from radixserve.core.weights import iter_weights
from radixserve.plugins.speculative.eagle3_head import new_head, save_head


def embedding(model_dir: Path) -> torch.Tensor:
    return dict(iter_weights(model_dir, torch.float32))["model.embed_tokens.weight"]


def write_random_eagle3_head(model_dir: Path, out: Path, aux_layers: Sequence[int]) -> Path:
    mc = ModelConfig.from_dir(model_dir)
    ids = list(range(mc.vocab_size))
    random.Random(1).shuffle(ids)
    draft_vocab = torch.tensor(ids[: mc.vocab_size // 2])
    head = new_head(mc, embedding(model_dir), draft_vocab, 3, list(aux_layers))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    save_head(head, out, torch.float32, {"note": "random, for tests"})
    return out
