"""The engine process's side of a step's output: what changed for each request since its last
output, gathered column by column into one ``ipc.StepOutput`` per step.

This runs once per request per step in the server's engine process (the offline Engine reads
its requests directly), so the common case (a decode that gained a token and some text) costs
a few list appends; everything else goes to a ``ReqExtras`` only for the requests that have it.
"""

from __future__ import annotations

from radixserve.core.request import Req
from radixserve.entrypoints import ipc

# What a live request has been sent: indices into the list kept per rid.
_TOKENS, _TEXT, _CACHED, _VERIFY, _ACCEPTED = range(5)


class StepOutputBuilder:
    """Collects the outputs of the requests that changed; ``take`` hands them over as one
    message. Remembers per live request what it has been sent, and forgets it with the
    request's finishing output."""

    def __init__(self) -> None:
        self._sent: dict[str, list[int]] = {}
        self._out = ipc.StepOutput(rids=[], num_tokens=[], token_ids=[], text_deltas=[], extras={})

    def __len__(self) -> int:
        return len(self._out.rids)

    def add(self, req: Req, error_status: int = 0) -> int:
        """Add what ``req`` gained since its previous output (its finish, if it finished);
        return how many new tokens that is. ``error_status``: 400 or 500 for a request the
        engine refused or failed (also read from ``req.refused`` / ``req.failed``)."""
        out, rid = self._out, req.rid
        sent = self._sent.get(rid)
        if sent is None:
            sent = self._sent[rid] = [0, 0, 0, 0, 0]
        ids = req.output_ids
        n_sent, n_ids = sent[_TOKENS], len(ids)
        out.rids.append(rid)
        out.num_tokens.append(n_ids - n_sent)
        if n_ids > n_sent:
            out.token_ids += ids[n_sent:]
        detok = req.detok
        text = detok.text if detok is not None else ""
        text_sent = sent[_TEXT]
        out.text_deltas.append(text[text_sent:])  # "" where a stop string cut the text
        finished = req.finished
        if (
            finished
            or error_status
            or req.sampling.logprobs
            or len(text) < text_sent
            or req.cached_tokens != sent[_CACHED]
            or req.spec_verify_ct != sent[_VERIFY]
            or req.spec_accepted_tokens != sent[_ACCEPTED]
        ):
            out.extras[len(out.rids) - 1] = _extras(req, sent, text, error_status)
        if finished:
            del self._sent[rid]
        else:
            sent[_TOKENS], sent[_TEXT] = n_ids, len(text)
        return n_ids - n_sent

    def take(self) -> ipc.StepOutput | None:
        """The step's output so far (None if nothing changed); the builder starts afresh."""
        out = self._out
        if not out.rids:
            return None
        self._out = ipc.StepOutput(rids=[], num_tokens=[], token_ids=[], text_deltas=[], extras={})
        return out


def _extras(req: Req, sent: list[int], text: str, error_status: int) -> ipc.ReqExtras:
    n_sent = sent[_TOKENS]
    extras = ipc.ReqExtras(
        error_status=error_status or (400 if req.refused else 500 if req.failed else 0)
    )
    if len(text) < sent[_TEXT]:
        extras.text_start = len(text)
    if req.cached_tokens != sent[_CACHED]:
        extras.cached_tokens = sent[_CACHED] = req.cached_tokens
        extras.context_tokens = req.context_tokens
    if req.finished:
        extras.context_tokens = req.context_tokens
    if req.spec_verify_ct != sent[_VERIFY] or req.spec_accepted_tokens != sent[_ACCEPTED]:
        extras.spec_verify_ct = sent[_VERIFY] = req.spec_verify_ct
        extras.spec_accepted_tokens = sent[_ACCEPTED] = req.spec_accepted_tokens
    if req.sampling.logprobs:
        extras.logprobs = req.output_logprobs[n_sent:]
        if req.sampling.top_logprobs_num:
            extras.top_logprobs = req.output_top_logprobs[n_sent:]
    if req.finished:
        extras.finish = req.finish_reason
        extras.spec_draft_tokens = req.spec_draft_tokens
        extras.embedding, extras.label_logprobs = req.embedding, req.label_logprobs
        if req.logprob_start_len >= 0:
            extras.input_logprobs = req.input_token_logprobs
            if req.sampling.top_logprobs_num:
                extras.input_top_logprobs = req.input_top_logprobs
    return extras
