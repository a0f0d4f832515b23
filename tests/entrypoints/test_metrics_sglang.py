"""/metrics under SGLang's names, types, labels and buckets (so SGLang's Grafana dashboard
works unchanged), and values that follow the requests, on the shared tiny-model server."""

from __future__ import annotations

import time
from typing import Any

import openai
import prometheus_client
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from server_process import TINY_API_KEY, TINY_MODEL_NAME, RunningServer

TIMEOUT = 60
REQ = {"model_name", "engine_type"}  # TokenizerMetricsCollector's labels
STREAM = REQ | {"is_streaming"}
ENGINE = REQ | {"tp_rank", "pp_rank", "moe_ep_rank"}  # SchedulerMetricsCollector's labels

# Written from SGLang 0.5.23: docs/references/production_metrics.md (names and types of the
# example scrape) and python/sglang/srt/observability/metrics_collector.py (the label sets of
# TokenizerMetricsCollector and SchedulerMetricsCollector). name -> (type, labels)
SGLANG_METRICS: dict[str, tuple[str, set[str]]] = {
    "sglang:prompt_tokens_total": ("counter", STREAM),
    "sglang:generation_tokens_total": ("counter", STREAM),
    "sglang:num_requests_total": ("counter", STREAM),
    "sglang:num_aborted_requests_total": ("counter", REQ),
    "sglang:num_so_requests_total": ("counter", REQ),
    "sglang:cached_tokens_total": ("counter", REQ | {"cache_source"}),
    "sglang:spec_verify_calls_total": ("counter", REQ),
    "sglang:time_to_first_token_seconds": ("histogram", STREAM),
    "sglang:inter_token_latency_seconds": ("histogram", REQ),
    "sglang:e2e_request_latency_seconds": ("histogram", STREAM),
    "sglang:request_time_per_output_token_seconds": ("histogram", STREAM),
    "sglang:prompt_tokens_histogram": ("histogram", REQ),
    "sglang:uncached_prompt_tokens_histogram": ("histogram", REQ),
    "sglang:generation_tokens_histogram": ("histogram", REQ),
    "sglang:num_running_reqs": ("gauge", ENGINE),
    "sglang:num_queue_reqs": ("gauge", ENGINE),
    "sglang:num_grammar_queue_reqs": ("gauge", ENGINE),
    "sglang:gen_throughput": ("gauge", ENGINE),
    "sglang:cache_hit_rate": ("gauge", ENGINE),
    "sglang:token_usage": ("gauge", ENGINE),
    "sglang:num_used_tokens": ("gauge", ENGINE),
    "sglang:kv_available_tokens": ("gauge", ENGINE),
    "sglang:kv_evictable_tokens": ("gauge", ENGINE),
    "sglang:kv_used_tokens": ("gauge", ENGINE),
    "sglang:num_retracted_requests_total": ("counter", ENGINE),
}
# SGLang's default bucket bounds (TokenizerMetricsCollector)
TTFT_BOUNDS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
ITL_FIRST_BOUNDS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=TIMEOUT, max_retries=0
    )


def scrape(server: RunningServer) -> dict[str, Any]:
    """name (as prometheus_client's parser names families) -> family."""
    response = requests.get(server.url + "/metrics", timeout=TIMEOUT)  # no key needed
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def family_name(name: str, kind: str) -> str:
    return name.removesuffix("_total") if kind == "counter" else name


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    """The sum of the samples named ``sample`` whose labels include ``labels``."""
    return sum(
        s.value
        for f in families.values()
        for s in f.samples
        if s.name == sample and labels.items() <= s.labels.items()
    )


def complete(client: openai.OpenAI, stream: bool) -> Any:
    args: dict[str, Any] = {
        "model": TINY_MODEL_NAME,
        "prompt": "The quick brown fox jumps over",
        "max_tokens": 6,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    if not stream:
        return client.completions.create(**args).usage
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    return chunks[-1].usage


def test_names_types_labels_and_buckets_are_sglangs(
    server: RunningServer, client: openai.OpenAI
) -> None:
    complete(client, stream=False)
    complete(client, stream=True)
    families = scrape(server)
    for name, (kind, labels) in SGLANG_METRICS.items():
        family = families.get(family_name(name, kind))
        assert family is not None, f"{name} missing"
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
            assert sample.labels["model_name"] == TINY_MODEL_NAME
            assert sample.labels["engine_type"] == "unified"
    ttft = families["sglang:time_to_first_token_seconds"].samples
    bounds = [float(s.labels["le"]) for s in ttft if s.name.endswith("_bucket")]
    assert bounds[: len(TTFT_BOUNDS)] == TTFT_BOUNDS and bounds[-1] == float("inf")
    itl = families["sglang:inter_token_latency_seconds"].samples
    bounds = [float(s.labels["le"]) for s in itl if s.name.endswith("_bucket")]
    assert bounds[: len(ITL_FIRST_BOUNDS)] == ITL_FIRST_BOUNDS
    # our own names are gone (only the speculative counts SGLang lacks keep our prefix)
    assert not [n for n in families if n.startswith("radixserve_")]


@pytest.mark.parametrize("stream", [False, True])
def test_counters_equal_the_usage_responses_report(
    server: RunningServer, client: openai.OpenAI, stream: bool
) -> None:
    label = {"is_streaming": "true" if stream else "false"}
    before = scrape(server)
    usage = complete(client, stream)
    after = scrape(server)

    def grew(sample: str) -> float:
        return value(after, sample, **label) - value(before, sample, **label)

    assert grew("sglang:prompt_tokens_total") == usage.prompt_tokens > 0
    assert grew("sglang:generation_tokens_total") == usage.completion_tokens == 6
    assert grew("sglang:num_requests_total") == 1
    for histogram in (
        "sglang:e2e_request_latency_seconds",
        "sglang:time_to_first_token_seconds",
        "sglang:request_time_per_output_token_seconds",
    ):
        assert grew(histogram + "_count") == 1, histogram
        assert grew(histogram + "_sum") > 0, histogram
    # the 5 tokens after the first, one inter-token latency each
    itl = "sglang:inter_token_latency_seconds_count"
    assert value(after, itl) - value(before, itl) == 5
    generated = "sglang:generation_tokens_histogram_count"
    assert value(after, generated) - value(before, generated) == 1


def test_engine_gauges_while_a_request_runs(server: RunningServer) -> None:
    aborted = value(scrape(server), "sglang:num_aborted_requests_total")
    body = {
        "text": "Hello",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True},
    }
    headers = server.headers
    with requests.post(
        server.url + "/generate", json=body, headers=headers, stream=True, timeout=TIMEOUT
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):  # tokens are flowing
            next(line for line in lines if line)
        running = scrape(server)
    assert value(running, "sglang:num_running_reqs") == 1
    assert value(running, "sglang:num_queue_reqs") == 0
    assert value(running, "sglang:gen_throughput") > 0
    assert 0 < value(running, "sglang:token_usage") <= 1
    used = value(running, "sglang:num_used_tokens")
    assert used == value(running, "sglang:kv_used_tokens") > 0
    # closing the stream aborted the request
    deadline = time.monotonic() + TIMEOUT
    while value(scrape(server), "sglang:num_running_reqs") and time.monotonic() < deadline:
        time.sleep(0.05)
    idle = scrape(server)
    assert value(idle, "sglang:num_running_reqs") == 0
    assert value(idle, "sglang:num_aborted_requests_total") == aborted + 1
