"""Constrained decoding through the offline Engine on a tiny random model, for each grammar
backend: outputs match, bad grammars end only their request, dead ends abort, jump-forward
changes the step count but not the output."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixserve import Engine
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Grammar, GrammarBackend
from radixserve.core.plugins import PluginHost

BACKENDS = ["xgrammar", "outlines", "llguidance"]
FORCED_REGEX = r"[a-f]@@@@[0-9]%%%%[a-f]{2}"
ENUM_SCHEMA = {
    "type": "object",
    "properties": {
        "a_rather_long_property_name": {"enum": ["first", "second"]},
        "another_fixed_key": {"type": "boolean"},
        "yet_one_more": {"enum": [1, 2, 3]},
    },
    "required": ["a_rather_long_property_name", "another_fixed_key", "yet_one_more"],
}


@pytest.fixture(scope="module", params=BACKENDS)
def engines(request: pytest.FixtureRequest, tiny_llama_dir: Path):
    """(engine with jump-forward, engine without) for one backend."""
    settings: dict[str, Any] = {"plugins": [f"grammar={request.param}"], "max_total_tokens": 4096}
    with Engine(str(tiny_llama_dir), **settings) as jf:
        with Engine(str(tiny_llama_dir), disable_jump_forward=True, **settings) as plain:
            yield jf, plain


def concurrently(engine: Engine, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Submit every (prompt, sampling params) at once so they share batches."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(engine.generate, p, params) for p, params in calls]
        return [f.result() for f in futures]


def test_regex_outputs_fullmatch(engines: tuple[Engine, Engine]) -> None:
    engine = engines[0]
    regex = r"(cat|dog)s? [0-9]{2,3}(, [a-z]{1,4}){1,2}\."
    prompts = ["The quick brown fox", "Hello world", "def add(a, b):", "0123"]
    outs = engine.generate(prompts, {"regex": regex, "max_new_tokens": 40, "temperature": 1.0})
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(regex, out["text"]), out["text"]
    engine.core.scheduler.check_no_leak()


def test_bad_schema_ends_only_its_request(engines: tuple[Engine, Engine]) -> None:
    engine = engines[0]
    good = {"regex": "[0-9]{3}", "max_new_tokens": 8, "temperature": 0}
    bad = {"json_schema": '{"type": "object", "properties": {"x": {"type": "strin"}}}'}
    outs = concurrently(engine, [("Hello", good), ("Hello", bad), ("The quick", good)])
    reason = outs[1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "strin" in reason["message"]
    assert reason["message"].startswith("json_schema rejected by grammar backend")
    assert outs[1]["output_ids"] == []
    for out in (outs[0], outs[2]):
        assert re.fullmatch("[0-9]{3}", out["text"]), out
    engine.core.scheduler.check_no_leak()


def test_dead_end_aborts_with_a_message(engines: tuple[Engine, Engine]) -> None:
    engine = engines[0]
    out = engine.generate("Hello", {"regex": "ab", "min_new_tokens": 5, "temperature": 0})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", out
    assert "grammar dead end after 2 output tokens" in reason["message"]
    assert "min_new_tokens" in reason["message"]
    assert out["text"] == "ab"  # what was produced is kept, never "repaired"
    engine.core.scheduler.check_no_leak()


def steps_and_output(engine: Engine, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    before = engine.core.scheduler.stats.steps
    out = engine.generate("The quick brown fox", {"temperature": 0, **params})
    return engine.core.scheduler.stats.steps - before, out


def test_jump_forward_same_greedy_output_in_fewer_steps(engines: tuple[Engine, Engine]) -> None:
    jf, plain = engines
    params = {"regex": FORCED_REGEX, "max_new_tokens": 32}
    jf_steps, jf_out = steps_and_output(jf, params)
    plain_steps, plain_out = steps_and_output(plain, params)
    assert re.fullmatch(FORCED_REGEX, jf_out["text"]), jf_out
    assert jf_out["output_ids"] == plain_out["output_ids"]
    assert plain_steps == len(plain_out["output_ids"])  # one step per token without it
    assert jf_steps <= plain_steps - 6  # "@@@" and "%%%" were appended without sampling


def test_jump_forward_over_json_keys(engines: tuple[Engine, Engine]) -> None:
    jf, plain = engines
    params = {"json_schema": json.dumps(ENUM_SCHEMA), "max_new_tokens": 160}
    jf_steps, jf_out = steps_and_output(jf, params)
    plain_steps, plain_out = steps_and_output(plain, params)
    for out in (jf_out, plain_out):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), ENUM_SCHEMA)
    assert jf_steps < len(jf_out["output_ids"]) / 2
    assert jf_steps < plain_steps


def test_logprobs_come_from_the_unmasked_model(engines: tuple[Engine, Engine]) -> None:
    engine = engines[0]
    out = engine.generate(
        "Hello",
        {"regex": FORCED_REGEX, "max_new_tokens": 32, "temperature": 0},
        return_logprob=True,
    )
    assert re.fullmatch(FORCED_REGEX, out["text"])
    logprobs = out["meta_info"]["output_token_logprobs"]
    assert len(logprobs) == len(out["output_ids"])  # logprob requests are not jumped forward
    # Masking forces "@" tokens the random model does not favour: their logprob is the model's.
    assert min(lp for lp, _, _ in logprobs) < -0.5


def test_n_samples_each_follow_the_grammar(engines: tuple[Engine, Engine]) -> None:
    engine = engines[0]
    params = {"regex": "(yes|no|maybe)!", "n": 4, "temperature": 1.5, "max_new_tokens": 8}
    outs = engine.generate("Answer:", params)
    assert len(outs) == 4
    assert all(re.fullmatch("(yes|no|maybe)!", o["text"]) for o in outs), outs


def test_none_backend_refuses_clearly(tiny_llama_dir: Path) -> None:
    with Engine(str(tiny_llama_dir), grammar_backend="none", max_total_tokens=1024) as engine:
        out = engine.generate("Hello", {"regex": "a+", "max_new_tokens": 4})
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "needs a grammar backend" in reason["message"]


class _SlowBackend(GrammarBackend):
    release = threading.Event()

    def compile(self, kind: str, spec: str) -> Grammar:
        self.release.wait(30)
        raise ValueError("released")


class _SlowPlugin:
    @hookimpl
    def register_grammar_backends(self, register: Any) -> None:
        register("slow", lambda tokenizer, vocab_size, stop_ids: _SlowBackend())


def test_compile_timeout_ends_the_request_not_the_engine(tiny_llama_dir: Path) -> None:
    host = PluginHost(extra_plugins=[("slow_grammar", _SlowPlugin())])
    settings: dict[str, Any] = {"grammar_compile_timeout": 0.3, "max_total_tokens": 1024}
    with Engine(str(tiny_llama_dir), host=host, grammar_backend="slow", **settings) as engine:
        plain = {"max_new_tokens": 20, "ignore_eos": True}
        outs = concurrently(engine, [("Hello", {"regex": "a+"}), ("Hello", plain)])
        reason = outs[0]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert "regex did not compile within grammar_compile_timeout=0.3s" in reason["message"]
        assert len(outs[1]["output_ids"]) == 20
        _SlowBackend.release.set()
