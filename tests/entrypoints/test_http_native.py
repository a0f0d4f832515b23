"""The SGLang-compatible native routes (PROTOCOL.md), over plain HTTP against a real server."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from hardening import metric
from server_process import TINY_CONTEXT, TINY_MODEL_NAME, RunningServer

TIMEOUT = 60
GREEDY = {"temperature": 0, "ignore_eos": True}


def post(server: RunningServer, path: str, body: Any = None, **kw: Any) -> requests.Response:
    return requests.post(
        server.url + path, json=body, headers=server.headers, timeout=TIMEOUT, **kw
    )


def get(server: RunningServer, path: str) -> requests.Response:
    return requests.get(server.url + path, headers=server.headers, timeout=TIMEOUT)


def generate(server: RunningServer, **body: Any) -> Any:
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(response: requests.Response) -> list[str]:
    return [line.decode() for line in response.iter_lines() if line]


def wait_idle(server: RunningServer, timeout: float = 30.0) -> dict[str, Any]:
    """Poll /get_server_info until nothing runs and no KV is held by a request."""
    deadline = time.monotonic() + timeout
    while True:
        info = get(server, "/get_server_info").json()
        if info["num_running_reqs"] == 0 and info["kv"]["in_use"] == 0:
            return info
        assert time.monotonic() < deadline, f"server not idle after {timeout} s: {info}"
        time.sleep(0.1)


def test_generate_single(server: RunningServer) -> None:
    out = generate(server, text="Hello world", sampling_params={"max_new_tokens": 8, **GREEDY})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert len(out["output_ids"]) == meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    tokens = post(server, "/tokenize", {"prompt": "Hello world"}).json()["tokens"]
    assert meta["prompt_tokens"] == len(tokens)
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)
    assert out["text"] == post(server, "/detokenize", {"tokens": out["output_ids"]}).json()["text"]


def test_batch_is_in_input_order_and_input_ids_match_text(server: RunningServer) -> None:
    prompts = ["The quick brown fox", "def add(a, b):", "0123456789"]
    params = {"max_new_tokens": 6, **GREEDY}
    singles = [generate(server, text=p, sampling_params=params)["output_ids"] for p in prompts]
    batch = generate(server, text=prompts, sampling_params=params)
    assert [b["output_ids"] for b in batch] == singles
    ids = [post(server, "/tokenize", {"prompt": p}).json()["tokens"] for p in prompts]
    by_ids = generate(server, input_ids=ids, sampling_params=[params] * 3)
    assert [b["output_ids"] for b in by_ids] == singles
    one = generate(server, input_ids=ids[0], sampling_params=params)
    assert isinstance(one, dict) and one["output_ids"] == singles[0]


def test_null_and_empty_values_mean_defaults(server: RunningServer) -> None:
    params = {
        "max_new_tokens": 3,
        "temperature": 0,
        "top_p": None,
        "stop": [],
        "regex": None,
        "json_schema": [],
        "min_p": None,
        "spaces_between_special_tokens": True,
    }
    out = generate(
        server,
        text="Hello",
        sampling_params=params,
        return_logprob=[None],
        top_logprobs_num=[None],
        return_text_in_logprobs=[None],
        logprob_start_len=[None],
    )
    assert out["meta_info"]["completion_tokens"] <= 3
    assert "output_token_logprobs" not in out["meta_info"]


def test_stream_sends_cumulative_text_then_done(server: RunningServer) -> None:
    params = {"max_new_tokens": 10, **GREEDY}
    whole = generate(server, text="Hello world", sampling_params=params)
    r = post(
        server,
        "/generate",
        {"text": "Hello world", "sampling_params": params, "stream": True},
        stream=True,
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = stream_events(r)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert texts[-1] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_batch_stream_tags_events_with_their_index(server: RunningServer) -> None:
    params = {"max_new_tokens": 6, **GREEDY}
    prompts = ["Hello world", "def add(a, b):"]
    whole = generate(server, text=prompts, sampling_params=params)
    body = {"text": prompts, "sampling_params": params, "stream": True}
    events = stream_events(post(server, "/generate", body, stream=True))
    assert events[-1] == "data: [DONE]"
    last: dict[int, Any] = {}
    for e in events[:-1]:
        chunk = json.loads(e.removeprefix("data: "))
        last[chunk["index"]] = chunk
    assert [last[i]["text"] for i in (0, 1)] == [w["text"] for w in whole]


def test_max_new_tokens_zero_only_prefills(server: RunningServer) -> None:
    out = generate(server, text="The quick brown fox", sampling_params={"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["prompt_tokens"] > 0 and out["meta_info"]["completion_tokens"] == 0


def test_logprob_triples(server: RunningServer) -> None:
    out = generate(
        server,
        text="Hello",
        sampling_params={"max_new_tokens": 5, **GREEDY},
        return_logprob=True,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    for (logprob, token_id, text), top in zip(triples, meta["output_top_logprobs"], strict=True):
        assert logprob <= 0 and isinstance(text, str)
        detok = post(server, "/detokenize", {"tokens": [token_id], "skip_special_tokens": False})
        assert text == detok.json()["text"]
        assert len(top) == 2 and top[0][1] == token_id  # greedy picks the top token
        assert top[0][0] >= top[1][0]
    assert "input_token_logprobs" in meta
    no_text = generate(
        server, text="Hello", sampling_params={"max_new_tokens": 2}, return_logprob=True
    )
    assert all(t[2] is None for t in no_text["meta_info"]["output_token_logprobs"])


def test_n_gives_a_list(server: RunningServer) -> None:
    out = generate(
        server, text="Hello", sampling_params={"max_new_tokens": 4, "n": 2, "sampling_seed": 1}
    )
    assert isinstance(out, list) and len(out) == 2
    assert len({o["meta_info"]["id"] for o in out}) == 2


def test_model_and_server_info(server: RunningServer) -> None:
    for path in ("/get_model_info", "/model_info"):
        info = get(server, path).json()
        assert info["model_path"] == TINY_MODEL_NAME and info["is_generation"] is True
    for path in ("/get_server_info", "/server_info"):
        info = get(server, path).json()
        assert set(info["kv"]) >= {"free", "evictable", "locked", "in_use"}
        assert info["context_length"] == TINY_CONTEXT and info["api_key"] == "***"
        assert {"num_running_reqs", "num_waiting_reqs", "cache_hit_rate"} <= set(info)
        # every platform-chosen setting, resolved, with where it came from
        settings = info["engine_settings"]
        assert set(settings) == {"max_running_requests", "mem_fraction_static",
                                 "chunked_prefill_size", "cuda_graph_max_bs",
                                 "prefill_shrink_after_decodes",
                                 "prefill_gather_steps",
                                 "speculative_disable_batch_size"}  # fmt: skip
        for name, entry in settings.items():
            assert info[name] == entry["value"] is not None and entry["from"], name


def test_server_info_counts_and_times_steps_by_kind(server: RunningServer) -> None:
    generate(server, text="Hello world " * 4, sampling_params={"max_new_tokens": 3})
    wait_idle(server)
    info = get(server, "/server_info").json()
    kinds = info["steps_by_kind"]
    assert set(kinds) == {"decode", "mixed", "prefill"}
    assert sum(k["steps"] for k in kinds.values()) == info["num_steps"]
    for name in ("decode", "prefill"):  # this request's prefill step and its decodes
        assert kinds[name]["steps"] > 0 and kinds[name]["seconds"] > 0, kinds
    # garbage collections per generation (the engine's few allocations here may trigger none)
    for process in ("engine", "http"):
        assert len(info["gc"][process]["collections"]) == len(info["gc"][process]["seconds"]) == 3
    assert sum(info["gc"]["http"]["collections"]) > 0, info["gc"]


def test_health_routes(server: RunningServer) -> None:
    assert requests.get(server.url + "/health", timeout=TIMEOUT).status_code == 200  # no key
    assert get(server, "/health_generate").status_code == 200
    assert requests.get(server.url + "/health_generate", timeout=TIMEOUT).status_code == 401


def test_flush_cache_empties_the_prefix_cache(server: RunningServer) -> None:
    generate(server, text="Hello world " * 8, sampling_params={"max_new_tokens": 2})
    wait_idle(server)
    assert post(server, "/flush_cache").status_code == 200
    kv = get(server, "/get_server_info").json()["kv"]
    assert kv["evictable"] == 0 and kv["free"] == kv["size"]


def test_tokenize_detokenize_round_trip(server: RunningServer) -> None:
    text = "Hello world! def add(a, b): return a + b"
    tok = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == TINY_CONTEXT
    assert post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["text"] == text
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400


def test_tokenize_detokenize_v1_paths(server: RunningServer) -> None:
    # SGLang registers /v1/tokenize and /v1/detokenize beside the bare paths
    body = {"prompt": ["Hello world", "def add(a, b)"], "add_special_tokens": False}
    tok = post(server, "/v1/tokenize", body)
    assert tok.status_code == 200, tok.text
    assert tok.json() == post(server, "/tokenize", body).json()
    assert tok.json()["count"] == [len(t) for t in tok.json()["tokens"]]
    detok = post(server, "/v1/detokenize", {"tokens": tok.json()["tokens"][0]})
    assert detok.status_code == 200, detok.text
    assert detok.json() == {"text": "Hello world"}


def test_tokenize_messages_renders_the_chat_template(server: RunningServer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world"},
    ]
    tok = post(server, "/tokenize", {"messages": messages})
    assert tok.status_code == 200, tok.text
    out = tok.json()
    assert set(out) == {"tokens", "count", "max_model_len"}
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == TINY_CONTEXT
    text = post(server, "/detokenize", {"tokens": out["tokens"], "skip_special_tokens": False})
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text.json()["text"] == expected  # add_generation_prompt defaults to true
    # the very prompt a chat completion with these messages is given
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == out["count"]
    bare = post(server, "/v1/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare.status_code == 200, bare.text
    assert out["tokens"][: bare.json()["count"]] == bare.json()["tokens"]
    assert bare.json()["count"] < out["count"]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages.0"),
        ({"messages": [{"content": "hi"}]}, "role"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": 7}]}, "content"),
        ({"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}, "exactly one"),
        ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": 1}, "add_gen"),
        ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, "cont"),
        ({"prompt": ["hi", 7]}, "prompt"),
    ],
)
def test_tokenize_refuses_bad_input(server: RunningServer, body: Any, reason: str) -> None:
    r = post(server, "/tokenize", body)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"], r.text


def test_detokenize_batch(server: RunningServer) -> None:
    texts = ["Hello world", "def add(a, b): return a + b"]
    body = {"prompt": texts, "add_special_tokens": False}
    ids = post(server, "/tokenize", body).json()["tokens"]
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": texts}
    assert post(server, "/v1/detokenize", {"tokens": [ids[0], []]}).json() == {
        "text": [texts[0], ""]
    }
    assert post(server, "/detokenize", {"tokens": []}).json() == {"text": ""}


@pytest.mark.parametrize(
    ("tokens", "reason"),
    [
        ([[1, 2], [10**9]], "tokens[1][0] = 1000000000 is outside the vocabulary"),
        ([[1, 2], [-1]], "outside the vocabulary"),
        ([1, [2]], "tokens[1]"),
        ([[1], 2], "tokens[1]"),
        ([[1], ["a"]], "tokens[1]"),
        ([[1, True]], "tokens[0]"),
        ("hello", "list of token ids"),
        ([1.5], "tokens[0]"),
    ],
)
def test_detokenize_refuses_bad_input(server: RunningServer, tokens: Any, reason: str) -> None:
    r = post(server, "/detokenize", {"tokens": tokens})
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"], r.text


def test_client_disconnect_aborts_the_request(server: RunningServer) -> None:
    aborted = metric(server, "sglang:num_aborted_requests_total")
    body = {"text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 1800, **GREEDY}}
    r = post(server, "/generate", body, stream=True)
    first = next(line for line in r.iter_lines() if line)
    assert first.startswith(b"data: {")
    r.close()
    info = wait_idle(server)
    assert info["num_waiting_reqs"] == 0 and info["kv"]["locked"] == 0
    assert metric(server, "sglang:num_aborted_requests_total") == aborted + 1


def test_abort_request_by_rid(server: RunningServer) -> None:
    body = {
        "text": "Hello",
        "stream": True,
        "rid": "abort-me",
        "sampling_params": {"max_new_tokens": 1800, **GREEDY},
    }
    r = post(server, "/generate", body, stream=True)
    lines = r.iter_lines()
    assert next(line for line in lines if line).startswith(b"data: {")
    assert post(server, "/abort_request", {"rid": "abort-me"}).status_code == 200
    rest = [line.decode() for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 1800
    wait_idle(server)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"sampling_params": {"max_new_tokens": 1}}, "exactly one of"),
        ({"text": "a", "input_ids": [1], "sampling_params": {}}, "exactly one of"),
        ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": "a", "sampling_params": {"temperature": -2}}, "temperature"),
        ({"text": "a", "sampling_params": {"regex": "(unclosed"}}, "regex"),
        ({"text": "a", "sampling_params": {"max_new_tokens": TINY_CONTEXT}}, "context length"),
        ({"input_ids": [1, 10**7]}, "vocabulary"),
        ({"input_ids": [5] * (TINY_CONTEXT + 1)}, "context length"),
        ({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, "batch of 2"),
    ],
)
def test_bad_generate_requests_are_400(server: RunningServer, body: dict, needle: str) -> None:
    r = post(server, "/generate", body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_invalid_json_is_400(server: RunningServer) -> None:
    r = requests.post(server.url + "/generate", data=b"{oops", headers=server.headers, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_concurrent_streams_complete_without_leaks(server: RunningServer) -> None:
    def one(i: int) -> tuple[int, str]:
        body = {
            "text": f"Hello {i}",
            "stream": True,
            "sampling_params": {"max_new_tokens": 16, **GREEDY},
        }
        with post(server, "/generate", body, stream=True) as r:
            events = stream_events(r)
        last = json.loads(events[-2].removeprefix("data: "))
        return last["meta_info"]["completion_tokens"], events[-1]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert results == [(16, "data: [DONE]")] * 32
    wait_idle(server)


def test_select_style_scoring_returns_prompt_logprobs(server: RunningServer) -> None:
    """The frontend's select(): prefill-only batches scored from logprob_start_len."""
    prefix = "The quick brown fox"
    first = generate(server, text=prefix, sampling_params={"max_new_tokens": 0})
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    n_prefix = first["meta_info"]["prompt_tokens"]
    start = max(n_prefix - 2, 0)
    choices = [" jumps", " sleeps over the dog"]
    outs = generate(
        server,
        text=[prefix + c for c in choices],
        sampling_params={"max_new_tokens": 0, "temperature": 0},
        return_logprob=True,
        return_text_in_logprobs=True,
        logprob_start_len=start,
    )
    assert isinstance(outs, list) and len(outs) == 2
    for out in outs:
        meta = out["meta_info"]
        entries = meta["input_token_logprobs"]
        assert len(entries) == meta["prompt_tokens"] - start
        assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in entries)
        assert all(isinstance(text, str) for _, _, text in entries)
        assert meta["output_token_logprobs"] == []
    # unconditional scoring: no start given -> every prompt position, the first one null
    ids = post(server, "/tokenize", {"text": choices[1]}).json()["tokens"]
    out = generate(
        server, input_ids=[ids], sampling_params={"max_new_tokens": 0}, return_logprob=True
    )[0]
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids
    assert entries[0][0] is None and all(e[0] is not None for e in entries[1:])


@pytest.mark.parametrize(
    "input_ids", [[1, True], [1, 2.0], [], [[1], [True]], [[1], []], ["1"], "12"]
)
def test_input_ids_must_be_lists_of_ints(server: RunningServer, input_ids: Any) -> None:
    r = post(server, "/generate", {"input_ids": input_ids})
    assert r.status_code == 400, r.text
    assert "input_ids must be a non-empty list of token ids" in r.text
    assert generate(server, input_ids=[[1, 2], [3]], sampling_params={"max_new_tokens": 1})
