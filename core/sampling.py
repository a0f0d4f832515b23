"""Batched sampling: penalties, logit bias, min-tokens masking, temperature / top-k / top-p /
min-p, seeds and logprobs, for all requests of a step at once.

Seeded rows draw their noise from a generator keyed by (seed, output position), so a seeded
request gives the same output whatever else shares its batch. A seed is any unsigned 64-bit
integer; the key is folded to 63 bits (torch seeds are signed 64-bit). Sampling uses the
exponential race (argmax of p / Exp(1)), which equals drawing from p.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import torch

from radixserve.core.batch import to_device
from radixserve.core.grammar import mark_dead_rows
from radixserve.core.request import Req

_SEED_MASK = (1 << 63) - 1
#: top-k keeps the vocabulary sort off when every row's k is at most vocab / this
TOP_K_PREFILTER = 8
_T = TypeVar("_T")


class SampleResult(NamedTuple):
    next_ids: list[int]
    logprobs: list[float] | None  # logprob of each chosen token (rows that asked; else 0.0)
    top_logprobs: list[list[tuple[float, int]]] | None


def sample(
    logits: torch.Tensor,
    reqs: Sequence[Req],
    eos_ids: Sequence[int],
    raw: torch.Tensor | None = None,
) -> SampleResult:
    """Choose the next token of each request; ``logits`` is [len(reqs), vocab] float32, already
    grammar-masked where ``raw`` (the unmasked logits, for logprobs) is given. A constrained row
    with no allowed token gets ``NO_TOKEN``.

    A batch that fails is sampled again row by row: a row that still fails gets its argmax
    token and ``req.failed`` (the engine then ends that request), and the others their own."""
    try:
        return _sample(logits, reqs, eos_ids, raw)
    except Exception:  # noqa: BLE001 - found and marked row by row below
        if len(reqs) == 1:
            raise
    parts = [
        _row_apart(lambda i: _sample(logits[i : i + 1], [reqs[i]], eos_ids, _row(raw, i)), i, reqs)
        for i in range(len(reqs))
    ]
    next_ids = [
        p.next_ids[0] if p is not None else int(logits[i].argmax()) for i, p in enumerate(parts)
    ]
    if not any(r.sampling.logprobs for r in reqs):
        return SampleResult(next_ids, None, None)
    logprobs = [p.logprobs[0] if p is not None and p.logprobs else 0.0 for p in parts]
    tops = [p.top_logprobs[0] if p is not None and p.top_logprobs else [] for p in parts]
    return SampleResult(next_ids, logprobs, tops)


def _sample(
    logits: torch.Tensor,
    reqs: Sequence[Req],
    eos_ids: Sequence[int],
    raw: torch.Tensor | None = None,
) -> SampleResult:
    raw = logits if raw is None else raw
    logits = adjusted_logits(logits, reqs, eos_ids)
    next_ids = sample_ids(logits, reqs)
    result = token_logprobs(raw, next_ids, reqs)
    if any(r.grammar is not None for r in reqs):
        mark_dead_rows(logits, result.next_ids, reqs)
    return result


def sample_ids(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """The chosen token of each row, on the device, with no host sync: the whole of sampling
    for requests without penalties, grammars or logprobs (after min-tokens masking). A row
    that fails is handled as in ``sample``."""
    if all(r.sampling.is_greedy for r in reqs):
        return logits.argmax(dim=-1)
    try:
        return _sample_rows(logits, reqs)
    except Exception:  # noqa: BLE001 - found and marked row by row below
        if len(reqs) == 1:
            raise
    rows = [
        _row_apart(lambda i: _sample_rows(logits[i : i + 1], [reqs[i]]), i, reqs)
        for i in range(len(reqs))
    ]
    return torch.cat(
        [r if r is not None else logits[i : i + 1].argmax(dim=-1) for i, r in enumerate(rows)]
    )


def _row_apart(run: Callable[[int], _T], i: int, reqs: Sequence[Req]) -> _T | None:
    """``run(i)`` for row ``i`` alone; None, with its request marked failed, if it raises."""
    try:
        return run(i)
    except Exception as e:  # noqa: BLE001 - this request fails; its batch goes on
        reqs[i].failed = f"sampling failed for this request ({type(e).__name__}: {e})"
        return None


def _row(tensor: torch.Tensor | None, i: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[i : i + 1]


def _apply_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    rows = [
        i
        for i, r in enumerate(reqs)
        if r.sampling.frequency_penalty
        or r.sampling.presence_penalty
        or r.sampling.repetition_penalty != 1.0
    ]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        params, req = reqs[i].sampling, reqs[i]
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.input_ids) | set(req.output_ids)), device=row.device)
            vals = row[seen]
            # a tiny penalty must not push a logit to inf (softmax would give nan)
            boosted = (vals / params.repetition_penalty).clamp(max=torch.finfo(row.dtype).max)
            row[seen] = torch.where(vals > 0, boosted, vals * params.repetition_penalty)
        if req.output_ids and (params.frequency_penalty or params.presence_penalty):
            ids = torch.tensor(req.output_ids, device=row.device)
            counts = torch.zeros_like(row).scatter_add_(
                0, ids, torch.ones_like(ids, dtype=row.dtype)
            )
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def mask_until_min_tokens(
    logits: torch.Tensor, reqs: Sequence[Req], eos_ids: Sequence[int]
) -> torch.Tensor:
    rows = [i for i, r in enumerate(reqs) if r.num_output_tokens < r.sampling.min_new_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        banned = list(eos_ids) + list(reqs[i].sampling.stop_token_ids)
        if banned:
            logits[i, banned] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """``logits`` plus each request's ``logit_bias`` (a copy where any row has one): one
    sparse add for the whole batch, from (row, token, bias) triples parsed once per request.
    No request with a bias: no work beyond one scan of ``reqs``."""
    rows = [i for i, r in enumerate(reqs) if r.sampling.logit_bias]
    if not rows:
        return logits
    row_idx: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for i in rows:
        req = reqs[i]
        if req.bias_entries is None:
            bias = req.sampling.logit_bias or {}
            req.bias_entries = ([int(k) for k in bias], list(bias.values()))
        ids, values = req.bias_entries
        row_idx += [i] * len(ids)
        tokens += ids
        biases += values
    device = logits.device
    index = to_device(torch.tensor([row_idx, tokens]), device)
    values_t = to_device(torch.tensor(biases, dtype=logits.dtype), device)
    return logits.index_put((index[0], index[1]), values_t, accumulate=True)


def presample_logits(
    logits: torch.Tensor, reqs: Sequence[Req], eos_ids: Sequence[int]
) -> torch.Tensor:
    """What every sampling path applies: ``logit_bias``, then the min-tokens mask. (The
    overlap path calls this alone: penalties make a request non-overlappable.)"""
    return mask_until_min_tokens(apply_logit_bias(logits, reqs), reqs, eos_ids)


def adjusted_logits(
    logits: torch.Tensor, reqs: Sequence[Req], eos_ids: Sequence[int]
) -> torch.Tensor:
    """``logits`` after the penalties, ``logit_bias`` and the min-tokens mask (a copy where any
    applies), as SGLang orders them; temperature and filtering come after."""
    return presample_logits(_apply_penalties(logits, reqs), reqs, eos_ids)


def target_probs(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) inside its top-k, top-p
    nucleus and min-p floor (unnormalized after filtering; draws treat it as weights)."""
    temps = to_device(
        torch.tensor([max(r.sampling.temperature, 1e-6) for r in reqs]), logits.device
    ).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    if any(r.sampling.top_k > 0 or r.sampling.top_p < 1.0 or r.sampling.min_p > 0 for r in reqs):
        probs = _filter_probs(probs, reqs)
    return probs


def _sample_rows(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    probs = target_probs(logits, reqs)
    noise = torch.empty_like(probs).exponential_()
    for i, r in enumerate(reqs):
        if r.sampling.seed is not None:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(row_seed(r.sampling.seed, r.num_output_tokens))
            noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    greedy = to_device(torch.tensor([r.sampling.is_greedy for r in reqs]), logits.device)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def row_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded row at output ``position``, in [0, 2**63)."""
    return (seed * 1_000_003 + position) & _SEED_MASK


def _filter_probs(probs: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """Zero the tokens outside each row's top-k, top-p nucleus and min-p floor."""
    device = probs.device
    vocab = probs.shape[-1]
    ks = [min(r.sampling.top_k, vocab) if r.sampling.top_k > 0 else vocab for r in reqs]
    top_k = to_device(torch.tensor(ks), device)
    top_p = to_device(torch.tensor([r.sampling.top_p for r in reqs]), device)
    min_p = to_device(torch.tensor([r.sampling.min_p for r in reqs]), device)
    width = max(ks)
    if width * TOP_K_PREFILTER <= vocab:
        # Every row keeps at most ``width`` tokens: top-p and min-p only ever look inside
        # them, so the largest ``width`` (sorted) stand in for the sort of the whole vocabulary.
        sorted_probs, order = probs.topk(width, dim=-1, sorted=True)
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_probs.shape[-1], device=device)[None, :]
    drop = rank >= top_k[:, None]
    # NOTE: keep a token while the mass before it is below top_p, so the first always stays.
    drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
    drop |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    drop[:, 0] = False  # the likeliest token stays, whatever top_p rounds to (1e-46 -> 0)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def token_logprobs(raw: torch.Tensor, next_ids: torch.Tensor, reqs: Sequence[Req]) -> SampleResult:
    """``next_ids`` with, for the rows that ask, their logprobs under ``raw`` and the top ones."""
    rows = [i for i, r in enumerate(reqs) if r.sampling.logprobs]
    if not rows:
        return SampleResult(next_ids.tolist(), None, None)
    idx = torch.tensor(rows, device=raw.device)
    logprobs = torch.log_softmax(raw[idx], dim=-1)
    chosen = logprobs.gather(1, next_ids[idx].unsqueeze(1)).squeeze(1).tolist()
    k = min(max(reqs[i].sampling.top_logprobs_num for i in rows), logprobs.shape[-1])
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    top_vals_l, top_ids_l = top_vals.tolist(), top_ids.long().tolist()
    out_lp = [0.0] * len(reqs)
    out_top: list[list[tuple[float, int]]] = [[] for _ in reqs]
    for j, i in enumerate(rows):
        n = reqs[i].sampling.top_logprobs_num
        out_lp[i] = chosen[j]
        out_top[i] = list(zip(top_vals_l[j][:n], top_ids_l[j][:n], strict=True))
    return SampleResult(next_ids.tolist(), out_lp, out_top)
