"""Prometheus metrics of the server process (one registry per server, not the global one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from radixserve.core import ipc

# The exposition format generate_latest writes, as prometheus_client names it.
CONTENT_TYPE = CONTENT_TYPE_LATEST

PREFIX = "radixserve"
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            c = Counter(f"{PREFIX}_{name}", doc, ["model_name", *extra], registry=r)
            return c

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, ["model_name"], registry=r).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            h = Histogram(
                f"{PREFIX}_{name}", doc, ["model_name"], buckets=_LATENCY_BUCKETS, registry=r
            )
            return h.labels(**labels)

        self._labels = labels
        self.requests = counter(
            "requests", "Finished requests by finish reason", ("finish_reason",)
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to finish")
        self.num_running = gauge("num_running_reqs", "Requests in the running batch")
        self.num_waiting = gauge("num_waiting_reqs", "Requests waiting for admission")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens matched in the cache / all")
        self.kv_usage = gauge("kv_usage", "KV pool fraction held by running requests and locks")
        self.kv_used_tokens = gauge("kv_used_tokens", "KV slots held by running requests")
        self.kv_cached_tokens = gauge("kv_cached_tokens", "KV slots held by the prefix cache")
        self.kv_size = gauge("kv_size_tokens", "KV pool size in tokens")
        self._gauge = gauge
        self._counter = counter
        self._spec: _SpecMetrics | None = None  # made on the first state with speculation on

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_tokens(self, seconds_each: float, count: int) -> None:
        for _ in range(count):
            self.itl.observe(seconds_each)

    def on_finish(
        self, reason: str, prompt_tokens: int, output_tokens: int, cached: int, e2e: float
    ) -> None:
        self.requests.labels(finish_reason=reason, **self._labels).inc()
        self.prompt_tokens.labels(**self._labels).inc(prompt_tokens)
        self.generation_tokens.labels(**self._labels).inc(output_tokens)
        self.cached_tokens.labels(**self._labels).inc(cached)
        self.e2e.observe(e2e)

    def render(self, state: ipc.EngineState | None) -> bytes:
        if state is not None:
            kv = state.kv
            self.num_running.set(state.num_running)
            self.num_waiting.set(state.num_waiting)
            self.cache_hit_rate.set(state.cache_hit_rate)
            self.kv_size.set(kv["size"])
            self.kv_used_tokens.set(kv["in_use"])
            self.kv_cached_tokens.set(kv["evictable"] + kv["locked"])
            self.kv_usage.set((kv["in_use"] + kv["locked"]) / kv["size"] if kv["size"] else 0.0)
            if state.speculative is not None:
                if self._spec is None:
                    self._spec = _SpecMetrics(self._gauge, self._counter, self._labels)
                self._spec.update(state.speculative)
        return generate_latest(self.registry)


class _SpecMetrics:
    """Speculative decoding, from the engine's cumulative ``spec_stats()``: SGLang's gauges
    (``sglang:spec_accept_length``, ``sglang:spec_accept_rate``) under our prefix, and counters
    of the counts behind them. Registered only while speculation is on."""

    # spec_stats() key -> (counter name, help)
    COUNTS = {
        "verify_steps": ("spec_verify_steps", "Engine steps that verified drafts"),
        "verified_requests": (
            "spec_verify_ct",
            "Verify steps summed over requests (each request's spec_verify_ct)",
        ),
        "draft_tokens": ("spec_draft_tokens", "Draft tokens proposed and verified"),
        "accepted_tokens": ("spec_accepted_tokens", "Draft tokens accepted"),
    }

    def __init__(
        self,
        gauge: Callable[[str, str], Any],
        counter: Callable[[str, str], Counter],
        labels: dict[str, str],
    ) -> None:
        self.accept_length = gauge(
            "spec_accept_length",
            "Average tokens a request gains per verify step (accepted drafts + 1)",
        )
        self.accept_rate = gauge("spec_accept_rate", "Accepted draft tokens / draft tokens")
        self.counters = {
            key: counter(name, doc).labels(**labels) for key, (name, doc) in self.COUNTS.items()
        }
        self.seen = dict.fromkeys(self.COUNTS, 0)

    def update(self, stats: dict[str, Any]) -> None:
        self.accept_length.set(stats["avg_accept_length"])
        drafts = stats["draft_tokens"]
        self.accept_rate.set(stats["accepted_tokens"] / drafts if drafts else 0.0)
        for key, child in self.counters.items():
            value = int(stats[key])
            if value > self.seen[key]:  # the engine's counts only grow
                child.inc(value - self.seen[key])
                self.seen[key] = value
