"""The target's features for draft-head training (tools/train_draft.py, tools/train_dflash.py):
teacher forcing through our own model plugin and torch_native paged attention, several
sequences a forward, grouped by length so forwards stay near a token budget."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ModelConfig
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.core.weights import iter_weights
from radixserve.plugins.attention.torch_native import TorchNativeAttention
from radixserve.plugins.models.llama import build_llama

#: per sequence of a forward: (features [n, len(layers) * d], top-k ids [n, k], top-k probs)
Captured = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


class Target:
    """The target model run over whole sequences (one extend each), keeping some layers'
    outputs at every position and, if asked, its next-token distribution's top k."""

    def __init__(self, model_dir: str, dtype: torch.dtype, device: str, max_tokens: int):
        self.config = mc = ModelConfig.from_dir(model_dir)
        self.max_tokens = max_tokens
        self.kv = KVPool(max_tokens, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, device)
        self.attention = TorchNativeAttention(self.kv, mc, device)
        self.model = build_llama(mc, self.attention, dtype, device)
        self.model.load_weights(iter_weights(model_dir, dtype))
        self.device = device

    @torch.inference_mode()
    def run(
        self, seqs: list[list[int]], layers: list[int], final_norm: bool = False, top_k: int = 0
    ) -> Captured:
        """Per sequence: the features (``final_norm``: the one layer's output through the
        target's final norm, as the eagle plugin keeps it) and, with ``top_k``, the top-k ids
        and probs of the target's next-token distribution at every position (else empty)."""
        pool = ReqToTokenPool(len(seqs) + 1, max(len(s) for s in seqs) + 1)
        positions, slots, rows = [], [], []
        at = 1  # slot 0 is the padding row
        for s in seqs:
            row = pool.alloc()
            assert row is not None
            pool.write(row, 0, torch.arange(at, at + len(s)))
            positions += range(len(s))
            slots += range(at, at + len(s))
            rows.append(row)
            at += len(s)
        dev, n = self.device, len(positions)
        fb = ForwardBatch(
            input_ids=torch.tensor([t for s in seqs for t in s], device=dev),
            positions=torch.tensor(positions, device=dev),
            out_cache_loc=torch.tensor(slots, device=dev),
            req_pool_indices=torch.tensor(rows),
            req_to_token=pool.table,
            seq_lens=[len(s) for s in seqs],
            extend_lens=[len(s) for s in seqs],
            num_decode=0,
            # without top_k one logits row: the LM head over every row costs a fifth of it
            logits_indices=torch.arange(n if top_k else 1, device=dev) + (0 if top_k else n - 1),
            kv_pool=self.kv,
            req_to_token_pool=pool,
            capture_hidden_layers=tuple(layers),
        )
        self.attention.prepare(fb)
        logits = self.model.forward(fb)
        assert fb.hidden_states is not None
        feats = torch.cat([fb.hidden_states[i] for i in layers], dim=-1)
        if final_norm:
            feats = self.model.norm(feats)
        lens = [len(s) for s in seqs]
        feats_out = list(feats.to(torch.bfloat16).cpu().split(lens))
        if not top_k:
            return feats_out, [], []
        top_p, top_i = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        return (
            feats_out,
            list(top_i.to(torch.int32).cpu().split(lens)),
            list(top_p.to(torch.float16).cpu().split(lens)),
        )

    def embeddings(self) -> dict[str, list[torch.Tensor]]:
        """The target's token embedding and LM head weights (float32, CPU), which the heads
        share."""
        model = self.model
        lm_head = model.embed_tokens if model.tie_word_embeddings else model.lm_head
        return {
            "embed": [model.embed_tokens.weight.detach().float().cpu()],
            "lm_head": [lm_head.weight.detach().float().cpu()],
        }


def capture_grouped(
    seqs: Sequence[list[int]],
    budget: int,
    run: Callable[[list[list[int]]], Captured],
    keep: Callable[[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None],
) -> None:
    """``run`` every sequence, shortest first, in forwards of at most ``budget`` tokens (a
    longer sequence alone); ``keep(index, features, top ids, top probs)`` for each."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    group: list[int] = []
    bar = tqdm(total=sum(len(s) for s in seqs), desc="capture", unit="tok")

    def flush() -> None:
        feats, top_i, top_p = run([list(seqs[i]) for i in group])
        for j, i in enumerate(group):
            keep(i, feats[j], top_i[j] if top_i else None, top_p[j] if top_p else None)
            bar.update(len(seqs[i]))
        group.clear()

    for i in order:
        if group and sum(len(seqs[j]) for j in group) + len(seqs[i]) > budget:
            flush()
        group.append(i)
    if group:
        flush()
    bar.close()


def cached_capture(file: Path, key: dict[str, Any], capture: Callable[[], dict]) -> dict:
    """The capture saved in ``file`` if it was made for ``key`` (what it depends on: the data,
    the layers, the sequence cut...), else ``capture()``, saved there with its key."""
    data = torch.load(file) if file.is_file() else None
    if data is None or data.get("key") != key:
        data = capture()
        torch.save({**data, "key": key}, file)
    return data
