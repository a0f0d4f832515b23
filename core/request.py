"""Req, SamplingParams, finish reasons and the request state machine.

States: WAITING -> PREFILL (possibly over several chunks) -> DECODE -> FINISHED | ABORTED,
and RETRACTED back to WAITING under KV pressure (its tokens are recomputed later).
"""

from __future__ import annotations

import enum
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import regex

from radixserve.core.interfaces import GRAMMAR_KINDS as GRAMMAR_FIELDS

#: How an embedding request pools hidden states (here, not in core.pooling, so that flag
#: parsing does not import torch): SGLang pools a causal model's embedding from its last token
#: (``Pooler(LAST)``); mean pooling averages every prompt token instead.
POOLING_METHODS = ("last", "mean")

INT64_MAX = 2**63 - 1
#: Seeds are any unsigned 64-bit integer; the sampler folds them to 63 bits.
SEED_MAX = 2**64 - 1
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "no_stop_trim", "logprobs")


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the field and the bad value, ``param``
    (when set) the field, for the OpenAI error object."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ReqState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True)
class FinishReason:
    """Why a request ended: stop (with the matched token id or string), length or abort."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        elif self.type == "abort":
            out["message"] = self.message
        return out


@dataclass(slots=True)
class SamplingParams:
    """SGLang's sampling parameters. ``None`` in an incoming dict means the default."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Regexes (Python ``re`` syntax): generation stops once the output text matches one; the
    # match is kept in the output, as SGLang's server does.
    stop_regex: list[str] = field(default_factory=list)
    # Token id (a decimal string, as JSON keys are) -> bias in [-100, 100], added to the logits
    # before temperature, top-k/top-p and greedy choice.
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: bool = False
    top_logprobs_num: int = 0
    # Constrained decoding (at most one): a JSON schema, a regex the whole output must match, an
    # EBNF grammar (llama.cpp GBNF syntax, root rule ``root``) or an xgrammar structural tag.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> SamplingParams:
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise InvalidRequest(f"sampling_params must be an object, got {type(values).__name__}")
        known = cls.__dataclass_fields__
        params = cls()
        for key, value in values.items():
            if key == "sampling_seed":
                key = "seed"
            if key not in known:
                raise InvalidRequest(f"unknown sampling parameter '{key}'")
            if value is None:
                continue
            if key in GRAMMAR_FIELDS and isinstance(value, dict):
                value = json.dumps(value)  # a schema given as an object
            setattr(params, key, value)
        if isinstance(params.stop, str):
            params.stop = [params.stop]
        if isinstance(params.stop_regex, str):
            params.stop_regex = [params.stop_regex]
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the first bad field. Every field is checked for type
        (booleans strictly bool, integers strictly int), range and, where ``vocab_size`` is
        given, against the vocabulary, so nothing that passes can fail in the engine; numeric
        fields are normalized to float."""
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        _check_int("min_new_tokens", self.min_new_tokens, 0)
        _check_int("n", self.n, 1)
        _check_int("top_logprobs_num", self.top_logprobs_num, 0)
        if vocab_size is not None and self.top_logprobs_num > vocab_size:
            raise InvalidRequest(
                f"top_logprobs_num must be <= the vocabulary size {vocab_size}, "
                f"got {self.top_logprobs_num}"
            )
        # top_k past the vocabulary keeps every token (as -1 does); the sampler clamps it.
        _check_int("top_k", self.top_k, -1)
        if self.top_k == 0:
            raise InvalidRequest("top_k must be -1 (disabled) or >= 1, got 0")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidRequest(f"{name} must be true or false, got {value!r}")
        # Numbers become floats here, so the sampler never sees an integer past the float range.
        self.temperature = _check_float("temperature", self.temperature, 0.0, math.inf)
        self.min_p = _check_float("min_p", self.min_p, 0.0, 1.0)
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty, -2.0, 2.0
        )
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, 0.0, math.inf
        )
        if self.repetition_penalty == 0.0:
            raise InvalidRequest("repetition_penalty must be > 0, got 0")
        self.top_p = _check_float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequest("top_p must be in (0, 1], got 0")
        self._validate_stops_and_seed(vocab_size)
        self._validate_grammar()
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequest(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )

    def _validate_stops_and_seed(self, vocab_size: int | None) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a non-empty string or a list of non-empty strings")
        for stop in self.stop:
            _check_text("stop", stop)
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX
            for t in self.stop_token_ids
        ):
            raise InvalidRequest("stop_token_ids must be a list of non-negative token ids")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be < vocab size {vocab_size}")
        _check_stop_regex(self.stop_regex)
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias, vocab_size)
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                raise InvalidRequest(f"seed must be an integer, got {self.seed!r:.200}")
            if not 0 <= self.seed <= SEED_MAX:
                raise InvalidRequest(f"seed must be an integer in [0, 2**64), got {self.seed}")

    def _validate_grammar(self) -> None:
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        for name in given:
            value = getattr(self, name)
            # "" only: a regex of one space or newline is a grammar too
            if not isinstance(value, str) or not (value.strip() or name == "regex" and value):
                raise InvalidRequest(f"{name} must be a non-empty string, got {value!r:.200}")
            _check_text(name, value)
        if len(given) > 1:
            raise InvalidRequest(
                f"give at most one of {', '.join(GRAMMAR_FIELDS)}; got {', '.join(given)}"
            )

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, spec) of the request's constraint, or None when unconstrained."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _check_int(name: str, value: Any, minimum: int, maximum: int = INT64_MAX) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer, got {value!r:.200}")
    if value < minimum:
        raise InvalidRequest(f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise InvalidRequest(f"{name} must be <= {maximum}, got {value}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> float:
    """``value`` as a float, once it is a finite number in [lo, hi]."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a number, got {value!r:.200}")
    try:
        number = float(value)
    except OverflowError:  # an integer past the float range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r:.200}")
    if not lo <= number <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value!r:.200}")
    return number


def _check_stop_regex(patterns: Any) -> None:
    if not isinstance(patterns, list) or not all(isinstance(p, str) and p for p in patterns):
        raise InvalidRequest(
            "stop_regex must be a non-empty string or a list of non-empty strings",
            param="stop_regex",
        )
    for pattern in patterns:
        _check_text("stop_regex", pattern)
        try:
            re.compile(pattern)  # re's syntax; the stop checker searches it with ``regex``
            regex.compile(pattern)
        except (re.error, regex.error, RecursionError, OverflowError) as e:
            raise InvalidRequest(
                f"stop_regex {pattern[:80]!r} is not a valid regular expression: {e}",
                param="stop_regex",
            ) from None


def _check_logit_bias(bias: Any, vocab_size: int | None) -> dict[str, float]:
    """``bias`` with canonical keys ("01" -> "1"; on a clash the later entry wins) and float
    values, once every key is a token id in the vocabulary and every value in [-100, 100]."""
    if not isinstance(bias, dict):
        raise InvalidRequest(
            f"logit_bias must be an object mapping token ids to biases, got {bias!r:.100}",
            param="logit_bias",
        )
    out: dict[str, float] = {}
    for key, value in bias.items():
        token = _token_id_key(key)
        if token is None or token < 0 or (vocab_size is not None and token >= vocab_size):
            where = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
            raise InvalidRequest(
                f"logit_bias keys must be token ids {where}, got {key!r:.50}", param="logit_bias"
            )
        try:
            out[str(token)] = _check_float(f"logit_bias[{token}]", value, -100.0, 100.0)
        except InvalidRequest as e:
            raise InvalidRequest(str(e), param="logit_bias") from None
    return out


def _token_id_key(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]{1,19}", key):
        return int(key)
    return None


def _check_text(name: str, value: str) -> None:
    """Text the engine receives must be valid UTF-8: no lone surrogates."""
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{name} contains a lone surrogate at character {e.start}; send valid Unicode text"
        ) from None


class Req:
    """One generation request as the scheduler sees it (mutable identity state)."""

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling: SamplingParams,
        extra_key: str | None = None,
    ) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.sampling = sampling
        self.extra_key = extra_key
        self.lora_name: str | None = None  # the LoRA adapter asked for (None: the base model)
        self.lora: Any = None  # its core.lora.LoRAAdapter, once admitted
        self.mm_inputs: Any = None  # core.multimodal.MultimodalInputs: the prompt's images
        self.output_ids: list[int] = []
        self.state = ReqState.WAITING
        self.finish_reason: FinishReason | None = None
        # KV bookkeeping (owned by the scheduler)
        self.req_pool_idx: int | None = None
        self.kv_len = 0  # tokens of fill_ids whose KV is in the pool for this request
        self.cached_tokens = 0  # prompt tokens matched in the radix cache at first admission
        self.prefix_len = 0  # tokens of the current admission matched in the cache
        self.cache_node: Any = None  # locked radix node covering the shared prefix
        self.num_retractions = 0
        # Overlap scheduling: tokens sampled on the device but not yet appended to output_ids,
        # and the row of the newest one in its step's sampled ids (the next step's input).
        self.num_pending = 0
        self.pending_row = -1
        # Speculative decoding: verify steps this request took part in with a draft, and the
        # draft tokens the target accepted over them (meta_info's spec_verify_ct and
        # spec_accepted_tokens).
        self.spec_verify_ct = 0
        self.spec_accepted_tokens = 0
        self.spec_draft_tokens = 0  # draft tokens verified for it (the metrics' per group)
        self._init_outputs()
        # Prefill/decode disaggregation: where its KV comes from or goes to
        # (core.disaggregation.Bootstrap); None: the request runs whole here.
        self.bootstrap: Any = None
        # The client's max_new_tokens where the engine cut the budget (a PD prefill samples
        # only the first token): what a grammar's shortest output is checked against.
        self.asked_max_new_tokens: int | None = None
        # Why the engine failed this request (the server answers 500), once it has.
        self.failed: str | None = None
        # Priority scheduling (core/priority.py): larger runs first unless configured the
        # other way; the scheduler step it first arrived at (-1: not yet queued).
        self.priority = 0
        self.arrival_step = -1
        # core.sessions.SessionParams: the session this request continues, or None; the
        # tokens of the session's context put before the client's prompt.
        self.session_params: Any = None
        self.context_tokens = 0
        # timing
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def _init_outputs(self) -> None:
        # outputs
        self.logprob_start_len = -1  # >= 0: also score prompt tokens from this position
        self.input_token_logprobs: list[float] = []  # for prompt positions max(start, 1)..
        self.input_top_logprobs: list[list[tuple[float, int]]] = []
        self.return_text_in_logprobs = False
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.detok: Any = None  # IncrementalDetokenizer, created at the first output token
        # sampling.logit_bias as (token ids, biases), parsed at its first step (core/sampling.py)
        self.bias_entries: tuple[list[int], list[float]] | None = None
        self.grammar: Any = None  # the request's Grammar matcher (core.interfaces), once compiled
        self.refused = False  # ended before running because its input was bad (grammar compile)
        # Prefill-only outputs (max_new_tokens 0, see core/pooling.py): an embedding pooled
        # ("last" or "mean") from the final hidden states, or the logprobs of given label
        # tokens at the position after the prompt (/v1/score).
        self.pooling: str | None = None
        self.label_token_ids: list[int] | None = None
        self.embedding: list[float] | None = None
        self.label_logprobs: list[float] | None = None
        self.pooled_sum: Any = None  # mean pooling: the sum over the chunks prefilled so far

    def fill_ids(self) -> list[int]:
        """All tokens whose KV the request needs: prompt then output so far."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence, sampled ones not yet appended (``num_pending``) included."""
        return len(self.input_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def overlappable(self) -> bool:
        """Whether the next step may be scheduled before this request's sampled token reaches
        the host: nothing about its next step depends on that token's value on the host."""
        s = self.sampling
        return (
            self.grammar is None
            and not s.logprobs
            and self.logprob_start_len < 0
            and not s.frequency_penalty
            and not s.presence_penalty
            and s.repetition_penalty == 1.0
        )

    @property
    def finished(self) -> bool:
        return self.state in (ReqState.FINISHED, ReqState.ABORTED)

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.state = ReqState.ABORTED if reason.type == "abort" else ReqState.FINISHED
        self.finish_time = time.perf_counter()

    def __repr__(self) -> str:
        state, n_in, n_out = self.state.value, len(self.input_ids), len(self.output_ids)
        return f"Req({self.rid}, {state}, in={n_in}, out={n_out})"


def token_slice(prompt: list[int], output: list[int], start: int, n: int) -> list[int]:
    """Tokens [start, start+n) of prompt+output without concatenating the two lists."""
    p = len(prompt)
    if start >= p:
        return output[start - p : start - p + n]
    if start + n <= p:
        return prompt[start : start + n]
    return prompt[start:] + output[: start + n - p]
