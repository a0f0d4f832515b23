"""Speculative decoding statistics where SGLang users read them: ``meta_info`` of /generate
(streamed events too) and of the offline Engine, the ``speculative`` block of /server_info,
and /metrics. The HTTP tests share one speculating server (``spec_server``: the test drafter,
which always proposes a full draft, with pausing off so every step drafts); the
speculation-off checks use the shared ``server``.

Token accounting of one greedy request with ``ignore_eos`` and no stop (so nothing it emits
is cut): its first token comes from the prefill; each verify step emits the accepted drafts
plus the target's token (a + 1 tokens); a decode step without a draft emits 1. A request
drafts ``min(k, left - 1)`` tokens, so only with one token left does it decode without a
draft, hence

    completion_tokens == 1 + spec_verify_ct + spec_accepted_tokens + p,   p in {0, 1}

and with 0 <= a <= k per step, completion_tokens <= spec_verify_ct * (k + 1) + 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import radixserve_test_drafters
import requests
from hardening import metric
from radixserve_test_drafters import DRAFT_TOKENS, NAME, lookback_draft
from server_process import TINY_MODEL_NAME, RunningServer

from radixserve.core.plugins import PluginHost
from radixserve.entrypoints.engine import Engine

K = DRAFT_TOKENS
TIMEOUT = 60
GREEDY = {"temperature": 0, "ignore_eos": True}
SPEC_KEYS = {
    "spec_verify_ct", "spec_accepted_tokens", "spec_accept_token_num", "spec_draft_token_num",
    "spec_accept_rate", "spec_accept_length",
}  # fmt: skip
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def post(server: RunningServer, path: str, body: Any, **kw: Any) -> requests.Response:
    headers = server.headers
    return requests.post(server.url + path, json=body, headers=headers, timeout=TIMEOUT, **kw)


def server_info(server: RunningServer, path: str = "/server_info") -> dict[str, Any]:
    r = requests.get(server.url + path, headers=server.headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def generate(server: RunningServer, max_new_tokens: int, **body: Any) -> Any:
    params = {"max_new_tokens": max_new_tokens, **GREEDY}
    r = post(server, "/generate", {"text": PROMPT, "sampling_params": params, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_spec_meta(meta: dict[str, Any], final: bool = True) -> None:
    """The accounting of the module docstring, and the derived fields."""
    ct, acc, n = meta["spec_verify_ct"], meta["spec_accepted_tokens"], meta["completion_tokens"]
    assert 0 <= acc <= ct * K, meta
    assert n - (1 + ct + acc) in ((0, 1) if final else (0,)), meta
    assert n <= ct * (K + 1) + 2, meta
    assert meta["spec_accept_token_num"] == acc
    assert meta["spec_draft_token_num"] == ct * K
    assert meta["spec_accept_rate"] == pytest.approx(acc / (ct * K) if ct else 0.0)
    assert meta["spec_accept_length"] == pytest.approx((ct + acc) / ct if ct else 0.0)


def spec_block(server: RunningServer) -> dict[str, Any]:
    block = server_info(server)["speculative"]
    assert block is not None
    return block


# -- the test drafter itself ----------------------------------------------------------------


def test_lookback_draft() -> None:
    assert lookback_draft([1, 2, 3, 1], 2) == [2, 3]
    assert lookback_draft([1, 2, 1], 3) == [2, 1, 1]  # padded with its own last token
    assert lookback_draft([5, 6], 3) == [6, 6, 6]  # no earlier occurrence: the last, repeated
    assert lookback_draft([7, 1, 8, 1, 9, 1], 1) == [9]  # the latest occurrence


# -- /generate -----------------------------------------------------------------------------


def test_generate_meta_info_carries_spec_stats(spec_server: RunningServer) -> None:
    out = generate(spec_server, 48)
    meta = out["meta_info"]
    assert SPEC_KEYS <= set(meta)
    assert meta["completion_tokens"] == len(out["output_ids"]) == 48
    assert meta["spec_verify_ct"] >= 1
    check_spec_meta(meta)
    # a batch: every item its own counts
    batch = generate(spec_server, 24, text=[PROMPT, "def add(a, b):"])
    for item in batch:
        assert item["meta_info"]["spec_verify_ct"] >= 1
        check_spec_meta(item["meta_info"])


def test_the_drafter_gets_drafts_accepted(spec_server: RunningServer) -> None:
    """Greedy decoding of the tiny model cycles, and the lookback drafter then predicts it: the
    counts are not all zeros."""
    meta = generate(spec_server, 96)["meta_info"]
    check_spec_meta(meta)
    assert meta["spec_accepted_tokens"] >= 1
    assert meta["spec_accept_length"] > 1.0
    # accepted drafts save steps: fewer verify steps than tokens after the first
    assert meta["spec_verify_ct"] < meta["completion_tokens"] - 1


def test_streamed_events_carry_running_counts(spec_server: RunningServer) -> None:
    params = {"max_new_tokens": 40, **GREEDY}
    body = {"text": PROMPT, "sampling_params": params, "stream": True}
    r = post(spec_server, "/generate", body, stream=True)
    assert r.status_code == 200, r.text
    lines = [line.decode() for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    metas = [e["meta_info"] for e in events]
    for meta in metas[:-1]:
        assert SPEC_KEYS <= set(meta)
        check_spec_meta(meta, final=False)
    check_spec_meta(metas[-1])
    counts = [(m["spec_verify_ct"], m["spec_accepted_tokens"]) for m in metas]
    assert counts == sorted(counts)  # cumulative: never shrink
    assert metas[-1]["completion_tokens"] == 40 and metas[-1]["spec_verify_ct"] >= 1
    # the final event holds what the non-streaming response would
    assert {k: metas[-1][k] for k in SPEC_KEYS} == {
        k: generate(spec_server, 40)["meta_info"][k] for k in SPEC_KEYS
    }


# -- /server_info and /metrics -------------------------------------------------------------


def test_server_info_speculative_block_is_live(spec_server: RunningServer) -> None:
    before = spec_block(spec_server)
    assert before["algorithm"] == NAME
    assert before["num_draft_tokens"] == K
    meta = generate(spec_server, 32)["meta_info"]
    check_spec_meta(meta)
    for path in ("/server_info", "/get_server_info"):
        after = server_info(spec_server, path)["speculative"]
        # this request alone ran in between
        assert after["verified_requests"] - before["verified_requests"] == meta["spec_verify_ct"]
        assert after["verify_steps"] - before["verify_steps"] == meta["spec_verify_ct"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        assert accepted == meta["spec_accepted_tokens"]
        drafted = after["draft_tokens"] - before["draft_tokens"]
        assert accepted <= drafted <= meta["spec_draft_token_num"]
        v, a = after["verified_requests"], after["accepted_tokens"]
        assert after["avg_accept_length"] == pytest.approx((v + a) / v, abs=1e-4)
        assert after["simulated_accept_len"] is None
        states = server_info(spec_server, path)["internal_states"]
        assert states[0]["avg_spec_accept_length"] >= 1.0


def test_metrics_follow_the_engine(spec_server: RunningServer) -> None:
    generate(spec_server, 24)
    stats = spec_block(spec_server)
    expected = {
        "radixserve_spec_verify_steps_total": stats["verify_steps"],
        "radixserve_spec_verify_ct_total": stats["verified_requests"],
        "radixserve_spec_draft_tokens_total": stats["draft_tokens"],
        "radixserve_spec_accepted_tokens_total": stats["accepted_tokens"],
        # SGLang's gauges (sglang:spec_*), and ours: the counts behind them
        "sglang:spec_accept_length": pytest.approx(stats["avg_accept_length"], abs=1e-4),
        "sglang:spec_accept_rate": pytest.approx(stats["accepted_tokens"] / stats["draft_tokens"]),
    }
    assert stats["verify_steps"] >= 1
    for name, value in expected.items():
        assert metric(spec_server, name, model_name=TINY_MODEL_NAME) == value, name
    # counters go on counting across scrapes
    meta = generate(spec_server, 24)["meta_info"]
    grown = metric(spec_server, "radixserve_spec_verify_ct_total", model_name=TINY_MODEL_NAME)
    assert grown == stats["verified_requests"] + meta["spec_verify_ct"]


def test_metrics_per_workload_group(spec_server: RunningServer) -> None:
    """custom_labels' group keys the per-request accept-length histogram and the proposed and
    accepted draft counts, on /generate and the OpenAI routes alike."""
    metas = [
        generate(spec_server, n, custom_labels={"group": "json-x"})["meta_info"] for n in (16, 9)
    ]
    body = {"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "custom_labels": {"group": "chat-x"}}  # fmt: skip
    assert post(spec_server, "/v1/completions", body).status_code == 200

    def group(name: str, value: str) -> float:
        return metric(spec_server, name, model_name=TINY_MODEL_NAME, group=value)

    lengths = [
        (m["spec_verify_ct"] + m["spec_accepted_tokens"]) / m["spec_verify_ct"] for m in metas
    ]
    assert group("radixserve_spec_request_accept_length_count", "json-x") == 2
    assert group("radixserve_spec_request_accept_length_sum", "json-x") == pytest.approx(
        sum(lengths)
    )
    # the test drafter drafts K a verify, min(K, left - 1) in a request's last K verifies:
    # what was proposed really, against meta_info's spec_draft_token_num (verifies x K)
    full = sum(m["spec_draft_token_num"] for m in metas)
    drafted = group("radixserve_spec_request_draft_tokens_total", "json-x")
    assert full - len(metas) * K * K <= drafted < full
    accepted = sum(m["spec_accepted_tokens"] for m in metas)
    assert group("radixserve_spec_request_accepted_tokens_total", "json-x") == accepted
    assert group("radixserve_spec_request_accept_length_count", "chat-x") == 1
    assert group("radixserve_spec_request_draft_tokens_total", "chat-x") > 0
    # a request without a group counts under "default"; a malformed label is refused
    generate(spec_server, 8)
    assert group("radixserve_spec_request_accept_length_count", "default") >= 1
    bad = {"text": PROMPT, "custom_labels": {"group": 3}}
    assert post(spec_server, "/generate", bad).status_code == 400


# -- speculation off -----------------------------------------------------------------------


def test_speculation_off_adds_nothing(server: RunningServer) -> None:
    out = generate(server, 8)
    assert not [k for k in out["meta_info"] if k.startswith("spec_")]
    params = {"max_new_tokens": 4, **GREEDY}
    r = post(server, "/generate", {"text": PROMPT, "sampling_params": params, "stream": True})
    for line in [line.decode() for line in r.iter_lines() if line][:-1]:
        meta = json.loads(line.removeprefix("data: "))["meta_info"]
        assert not [k for k in meta if k.startswith("spec_")]
    assert server_info(server)["speculative"] is None
    text = requests.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert not [s for s in text.splitlines() if s.startswith(("radixserve_spec_", "sglang:spec_"))]


# -- the offline Engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    host = PluginHost(extra_plugins=[("radixserve_test_drafters", radixserve_test_drafters)])
    with Engine(
        str(tiny_llama_dir),
        host=host,
        speculative_algorithm=NAME,
        speculative_num_draft_tokens=K + 1,
        speculative_disable_pause=True,
        speculative_disable_batch_size=64,  # every request drafts (the CPU's cut-off is 2)
        max_total_tokens=4096,
    ) as engine:
        yield engine


def test_engine_results_carry_spec_stats(spec_engine: Engine) -> None:
    out = spec_engine.generate(PROMPT, {"max_new_tokens": 32, **GREEDY})
    meta = out["meta_info"]
    assert SPEC_KEYS <= set(meta) and meta["spec_verify_ct"] >= 1
    assert meta["completion_tokens"] == 32
    check_spec_meta(meta)
    stats = spec_engine.core.spec_stats()
    assert stats is not None and stats["verified_requests"] >= meta["spec_verify_ct"]


def test_engine_stream_carries_running_counts(spec_engine: Engine) -> None:
    chunks = list(spec_engine.generate(PROMPT, {"max_new_tokens": 24, **GREEDY}, stream=True))
    for chunk in chunks[:-1]:
        check_spec_meta(chunk["meta_info"], final=False)
    check_spec_meta(chunks[-1]["meta_info"])
    counts = [c["meta_info"]["spec_verify_ct"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] >= 1


def test_engine_without_speculation_adds_nothing(tiny_llama_dir: Path) -> None:
    with Engine(str(tiny_llama_dir), max_total_tokens=1024) as engine:
        out = engine.generate(PROMPT, {"max_new_tokens": 4, **GREEDY})
    assert not [k for k in out["meta_info"] if k.startswith("spec_")]
