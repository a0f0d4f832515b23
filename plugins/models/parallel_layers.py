"""Tensor-parallel layers for model plugins (see ``core/parallel.py`` for how a model splits).

A model built for a group (``radixserve.core.parallel.TensorParallel``, its factory's ``group``)
of size N holds its column-parallel projections (q/k/v heads, gate/up) as plain ``nn.Linear``
layers of this rank's width; these classes add what needs a collective:

- ``RowParallelLinear``: input features split (o_proj over the query heads, down_proj over the
  intermediate features); partial outputs are all-reduced, the bias added once after;
- ``VocabParallelEmbedding``: the rank's vocabulary rows; ids outside them look up zeros and
  the ranks' lookups are all-reduced;
- ``gather_vocab``: LM-head logits of each rank's vocabulary shard gathered into full rows.

With a group of size 1 each is its plain torch counterpart (no collective, no copy).
``DECODER_TP_PLAN`` is the shard plan of the decoder skeleton's HF weight names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.parallel import TensorParallel, vocab_shard

#: HF name (without ``model.``) -> shard kind (``core.parallel.SHARD_KINDS``) for the decoder
#: skeleton; every other tensor (norms, q/k norms, row-parallel biases) is replicated.
DECODER_TP_PLAN: dict[str, str] = {
    "embed_tokens.weight": "vocab",
    "lm_head.weight": "vocab",
    "layers.*.self_attn.q_proj.*": "q_heads",
    "layers.*.self_attn.k_proj.*": "kv_heads",
    "layers.*.self_attn.v_proj.*": "kv_heads",
    "layers.*.self_attn.o_proj.*": "q_heads_in",
    "layers.*.mlp.gate_proj.*": "column",
    "layers.*.mlp.up_proj.*": "column",
    "layers.*.mlp.down_proj.*": "row",
}


class RowParallelLinear(nn.Linear):
    """``nn.Linear(in_features, out_features)`` of which this rank holds ``in_features``
    input columns (its share); the output is the all-reduced sum, plus the bias once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output before the all-reduce (no bias: a layer that
        defers the all-reduce has none)."""
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Token embeddings whose rows are split by vocabulary: ``weight`` holds this rank's shard
    (zero-padded to the common shard size), so the same tensor serves a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows, per = vocab_shard(vocab_size, tp)
        self.start, self.stop = rows.start, rows.stop
        self.weight = nn.Parameter(torch.empty(per, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        local = (input_ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


def gather_vocab(logits: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """[rows, shard] logits of this rank's vocabulary -> [rows, vocab_size] on every rank."""
    if tp.size == 1:
        return logits
    return tp.gather_columns(logits)[:, :vocab_size]
