"""Verifying drafts against the target's logits (the core's side; ``core/speculative.py``
decides who drafts and checks the drafts).

One verify step per speculating request: the target runs over [last token, d1 .. dm] (m + 1
new tokens, like a prefill chunk) and its logits row j is what the target would sample after
d1 .. dj. Row j is sampled exactly as a plain decode at that output position would be (the same
penalties, min-tokens mask, grammar mask and per-position seed), giving t0 .. tm:

- drafts without probabilities (greedy drafts, n-gram lookups): d(j+1) is accepted while it
  equals tj. Every emitted token is then the token the target itself samples at its position,
  so greedy output, and seeded sampled output, equal speculation off token for token.
- drafts drawn from a distribution q (a draft model sampling): rejection sampling, accepting
  d(j+1) with probability min(1, p(d) / q(d)) and otherwise drawing from norm(max(p - q, 0)),
  which keeps the target's distribution and accepts more than exact matching.

The request emits the accepted drafts plus one target token (a + 1 tokens, 1 <= a + 1 <= m + 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch

from radixserve.core.interfaces import Draft
from radixserve.core.request import Req
from radixserve.core.sampling import (
    SampleResult,
    adjusted_logits,
    row_seed,
    sample,
    target_probs,
    token_logprobs,
)
from radixserve.core.spec_tree import accepted_nodes, ancestors
from radixserve.core.step_plan import SampledToken


class AcceptSimulation(Protocol):
    """What verifying reads of the speculator (``core.speculative.Speculator``, which imports
    this module): whether accept lengths are simulated (benchmarks), and the simulated count."""

    simulate_accept_len: float | None

    def simulated(self, num_drafted: int, rid: str = "") -> int: ...


class DraftPosition:
    """``req`` as the sampler sees it at verify row ``j``: its outputs followed by the first
    ``j`` draft tokens (for penalties, the min-tokens mask and per-position seeds)."""

    __slots__ = ("req", "draft", "j")

    def __init__(self, req: Req, draft: list[int], j: int) -> None:
        self.req, self.draft, self.j = req, draft, j

    @property
    def sampling(self) -> Any:
        return self.req.sampling

    @property
    def input_ids(self) -> list[int]:
        return self.req.input_ids

    @property
    def output_ids(self) -> list[int]:
        return self.req.output_ids + self.draft[: self.j] if self.j else self.req.output_ids

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens + self.j

    @property
    def grammar(self) -> Any:
        return self.req.grammar

    @property
    def bias_entries(self) -> Any:  # logit_bias parsed once per request (apply_logit_bias)
        return self.req.bias_entries

    @bias_entries.setter
    def bias_entries(self, entries: Any) -> None:
        self.req.bias_entries = entries

    @property
    def failed(self) -> str | None:
        return self.req.failed

    @failed.setter
    def failed(self, message: str | None) -> None:
        self.req.failed = message


def read_pending(drafts: Sequence[Draft | None], also: torch.Tensor | None = None) -> list[int]:
    """Read the tokens of every pending draft to the host (into ``draft.tokens``), and the
    values of ``also``, in one device-to-host copy; return ``also``'s values."""
    pending = [d for d in drafts if d is not None and d.pending is not None]
    parts = [] if also is None else [also.reshape(-1)]
    parts += [cast("torch.Tensor", d.pending).reshape(-1) for d in pending]
    if not parts:
        return []
    flat = torch.cat([p.to(torch.int64) for p in parts]).tolist()  # the host sync
    at = 0 if also is None else also.numel()
    for d in pending:
        n = len(d.tokens)
        d.tokens[:] = flat[at : at + n]
        d.pending = None
        at += n
    return flat[: 0 if also is None else also.numel()]


def plain_greedy(req: Req) -> bool:
    """Whether ``req``'s verify rows are sampled by a bare argmax (no logprobs, grammar,
    penalties, logit bias or min-tokens mask), so the argmax can be read with the drafts."""
    s = req.sampling
    return (
        s.is_greedy
        and not s.logprobs
        and req.grammar is None
        and not (s.frequency_penalty or s.presence_penalty or s.repetition_penalty != 1.0)
        and not s.logit_bias
        and req.num_output_tokens >= s.min_new_tokens
    )


def verify_drafts(
    logits: torch.Tensor,
    reqs: Sequence[Req],
    drafts: Sequence[Draft | None],
    eos_ids: Sequence[int],
    masker: Any,
    speculator: AcceptSimulation,
) -> list[list[SampledToken]]:
    """``verify`` for drafts some of which may still be on the device: one host sync reads
    them, and, where every request is sampled by a bare argmax, the target's tokens too."""
    greedy = None
    if all(plain_greedy(r) for r in reqs):
        greedy = read_pending(drafts, logits.argmax(dim=-1))
    else:
        read_pending(drafts)
    return verify(
        logits, reqs, [d.tokens if d is not None else [] for d in drafts],
        [d.probs if d is not None else None for d in drafts],
        eos_ids, masker, speculator, greedy,
        [d.parents if d is not None else None for d in drafts],
    )  # fmt: skip


def verify(
    logits: torch.Tensor,
    reqs: Sequence[Req],
    drafts: Sequence[list[int]],
    draft_probs: Sequence[torch.Tensor | None],
    eos_ids: Sequence[int],
    masker: Any,
    speculator: AcceptSimulation,
    greedy_ids: list[int] | None = None,
    trees: Sequence[list[int] | None] | None = None,
) -> list[list[SampledToken]]:
    """The tokens each request emits this step. ``logits`` holds len(drafts[i]) + 1 rows per
    request, in order; ``masker`` (core.grammar.GrammarMasker) masks constrained rows.
    ``greedy_ids``: every row's argmax, already read, where every request is ``plain_greedy``
    (what sampling would choose). ``trees``: each draft's parents where it is a tree
    (core/spec_tree.py: row 0 the root, row 1 + j node j), else None."""
    trees = trees if trees is not None else [None] * len(drafts)
    positions, firsts = _positions(reqs, drafts, trees)
    # A DraftPosition has every attribute of a Req that the sampler reads.
    views = cast("list[Req]", positions)
    raw = None
    constrained = any(r.grammar is not None for r in reqs)
    if constrained:
        if any(r.sampling.logprobs for r in reqs):
            raw = logits.clone()  # logprobs report the model's belief, not the mask
        masker.apply_chains(
            logits, [(f, r.grammar, d) for f, r, d in zip(firsts, reqs, drafts, strict=True)]
        )
    rejection = [
        i
        for i, (r, q) in enumerate(zip(reqs, draft_probs, strict=True))
        if q is not None and drafts[i] and not r.sampling.is_greedy and r.grammar is None
    ]
    if greedy_ids is not None:
        result = SampleResult(greedy_ids, None, None)
    else:
        result = sample(logits, views, eos_ids, raw)
    ids = list(result.next_ids)
    if rejection:
        _rejection_sample(logits, views, firsts, drafts, draft_probs, rejection, eos_ids, ids)
    changed = bool(rejection) or speculator.simulate_accept_len is not None
    emitted_rows = _emitted_rows(ids, reqs, drafts, trees, firsts, speculator)
    logprobs = result
    if changed and result.logprobs is not None:  # the chosen ids moved: score them again
        chosen = torch.tensor(ids, device=logits.device)
        logprobs = token_logprobs(raw if raw is not None else logits, chosen, views)
    out: list[list[SampledToken]] = []
    for rows in emitted_rows:
        if logprobs.logprobs is None:
            out.append([(ids[r], None, None) for r in rows])
        else:
            tops = logprobs.top_logprobs
            out.append([(ids[r], logprobs.logprobs[r], tops[r] if tops else None) for r in rows])
    return out


def _positions(
    reqs: Sequence[Req], drafts: Sequence[list[int]], trees: Sequence[list[int] | None]
) -> tuple[list[DraftPosition], list[int]]:
    """Each logits row's view of its request (the draft tokens before it), and each
    request's first row."""
    positions: list[DraftPosition] = []
    firsts: list[int] = []
    for req, draft, tree in zip(reqs, drafts, trees, strict=True):
        firsts.append(len(positions))
        if tree is None:
            positions += [DraftPosition(req, draft, j) for j in range(len(draft) + 1)]
            continue
        assert req.grammar is None, "a constrained request drafts chains"
        positions.append(DraftPosition(req, [], 0))
        for j in range(len(draft)):
            path = [draft[a] for a in ancestors(tree, j)]
            positions.append(DraftPosition(req, path, len(path)))
    return positions, firsts


def _emitted_rows(
    ids: list[int],
    reqs: Sequence[Req],
    drafts: Sequence[list[int]],
    trees: Sequence[list[int] | None],
    firsts: list[int],
    speculator: AcceptSimulation,
) -> list[list[int]]:
    """Per request, the rows whose sampled ids it emits: the accepted prefix of its draft
    and the target's token after it (a tree: its accepted path). A simulated accept length
    writes the accepted drafts into ``ids``."""
    emitted_rows: list[list[int]] = []
    for i, draft in enumerate(drafts):
        first, tree = firsts[i], trees[i]
        if tree is not None:
            sampled = ids[first : first + len(draft) + 1]
            emitted_rows.append(
                [first] + [first + 1 + j for j in accepted_nodes(draft, tree, sampled)]
            )
            continue
        accepted = 0
        if speculator.simulate_accept_len is not None and draft:
            accepted = speculator.simulated(len(draft), reqs[i].rid)
            ids[first : first + accepted] = draft[:accepted]
        else:
            while accepted < len(draft) and ids[first + accepted] == draft[accepted]:
                accepted += 1
        emitted_rows.append(list(range(first, first + accepted + 1)))
    return emitted_rows


def _rejection_sample(
    logits: torch.Tensor,
    views: list[Req],
    firsts: list[int],
    drafts: Sequence[list[int]],
    draft_probs: Sequence[torch.Tensor | None],
    entries: list[int],
    eos_ids: Sequence[int],
    ids: list[int],
) -> None:
    """Rewrite ``ids`` rows of the ``entries`` requests by rejection sampling: row j keeps
    d(j+1) when accepted; the first rejected row gets a draw from the residual, and a fully
    accepted chain's last row keeps its draw from the target."""
    for i in entries:
        draft, first = drafts[i], firsts[i]
        rows = views[first : first + len(draft) + 1]
        p = target_probs(adjusted_logits(logits[first : first + len(rows)], rows, eos_ids), rows)
        p = p / p.sum(dim=-1, keepdim=True)
        q = draft_probs[i]
        assert q is not None
        q = q.to(p.device, torch.float32)
        q = q / q.sum(dim=-1, keepdim=True)
        gen = _generator(rows[0], p.device)
        uniform = torch.rand(len(draft), generator=gen, device=p.device).tolist()
        p_draft = p[torch.arange(len(draft)), torch.tensor(draft, device=p.device)].tolist()
        q_draft = q[torch.arange(len(draft)), torch.tensor(draft, device=q.device)].tolist()
        for j, d in enumerate(draft):
            if uniform[j] * q_draft[j] < p_draft[j]:
                ids[first + j] = d
                continue
            residual = (p[j] - q[j]).clamp_min(0.0)
            if float(residual.sum()) <= 0.0:
                residual = p[j]
            ids[first + j] = int(torch.multinomial(residual, 1, generator=gen))
            break


def _generator(view: Req, device: torch.device) -> torch.Generator | None:
    seed = view.sampling.seed
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(row_seed(seed ^ 0x5BEC, view.num_output_tokens))
    return gen
