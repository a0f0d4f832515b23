"""Constrained decoding on the engine's thread: batch masks, token acceptance, jump-forward.

The grammar only masks logits: it never changes what the model believes (logprobs come from the
unmasked logits) and never repairs an output. A sampled token the matcher rejects, or a step
where no token is allowed, ends the request with an abort that says so.

Per step: ``GrammarMasker.apply`` fills the rows of the constrained requests of one
preallocated bitmask and masks their logits in one call. After sampling, ``GrammarStepper``
advances each matcher, finishes terminated requests and proposes jump-forward tokens: when the
grammar forces a unique continuation, its text is tokenized and appended without sampling, and
the next step extends over those tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.core.interfaces import GrammarBackend
from radixserve.core.request import FinishReason, Req
from radixserve.core.tokenizer import Tokenizer

#: The sampler's token id for a row where the masks allowed no token at all.
NO_TOKEN = -1


class GrammarMasker:
    """Owns the batch bitmask: allocated once (max_running_requests rows), filled per step."""

    def __init__(self, backend: Callable[[], GrammarBackend], rows: int, vocab_size: int) -> None:
        self._backend = backend
        self.rows = rows
        self.vocab_size = vocab_size
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, reqs: Sequence[Req]) -> bool:
        """Mask, in place, the logits rows of the requests that carry a grammar (``logits`` row
        i belongs to ``reqs[i]``). Returns whether any row was masked."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return False
        backend = self._backend()
        if self._host is None:
            self._host = backend.allocate_bitmask(self.rows, self.vocab_size)
        backend.fill_bitmasks([(i, reqs[i].grammar) for i in rows], self._host)
        mask = self._host
        if logits.device != mask.device:
            if self._device is None:
                self._device = torch.empty_like(mask, device=logits.device)
            n = max(rows) + 1
            self._device[:n].copy_(mask[:n], non_blocking=True)
            mask = self._device
        backend.apply_bitmask(logits, mask, rows)
        return True

    def apply_chains(
        self, logits: torch.Tensor, chains: Sequence[tuple[int, Any, Sequence[int]]]
    ) -> None:
        """Mask verify rows: for each (first row, matcher or None, draft), row first + j gets
        the matcher's mask after the first j draft tokens (which it must accept; drafts are
        checked when proposed). Each matcher is left as it was."""
        rows: list[int] = []
        total = max((f + len(d) + 1 for f, g, d in chains if g is not None), default=0)
        if not total:
            return
        backend = self._backend()
        if self._host is None or self._host.shape[0] < total:
            self._host = backend.allocate_bitmask(max(total, self.rows), self.vocab_size)
            self._device = None
        for first, grammar, draft in chains:
            if grammar is None:
                continue
            for j in range(len(draft) + 1):
                grammar.fill_bitmask(self._host, first + j)
                rows.append(first + j)
                if j < len(draft) and not grammar.accept_token(draft[j]):
                    raise RuntimeError(f"a checked draft token {draft[j]} broke the grammar")
            grammar.rollback(len(draft))
        mask = self._host
        if logits.device != mask.device:
            if self._device is None or self._device.shape[0] < mask.shape[0]:
                self._device = torch.empty_like(mask, device=logits.device)
            n = max(rows) + 1
            self._device[:n].copy_(mask[:n], non_blocking=True)
            mask = self._device
        backend.apply_bitmask(logits, mask, rows)


class GrammarStepper:
    """What the scheduler asks of a request's grammar after each sampled token."""

    def __init__(self, tokenizer: Tokenizer, jump_forward: bool = True) -> None:
        self.tokenizer = tokenizer
        self.jump_forward = jump_forward
        self.jump_forward_tokens = 0  # appended without sampling, over the engine's life

    def accept(self, req: Req, token: int) -> bool:
        """Advance ``req``'s matcher by the sampled ``token``; on failure finish the request with
        an abort naming the problem and return False (the token is not appended)."""
        if token == NO_TOKEN:
            message = (
                f"grammar dead end after {len(req.output_ids)} output tokens: no token is "
                "allowed here"
            )
            if len(req.output_ids) < req.sampling.min_new_tokens:
                message += " (only a stop token was, but min_new_tokens is not reached)"
            req.finish(FinishReason("abort", message=message))
            return False
        if not req.grammar.accept_token(token):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            req.finish(
                FinishReason(
                    "abort",
                    message=f"the grammar rejected sampled token {token} ({text!r}) after "
                    f"{len(req.output_ids)} output tokens",
                )
            )
            return False
        return True

    def after_token(self, req: Req) -> list[int]:
        """Finish ``req`` (stop) if its grammar terminated; else the jump-forward tokens, already
        accepted by the matcher, for the caller to append in order."""
        grammar = req.grammar
        if grammar.is_terminated():
            if not req.finished:
                req.finish(FinishReason("stop", matched=req.output_ids[-1]))
            return []
        return self.forced_tokens(req)

    def forced_tokens(self, req: Req) -> list[int]:
        """Tokens of the continuation the grammar forces, accepted into the matcher.

        The forced text is tokenized on its own and its last token is left to the model, which
        may merge it with the text that follows (as the tokenizer would). Requests returning
        logprobs are not jumped: forced tokens have no model logprob.
        """
        if not self.jump_forward or req.sampling.logprobs or req.finished:
            return []
        text = req.grammar.forced_string()
        if not text:
            return []
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:-1]
        budget = req.sampling.max_new_tokens - len(req.output_ids)
        accepted: list[int] = []
        for token in ids[: max(budget, 0)]:
            if not req.grammar.accept_token(token):
                break
            accepted.append(token)
        self.jump_forward_tokens += len(accepted)
        return accepted


def mark_dead_rows(logits: torch.Tensor, next_ids: list[int], reqs: Sequence[Req]) -> None:
    """Replace the sampled id of each constrained row whose logits are all -inf (nothing was
    allowed) by ``NO_TOKEN``; one reduction for the batch."""
    dead = torch.isneginf(logits.amax(dim=-1)).tolist()
    for i, req in enumerate(reqs):
        if dead[i] and req.grammar is not None:
            next_ids[i] = NO_TOKEN
