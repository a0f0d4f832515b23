"""Batch-invariant attention with a fixed KV split (--enable-deterministic-inference).

Every query row of a step (decode, prefill chunk, extend after a cached prefix, verify row)
takes the same path: its keys, the sequence positions 0 .. its own, are read in splits of
``KV_SPLIT`` positions counted from the sequence's start, and the splits are merged in
order by the running-max softmax (float32). Query rows go in blocks of exactly ``Q_BLOCK`` rows
(the last padded), so every product has one shape whatever the step holds. A row's result
therefore depends on its query and its keys only:

- the same positions fall in the same split whether they came from the prefix cache, an
  earlier chunk or this step, and a split is always ``KV_SPLIT`` wide (positions past the row
  masked), so each split's sums run over the same elements in the same order;
- a split wholly past a row (a longer request's in the same block) adds exactly nothing to
  it: its scale factor is exp(0) = 1 and its weights exp(-inf) = 0.

Used by torch_native (``TorchNativeAttention.set_batch_invariant``); it gathers KV per block
and split, so it is slower than the default SDPA path (docs/deterministic.md).
"""

from __future__ import annotations

import torch

#: key positions per split (fixed: a row's reduction order depends on it alone)
KV_SPLIT = 64
#: query rows per product
Q_BLOCK = 16


class RowTable:
    """A step's query rows: the slot of each of a row's key positions and its own position."""

    def __init__(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.slots = slots  # [rows padded to Q_BLOCK, positions padded to KV_SPLIT] int64
        self.positions = positions  # [rows padded] int64; -1 for padding rows
        self.rows = int((positions >= 0).sum())


def row_table(batch_rows: list[tuple[int, int, int]], req_to_token: torch.Tensor,
              device: str) -> RowTable:  # fmt: skip
    """The table of a step whose requests, in the order of the step's query rows, are
    ``(slot-table row, new tokens, sequence length)``."""
    width = max((total for _, _, total in batch_rows), default=1)
    width = -(-width // KV_SPLIT) * KV_SPLIT
    reqs, lens, firsts = [], [], []
    for row, new, total in batch_rows:
        reqs.append(row)
        lens.append(new)
        firsts.append(total - new)
    n = sum(lens)
    padded = -(-max(n, 1) // Q_BLOCK) * Q_BLOCK
    table = req_to_token[torch.tensor(reqs, dtype=torch.int64)]
    if table.shape[1] < width:
        table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
    table = table[:, :width].to(torch.int64)
    counts = torch.tensor(lens, dtype=torch.int64)
    slots = torch.zeros(padded, width, dtype=torch.int64)
    slots[:n] = table.repeat_interleave(counts, dim=0)
    positions = torch.full((padded,), -1, dtype=torch.int64)
    positions[:n] = torch.cat(
        [torch.arange(f, f + m, dtype=torch.int64) for f, m in zip(firsts, lens, strict=True)]
    ) if n else positions[:0]  # fmt: skip
    return RowTable(slots.to(device), positions.to(device))


def attend(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, table: RowTable, scale: float,
    *, window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """[rows, H, d] in q's dtype: each row of ``q`` [rows, H, d] attended over its keys in
    the pool buffers ``k_buf``/``v_buf`` [slots, kv_heads, d]."""
    rows, heads, d = q.shape
    kvh = k_buf.shape[1]
    group = heads // kvh
    padded = table.positions.shape[0]
    qf = torch.zeros(padded, kvh, group, d, dtype=torch.float32, device=q.device)
    qf[:rows] = q.reshape(rows, kvh, group, d).float()
    out = torch.empty(padded, kvh, group, d, dtype=torch.float32, device=q.device)
    k2, v2 = k_buf.view(k_buf.shape[0], -1), v_buf.view(v_buf.shape[0], -1)
    offs = torch.arange(KV_SPLIT, device=q.device)
    for b in range(0, padded, Q_BLOCK):
        pos = table.positions[b : b + Q_BLOCK]
        splits = (int(pos.max()) + KV_SPLIT) // KV_SPLIT if int(pos.max()) >= 0 else 0
        out[b : b + Q_BLOCK] = _block(
            qf[b : b + Q_BLOCK], k2, v2, table.slots[b : b + Q_BLOCK], pos, splits, offs,
            (kvh, d), scale, window, softcap,
        )  # fmt: skip
    return out[:rows].view(rows, heads, d).to(q.dtype)


def _block(
    q: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
    splits: int, offs: torch.Tensor, shape: tuple[int, int], scale: float, window: int,
    softcap: float,
) -> torch.Tensor:  # fmt: skip
    """One block of Q_BLOCK rows: q [Q_BLOCK, kvh, group, d] float32 -> the same shape."""
    kvh, d = shape
    nb, _, group, _ = q.shape
    m = torch.full((nb, kvh, group, 1), float("-inf"), device=q.device)
    denom = torch.zeros(nb, kvh, group, 1, device=q.device)
    acc = torch.zeros_like(q)
    for s in range(splits):
        idx = slots[:, s * KV_SPLIT : (s + 1) * KV_SPLIT].reshape(-1)
        # [nb, kvh, d, KV_SPLIT] and [nb, kvh, KV_SPLIT, d]
        k = k2.index_select(0, idx).view(nb, KV_SPLIT, kvh, d).float().permute(0, 2, 3, 1)
        v = v2.index_select(0, idx).view(nb, KV_SPLIT, kvh, d).float().transpose(1, 2)
        scores = torch.matmul(q, k) * scale  # [nb, kvh, group, KV_SPLIT]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        key_pos = s * KV_SPLIT + offs
        seen = key_pos[None, :] <= pos[:, None]
        if window:
            seen &= key_pos[None, :] > (pos - window)[:, None]
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        weights = torch.exp(scores - base)
        alpha = torch.exp(m - base)
        denom = denom * alpha + weights.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(weights, v)
        m = m_new
    return acc / denom
