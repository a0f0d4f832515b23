"""How one generate call fans out into engine requests, shared by the HTTP server and the
offline Engine so both give the same answers: one value per input of a batch, and the params of
each of a prompt's ``n`` choices."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from radixserve.core.request import InvalidRequest, SamplingParams


def nullish(value: Any) -> Any:
    # Some SGLang client versions send [null] for the logprob fields: that means null.
    return None if value == [None] else value


def per_item(value: Any, count: int, name: str) -> list[Any]:
    """One value per input: a list must match the batch (or hold one value for all); anything
    else applies to every input."""
    value = nullish(value)
    if isinstance(value, list):
        if len(value) == count:
            return [nullish(v) for v in value]
        if len(value) == 1:
            return [nullish(value[0])] * count
        raise InvalidRequest(f"{name} has {len(value)} entries for a batch of {count} inputs")
    return [value] * count


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice ``index`` (its own copy, n=1): seeded choices get distinct seeds
    (seed + index, wrapping within 64 bits), or all n would be identical."""
    seed = (params.seed + index) % 2**64 if params.seed is not None else None
    stop, stop_ids = list(params.stop), list(params.stop_token_ids)
    return replace(params, stop=stop, stop_token_ids=stop_ids, seed=seed, n=1)
