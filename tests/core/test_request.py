"""core/request.py: sampling params' checks, finish reasons, Req's state, token_slice."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.core.request import (
    INT64_MAX,
    SEED_MAX,
    FinishReason,
    InvalidRequest,
    Req,
    ReqState,
    SamplingParams,
    token_slice,
)


def _refused(values: dict[str, Any], vocab_size: int | None = None) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        if vocab_size is None:
            SamplingParams.from_dict(values)
        else:
            SamplingParams.from_dict(values).validate(vocab_size)
    return err.value


def test_the_defaults_are_sglangs() -> None:
    p = SamplingParams.from_dict(None)
    assert p == SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.n, p.top_logprobs_num) == (128, 0, 1, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.stop_regex, p.logit_bias) == ([], [], [], None)
    assert (p.ignore_eos, p.skip_special_tokens, p.no_stop_trim, p.logprobs) == (
        False,
        True,
        False,
        False,
    )
    assert p.seed is None
    assert (p.json_schema, p.regex, p.ebnf, p.structural_tag, p.grammar) == (None,) * 5
    assert not p.is_greedy
    # each instance has its own lists
    p.stop.append("x")
    assert SamplingParams().stop == []


def test_from_dict_reads_values_aliases_and_nulls() -> None:
    p = SamplingParams.from_dict(
        {"max_new_tokens": 7, "temperature": None, "sampling_seed": 3, "stop": "end"}
    )
    assert (p.max_new_tokens, p.temperature, p.seed, p.stop) == (7, 1.0, 3, ["end"])
    assert SamplingParams.from_dict({"stop_regex": "a+"}).stop_regex == ["a+"]
    assert SamplingParams.from_dict({"stop": ["a", "b"]}).stop == ["a", "b"]
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_a_schema_given_as_an_object_becomes_its_json_text() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = SamplingParams.from_dict({"json_schema": schema})
    assert p.json_schema == json.dumps(schema)
    assert p.grammar == ("json_schema", json.dumps(schema))
    # a dict for a field that is no grammar is refused, not turned into text
    assert str(_refused({"stop": {"a": 1}})).startswith("stop must be")


def test_from_dict_refuses_what_is_not_a_params_object() -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_dict([1])  # type: ignore[arg-type]
    assert str(err.value) == "sampling_params must be an object, got list"
    assert str(_refused({"beam": 2})) == "unknown sampling parameter 'beam'"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 0, got -1"),
        ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer, got 1.5"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer, got True"),
        (
            {"max_new_tokens": INT64_MAX + 1},
            f"max_new_tokens must be <= {INT64_MAX}, got {INT64_MAX + 1}",
        ),
        ({"min_new_tokens": -1}, "min_new_tokens must be >= 0, got -1"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"top_logprobs_num": -1}, "top_logprobs_num must be >= 0, got -1"),
        ({"top_k": -2}, "top_k must be >= -1, got -2"),
        ({"top_k": 0}, "top_k must be -1 (disabled) or >= 1, got 0"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false, got 1"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens must be true or false, got 'no'"),
        ({"no_stop_trim": 0}, "no_stop_trim must be true or false, got 0"),
        ({"logprobs": "yes"}, "logprobs must be true or false, got 'yes'"),
        ({"temperature": -0.5}, "temperature must be in [0.0, inf], got -0.5"),
        ({"temperature": "1"}, "temperature must be a number, got '1'"),
        ({"temperature": True}, "temperature must be a number, got True"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        (
            {"temperature": 10**400},
            "temperature must be a finite number, got " + repr(10**400)[:200],
        ),
        ({"min_p": 1.5}, "min_p must be in [0.0, 1.0], got 1.5"),
        ({"min_p": -0.1}, "min_p must be in [0.0, 1.0], got -0.1"),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2.0, 2.0], got 2.5"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2.0, 2.0], got -2.5"),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2.0, 2.0], got 3"),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2.0, 2.0], got -3"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
        ({"repetition_penalty": -1}, "repetition_penalty must be in [0.0, inf], got -1"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_p": 1.01}, "top_p must be in [0.0, 1.0], got 1.01"),
        (
            {"max_new_tokens": 2, "min_new_tokens": 3},
            "min_new_tokens (3) exceeds max_new_tokens (2)",
        ),
    ],
)
def test_each_bad_field_is_named_with_its_value(values: dict[str, Any], message: str) -> None:
    assert str(_refused(values)) == message


def test_the_value_shown_is_cut_at_200_characters() -> None:
    value = "x" * 500
    assert (
        str(_refused({"temperature": value}))
        == "temperature must be a number, got " + repr(value)[:200]
    )
    assert str(_refused({"n": value})) == "n must be an integer, got " + repr(value)[:200]


@pytest.mark.parametrize(
    "values",
    [
        {"max_new_tokens": 0, "min_new_tokens": 0},
        {"max_new_tokens": 5, "min_new_tokens": 5},
        {"max_new_tokens": INT64_MAX},
        {"n": 1, "top_k": -1, "top_logprobs_num": 0},
        {"top_k": 1},
        {"temperature": 0, "min_p": 1, "top_p": 1},
        {"min_p": 0},
        {"frequency_penalty": -2, "presence_penalty": 2},
        {"frequency_penalty": 2, "presence_penalty": -2},
        {"repetition_penalty": 1e-9},
        {"top_p": 1e-9},
        {"ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True, "logprobs": True},
    ],
)
def test_values_on_the_bounds_pass(values: dict[str, Any]) -> None:
    p = SamplingParams.from_dict(values)
    for key, value in values.items():
        assert getattr(p, key) == value


def test_numbers_become_floats() -> None:
    p = SamplingParams.from_dict(
        {
            "temperature": 2,
            "min_p": 0,
            "frequency_penalty": 1,
            "presence_penalty": -1,
            "repetition_penalty": 3,
            "top_p": 1,
        }
    )
    for name in (
        "temperature",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "top_p",
    ):
        assert type(getattr(p, name)) is float, name
    assert (p.temperature, p.frequency_penalty, p.presence_penalty) == (2.0, 1.0, -1.0)
    assert (p.repetition_penalty, p.top_p) == (3.0, 1.0)


def test_vocabulary_bounds() -> None:
    SamplingParams(top_logprobs_num=10, stop_token_ids=[9]).validate(10)
    err = _refused({"top_logprobs_num": 11}, vocab_size=10)
    assert str(err) == "top_logprobs_num must be <= the vocabulary size 10, got 11"
    assert (
        str(_refused({"stop_token_ids": [3, 10]}, 10)) == "stop_token_ids must be < vocab size 10"
    )
    # without a vocabulary only the type and sign are checked
    SamplingParams(top_logprobs_num=10**6, stop_token_ids=[10**6]).validate()


@pytest.mark.parametrize(
    "stop",
    [[""], ["a", ""], [1], "", 5, ["a", None]],
)
def test_stop_strings_must_be_non_empty_strings(stop: Any) -> None:
    err = SamplingParams(stop=stop)
    with pytest.raises(InvalidRequest) as e:
        err.validate()
    assert str(e.value) == "stop must be a non-empty string or a list of non-empty strings"


def test_lone_surrogates_are_refused_where_text_is_sent() -> None:
    assert str(_refused({"stop": ["ok", "a\ud800"]})) == (
        "stop contains a lone surrogate at character 1; send valid Unicode text"
    )
    assert str(_refused({"regex": "ab\udfff"})) == (
        "regex contains a lone surrogate at character 2; send valid Unicode text"
    )
    assert str(_refused({"stop_regex": ["\ud800"]})).startswith("stop_regex contains a lone")


@pytest.mark.parametrize("ids", [[-1], [True], [1.0], [INT64_MAX + 1], "1", [1, "2"]])
def test_stop_token_ids_must_be_token_ids(ids: Any) -> None:
    assert str(_refused({"stop_token_ids": ids})) == (
        "stop_token_ids must be a list of non-negative token ids"
    )


def test_stop_token_ids_on_the_bounds_pass() -> None:
    assert SamplingParams.from_dict({"stop_token_ids": [0, INT64_MAX]}).stop_token_ids == [
        0,
        INT64_MAX,
    ]


@pytest.mark.parametrize("patterns", [[""], [3], 3, ["a", ""]])
def test_stop_regex_must_be_non_empty_strings(patterns: Any) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(stop_regex=patterns).validate()
    assert str(err.value) == "stop_regex must be a non-empty string or a list of non-empty strings"
    assert err.value.param == "stop_regex"


@pytest.mark.parametrize("pattern", ["a(", "(?P<x>a)(?P<x>b)", "a{2,1}", "[z-a]"])
def test_stop_regex_must_compile(pattern: str) -> None:
    err = _refused({"stop_regex": ["ok", pattern]})
    assert str(err).startswith(f"stop_regex {pattern!r} is not a valid regular expression: ")
    assert len(str(err)) > len(f"stop_regex {pattern!r} is not a valid regular expression: ")
    assert err.param == "stop_regex"
    # only the first 80 characters of a long pattern are quoted
    long = "b" * 100 + "("
    assert str(_refused({"stop_regex": long})).startswith(f"stop_regex {long[:80]!r} is not")


def test_a_pattern_only_the_regex_module_refuses_is_refused() -> None:
    # valid for re, but the ``regex`` module the stop checker searches with rejects it
    pattern = r"\p"
    err = _refused({"stop_regex": [pattern]})
    assert err.param == "stop_regex"


def test_logit_bias_keys_are_made_canonical_and_values_floats() -> None:
    p = SamplingParams.from_dict({"logit_bias": {"01": 5, "2": -100, 3: 100}})
    assert p.logit_bias == {"1": 5.0, "2": -100.0, "3": 100.0}
    assert all(type(v) is float for v in p.logit_bias.values())
    # on a clash the later entry wins
    assert SamplingParams.from_dict({"logit_bias": {"1": 1, "001": 2}}).logit_bias == {"1": 2.0}
    p = SamplingParams(logit_bias={"9": 1.0, "0": 0.5})
    p.validate(10)
    assert p.logit_bias == {"9": 1.0, "0": 0.5}
    assert SamplingParams.from_dict({"logit_bias": {}}).logit_bias == {}


@pytest.mark.parametrize(
    ("bias", "vocab", "message"),
    [
        ([1], None, "logit_bias must be an object mapping token ids to biases, got [1]"),
        ({"-1": 1}, None, "logit_bias keys must be token ids non-negative, got '-1'"),
        ({-1: 1}, None, "logit_bias keys must be token ids non-negative, got -1"),
        ({"a": 1}, None, "logit_bias keys must be token ids non-negative, got 'a'"),
        ({"1.0": 1}, None, "logit_bias keys must be token ids non-negative, got '1.0'"),
        ({"1" * 20: 1}, None, f"logit_bias keys must be token ids non-negative, got {'1' * 20!r}"),
        ({True: 1}, None, "logit_bias keys must be token ids non-negative, got True"),
        ({"10": 1}, 10, "logit_bias keys must be token ids [0, 10), got '10'"),
        ({"-1": 1}, 10, "logit_bias keys must be token ids [0, 10), got '-1'"),
        ({"3": 101}, None, "logit_bias[3] must be in [-100.0, 100.0], got 101"),
        ({"03": -101}, None, "logit_bias[3] must be in [-100.0, 100.0], got -101"),
        ({"3": "1"}, None, "logit_bias[3] must be a number, got '1'"),
    ],
)
def test_bad_logit_bias(bias: Any, vocab: int | None, message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(logit_bias=bias).validate(vocab)
    assert str(err.value) == message
    assert err.value.param == "logit_bias"


def test_a_nineteen_digit_key_is_a_token_id() -> None:
    key = "1" * 19
    assert SamplingParams.from_dict({"logit_bias": {key: 1}}).logit_bias == {key: 1.0}
    assert SamplingParams.from_dict({"logit_bias": {"-0": 1}}).logit_bias == {"0": 1.0}


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        (True, "seed must be an integer, got True"),
        (1.0, "seed must be an integer, got 1.0"),
        ("1", "seed must be an integer, got '1'"),
        (-1, "seed must be an integer in [0, 2**64), got -1"),
        (SEED_MAX + 1, f"seed must be an integer in [0, 2**64), got {SEED_MAX + 1}"),
    ],
)
def test_bad_seeds(seed: Any, message: str) -> None:
    assert str(_refused({"seed": seed})) == message


def test_seeds_on_the_bounds_pass() -> None:
    assert SamplingParams.from_dict({"seed": 0}).seed == 0
    assert SamplingParams.from_dict({"seed": SEED_MAX}).seed == SEED_MAX


@pytest.mark.parametrize("name", ["json_schema", "regex", "ebnf", "structural_tag"])
def test_a_grammar_must_be_a_non_empty_string(name: str) -> None:
    for bad in ("", 3):
        assert str(_refused({name: bad})) == f"{name} must be a non-empty string, got {bad!r}"
    p = SamplingParams.from_dict({name: "x"})
    assert p.grammar == (name, "x")


@pytest.mark.parametrize("name", ["json_schema", "ebnf", "structural_tag"])
def test_only_a_regex_may_be_blank(name: str) -> None:
    assert str(_refused({name: " \n"})) == f"{name} must be a non-empty string, got ' \\n'"
    assert SamplingParams.from_dict({"regex": " "}).grammar == ("regex", " ")
    assert SamplingParams.from_dict({"regex": "\n"}).grammar == ("regex", "\n")


def test_at_most_one_grammar() -> None:
    assert str(_refused({"regex": "a", "ebnf": "root ::= 'a'"})) == (
        "give at most one of json_schema, regex, ebnf, structural_tag; got regex, ebnf"
    )
    assert SamplingParams.from_dict({"ebnf": "root ::= 'a'"}).grammar == ("ebnf", "root ::= 'a'")


def test_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.5, top_k=2).is_greedy


def test_invalid_request_carries_its_param() -> None:
    err = InvalidRequest("bad", param="x")
    assert (str(err), err.param) == ("bad", "x")
    assert InvalidRequest("bad").param is None
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (FinishReason("stop", matched=7), {"type": "stop", "matched": 7}),
        (FinishReason("stop", matched="</s>"), {"type": "stop", "matched": "</s>"}),
        (FinishReason("stop"), {"type": "stop", "matched": None}),
        (FinishReason("length", length=12), {"type": "length", "length": 12}),
        (FinishReason("abort", message="gone"), {"type": "abort", "message": "gone"}),
        (FinishReason("abort"), {"type": "abort", "message": None}),
        (FinishReason("other", matched=1, length=2, message="m"), {"type": "other"}),
    ],
)
def test_finish_reason_json(reason: FinishReason, expected: dict[str, Any]) -> None:
    assert reason.to_json() == expected


def test_a_new_request() -> None:
    params = SamplingParams()
    req = Req("r1", [1, 2, 3], params, extra_key="k")
    assert (req.rid, req.input_ids, req.sampling, req.extra_key) == ("r1", [1, 2, 3], params, "k")
    assert Req("r", [1], params).extra_key is None
    assert req.state is ReqState.WAITING and not req.finished
    assert (req.lora_name, req.lora, req.mm_inputs, req.finish_reason) == (None,) * 4
    assert (req.output_ids, req.req_pool_idx, req.kv_len, req.cached_tokens) == ([], None, 0, 0)
    assert (req.prefix_len, req.cache_node, req.num_retractions) == (0, None, 0)
    assert (req.num_pending, req.pending_row) == (0, -1)
    assert (req.spec_verify_ct, req.spec_accepted_tokens, req.spec_draft_tokens) == (0, 0, 0)
    assert (req.bootstrap, req.asked_max_new_tokens, req.failed) == (None, None, None)
    assert (req.priority, req.arrival_step, req.session_params, req.context_tokens) == (
        0,
        -1,
        None,
        0,
    )
    assert req.arrival_time > 0
    assert (req.first_token_time, req.finish_time) == (None, None)
    assert (req.logprob_start_len, req.return_text_in_logprobs, req.refused) == (-1, False, False)
    assert (req.input_token_logprobs, req.input_top_logprobs) == ([], [])
    assert (req.output_logprobs, req.output_top_logprobs) == ([], [])
    assert (req.detok, req.bias_entries, req.grammar, req.pooling) == (None,) * 4
    assert (req.label_token_ids, req.embedding, req.label_logprobs, req.pooled_sum) == (None,) * 4
    assert repr(req) == "Req(r1, waiting, in=3, out=0)"


def test_lengths_count_pending_tokens() -> None:
    req = Req("r", [1, 2, 3], SamplingParams())
    req.output_ids = [4, 5]
    assert req.fill_ids() == [1, 2, 3, 4, 5]
    assert req.input_ids == [1, 2, 3]  # fill_ids does not extend the prompt
    assert (req.seq_len, req.num_output_tokens) == (5, 2)
    req.num_pending = 1
    assert (req.seq_len, req.num_output_tokens) == (6, 3)
    assert req.fill_ids() == [1, 2, 3, 4, 5]
    req.state = ReqState.DECODE
    assert repr(req) == "Req(r, decode, in=3, out=2)"


@pytest.mark.parametrize(
    ("reason", "state"),
    [
        (FinishReason("stop", matched=2), ReqState.FINISHED),
        (FinishReason("length", length=3), ReqState.FINISHED),
        (FinishReason("abort", message="x"), ReqState.ABORTED),
    ],
)
def test_finish(reason: FinishReason, state: ReqState) -> None:
    req = Req("r", [1], SamplingParams())
    before = req.arrival_time
    req.finish(reason)
    assert req.finish_reason is reason
    assert req.state is state
    assert req.finished
    assert req.finish_time is not None and req.finish_time >= before


@pytest.mark.parametrize("state", list(ReqState))
def test_finished_states(state: ReqState) -> None:
    req = Req("r", [1], SamplingParams())
    req.state = state
    assert req.finished == (state in (ReqState.FINISHED, ReqState.ABORTED))


@pytest.mark.parametrize(
    ("change", "overlappable"),
    [
        ({}, True),
        ({"grammar": object()}, False),
        ({"logprobs": True}, False),
        ({"logprob_start_len": 0}, False),
        ({"logprob_start_len": 5}, False),
        ({"frequency_penalty": 0.5}, False),
        ({"presence_penalty": -0.5}, False),
        ({"repetition_penalty": 1.1}, False),
        ({"repetition_penalty": 0.9}, False),
        ({"temperature": 0.0, "top_k": 5, "stop": ["x"], "seed": 1}, True),
    ],
)
def test_overlappable(change: dict[str, Any], overlappable: bool) -> None:
    req = Req("r", [1], SamplingParams())
    for key, value in change.items():
        setattr(req if hasattr(req, key) else req.sampling, key, value)
    assert req.overlappable is overlappable


@pytest.mark.parametrize(
    ("start", "n", "expected"),
    [
        (0, 2, [10, 11]),
        (0, 3, [10, 11, 12]),  # the whole prompt
        (1, 3, [11, 12, 20]),  # across the boundary
        (2, 1, [12]),
        (2, 2, [12, 20]),
        (3, 1, [20]),  # starts at the output
        (4, 2, [21, 22]),
        (0, 6, [10, 11, 12, 20, 21, 22]),
        (0, 9, [10, 11, 12, 20, 21, 22]),
        (5, 4, [22]),
        (6, 1, []),
        (1, 0, []),
    ],
)
def test_token_slice(start: int, n: int, expected: list[int]) -> None:
    prompt, output = [10, 11, 12], [20, 21, 22]
    assert token_slice(prompt, output, start, n) == expected
    assert token_slice(prompt, output, start, n) == (prompt + output)[start : start + n]
