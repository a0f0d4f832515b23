"""Speculative decoding statistics in a response's ``meta_info``, named as SGLang names them.

Present only while speculation is on (SGLang adds them only with ``--speculative-algorithm``),
in every response and streamed event, counted so far:

- ``spec_verify_ct``: verify steps in which the request verified a draft (SGLang's name).
- ``spec_accepted_tokens``: draft tokens accepted over them (the count SGLang's scheduler
  sends as ``spec_accepted_tokens``).
- ``spec_accept_token_num`` / ``spec_draft_token_num``: SGLang's names for the accepted
  drafts and for the drafts its verify steps could hold (``spec_verify_ct`` times the draft
  length; a step's draft may be shorter here, e.g. near the token budget).
- ``spec_accept_rate``: ``spec_accept_token_num / spec_draft_token_num``.
- ``spec_accept_length``: tokens the request gained per verify step, accepted drafts plus the
  target's own token, ``(spec_verify_ct + spec_accepted_tokens) / spec_verify_ct``: the
  engine-wide ``avg_accept_length`` of /server_info for one request. SGLang divides
  ``completion_tokens`` by ``spec_verify_ct``, the same where every decode step verifies a
  draft; here a step may decode without a draft (an n-gram lookup that found nothing), and
  that token does not count as accepted.

Both rates are 0.0 before the first verify step.
"""

from __future__ import annotations

from typing import Any


def spec_meta_info(verify_ct: int, accepted: int, num_draft_tokens: int) -> dict[str, Any]:
    """The ``meta_info`` fields for a request with ``verify_ct`` verify steps and ``accepted``
    accepted draft tokens, drafting up to ``num_draft_tokens`` per step."""
    drafts = verify_ct * num_draft_tokens
    return {
        "spec_verify_ct": verify_ct,
        "spec_accepted_tokens": accepted,
        "spec_accept_token_num": accepted,
        "spec_draft_token_num": drafts,
        "spec_accept_rate": accepted / drafts if drafts else 0.0,
        "spec_accept_length": (verify_ct + accepted) / verify_ct if verify_ct else 0.0,
    }


def num_draft_tokens(spec_stats: dict[str, Any] | None) -> int | None:
    """Draft tokens per request and step from ``EngineCore.spec_stats()``; None when
    speculation is off."""
    if spec_stats is None:
        return None
    return int(spec_stats["num_draft_tokens"])
