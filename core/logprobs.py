"""Input-token logprobs: the model's logprob of each prompt token given the tokens before it.

``logprob_start_len`` follows SGLang: -1 means output tokens only, k >= 0 scores prompt tokens
from position k (position 0 has no logprob: nothing predicts it). Positions already recorded are
never recorded twice, so chunked prefill and retraction are safe.
"""

from __future__ import annotations

import torch

from radixserve.core.request import Req


def first_scored_position(req: Req) -> int | None:
    """The earliest sequence position whose logits the request still needs, or None."""
    if req.logprob_start_len < 0:
        return None
    lo = max(req.logprob_start_len, 1) - 1 + len(req.input_token_logprobs)
    return lo if lo < len(req.input_ids) - 1 else None


def scored_positions(req: Req, chunk_start: int, chunk_len: int) -> range:
    """Positions p in this chunk whose logits score prompt token p + 1."""
    lo = first_scored_position(req)
    if lo is None:
        return range(0)
    return range(max(lo, chunk_start), min(len(req.input_ids) - 1, chunk_start + chunk_len))


def record_input_logprobs(req: Req, positions: range, logits: torch.Tensor) -> None:
    """Append the logprobs of prompt tokens positions+1 from their logits rows."""
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(req.input_ids[positions.start + 1 : positions.stop + 1])
    chosen = logprobs.gather(1, targets.to(logprobs.device).unsqueeze(1)).squeeze(1).tolist()
    req.input_token_logprobs.extend(chosen)
    k = req.sampling.top_logprobs_num
    if k:
        vals, ids = logprobs.topk(k, dim=-1)
        req.input_top_logprobs.extend(
            list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), ids.tolist(), strict=True)
        )
