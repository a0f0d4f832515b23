"""Whether a request can ever be served: one check, run by the server's TokenizerManager (in
the HTTP process, so a bad request is refused before it is queued) and by EngineCore (for the
offline Engine, and again in the engine process). Both give the same messages."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from radixserve.core.request import POOLING_METHODS, InvalidRequest, SamplingParams


class ServingLimits(NamedTuple):
    """What a model served here can take."""

    vocab_size: int
    max_context: int  # tokens: prompt and output together
    kv_tokens: int  # token slots in the KV pool
    #: the seed of requests that give none (--enable-deterministic-inference); None: unseeded
    default_seed: int | None = None


def check_request(
    ids: Sequence[int],
    params: SamplingParams,
    limits: ServingLimits,
    *,
    pooling: str | None = None,
    label_token_ids: Sequence[int] | None = None,
    max_field: str | None = None,
) -> None:
    """Raise InvalidRequest naming the first thing that keeps this request from ever being
    served. With ``max_field`` (the output budget's name as the client sent it) the prompt and
    that budget must fit the context; without it a budget past the context ends with "length".
    ``params`` is normalized in place (see SamplingParams.validate)."""
    check_prompt(ids, limits)
    n, vocab = len(ids), limits.vocab_size
    if max_field is not None and n + params.max_new_tokens > limits.max_context:
        raise InvalidRequest(
            f"{max_field}={params.max_new_tokens} plus the prompt's {n} tokens exceeds "
            f"this model's context length of {limits.max_context} tokens"
        )
    params.validate(vocab)
    if params.seed is None and limits.default_seed is not None:
        params.seed = limits.default_seed
    if pooling is not None and pooling not in POOLING_METHODS:
        raise InvalidRequest(f"pooling must be one of {POOLING_METHODS}, got {pooling!r}")
    if label_token_ids is not None and (
        not label_token_ids or any(not 0 <= t < vocab for t in label_token_ids)
    ):
        raise InvalidRequest(f"label_token_ids must be token ids in [0, {vocab})")


def check_prompt(ids: Sequence[int], limits: ServingLimits) -> None:
    """Raise InvalidRequest when the prompt is empty, holds a token outside the vocabulary or
    leaves no room for an output token in the context or the KV pool."""
    n = len(ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty; send at least one token")
    check_context(n, limits.max_context)  # before the O(n) scan below: refused at once
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    if n >= limits.kv_tokens:
        raise InvalidRequest(f"the prompt has {n} tokens; the KV pool holds {limits.kv_tokens}")


def check_context(num_tokens: int, max_context: int) -> None:
    """Raise InvalidRequest when a prompt of ``num_tokens`` leaves no room for an output token
    in the context (checked alone where a prompt is measured before it is built)."""
    if num_tokens >= max_context:
        raise InvalidRequest(
            f"the prompt has {num_tokens} tokens; this model's context length is {max_context}"
        )


def fit_output_budget(params: SamplingParams, prompt_len: int, kv_tokens: int) -> SamplingParams:
    """``params`` with the output budget cut to what the KV pool holds beside the prompt (as
    SGLang: the request then ends with "length" there, not with an abort after filling the pool
    and retracting everyone else once it runs alone); ``params`` itself when it fits."""
    room = kv_tokens - prompt_len
    if params.max_new_tokens <= room:
        return params
    return dataclasses.replace(
        params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room)
    )
