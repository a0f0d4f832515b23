"""Prometheus metrics of the server process under SGLang's names, types, labels and buckets, so
SGLang's Grafana dashboard and alerts read our server unchanged.

The source is SGLang 0.5.23, python/sglang/srt/observability/metrics_collector.py: per-request
metrics of its TokenizerMetricsCollector (labels model_name, engine_type, and is_streaming where
SGLang has it) and engine gauges of its SchedulerMetricsCollector (labels model_name,
engine_type, tp_rank, pp_rank, moe_ep_rank; one engine: rank 0, engine_type "unified"). The
engine gauges are read from the engine's state at scrape time. One registry per server, not the
global one. Served only with --enable-metrics, as in SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from radixserve.entrypoints import ipc
from radixserve.entrypoints.metrics_spec import SpecGroupMetrics

# The exposition format generate_latest writes, as prometheus_client names it.
CONTENT_TYPE = CONTENT_TYPE_LATEST

PREFIX = "sglang:"
OURS = "radixserve_"  # metrics SGLang does not have
ENGINE_TYPE = "unified"  # SGLang's value without prefill/decode disaggregation
TOKENIZER_LABELS = ("model_name", "engine_type")
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")

# SGLang's default buckets (TokenizerMetricsCollector).
TTFT_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
    1800, 2400,
)  # fmt: skip
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
TOKEN_BUCKETS = (
    100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000,
    12500, 15000, 17500, 20000, 22500, 25000, 27500, 30000, 35000, 40000, 60000, 80000,
    100000, 200000, 300000, 400000, 600000, 800000, 1000000, 1100000,
)  # fmt: skip


STREAM = ("is_streaming",)  # the label that tells streamed requests from whole ones


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._req_labels = {"model_name": model_name, "engine_type": ENGINE_TYPE}
        rank = {"tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        self._engine_labels = {**self._req_labels, **rank}
        self._register_counters()
        self._register_histograms()
        self.engine = _EngineMetrics(self.registry, self._engine_labels)
        self.spec_groups: SpecGroupMetrics | None = None  # made at the first speculating finish

    def _counter(self, name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
        labels = [*TOKENIZER_LABELS, *extra]
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _histogram(
        self, name: str, doc: str, buckets: Sequence[float], extra: Sequence[str] = ()
    ) -> Histogram:
        labels = [*TOKENIZER_LABELS, *extra]
        return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def _register_counters(self) -> None:
        self.prompt_tokens = self._counter(
            "prompt_tokens", "Number of prefill tokens processed.", STREAM
        )
        self.generation_tokens = self._counter(
            "generation_tokens", "Number of generation tokens processed.", STREAM
        )
        self.num_requests = self._counter("num_requests", "Number of requests processed.", STREAM)
        self.num_aborted = self._counter("num_aborted_requests", "Number of requests aborted.")
        self.num_so = self._counter(
            "num_so_requests", "Number of structured output requests processed."
        )
        self.cached_tokens = self._counter(
            "cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            ("cache_source",),
        )
        self.spec_verify_calls = self._counter(
            "spec_verify_calls", "Number of speculative decoding verification calls."
        )

    def _register_histograms(self) -> None:
        self.prompt_len = self._histogram(
            "prompt_tokens_histogram", "Histogram of prompt token length.", TOKEN_BUCKETS
        )
        self.uncached_len = self._histogram(
            "uncached_prompt_tokens_histogram",
            "Histogram of uncached (compute) prompt token length.",
            TOKEN_BUCKETS,
        )
        self.generation_len = self._histogram(
            "generation_tokens_histogram", "Histogram of generation token length.", TOKEN_BUCKETS
        )
        self.ttft = self._histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
            STREAM,
        )
        self.itl = self._histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        ).labels(**self._req_labels)  # fmt: skip
        self.tpot = self._histogram(
            "request_time_per_output_token_seconds",
            "Per-request TPOT in seconds: (finished_time - first_token_time) / "
            "(completion_tokens - 1).",
            ITL_BUCKETS,
            STREAM,
        )
        self.e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
            STREAM,
        )

    def on_tokens(self, seconds_each: float, count: int) -> None:
        """``count`` output tokens arrived together, ``seconds_each`` apart on average."""
        for _ in range(count):
            self.itl.observe(seconds_each)

    def on_finish(
        self,
        *,
        aborted: bool,
        streaming: bool,
        structured: bool,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int,
        spec_verify_ct: int,
        e2e: float,
        spec: tuple[dict[str, str] | None, int, int] = (None, 0, 0),
        ttft: float | None,
        decode_seconds: float | None,
    ) -> None:
        """One finished request. ``ttft``: None when no token came; ``decode_seconds``: first
        token to finish. TTFT is observed here, when the label is_streaming is known for sure
        (a stream is marked once its handler starts following it)."""
        labels = self._req_labels
        stream = {**labels, "is_streaming": "true" if streaming else "false"}
        self.prompt_tokens.labels(**stream).inc(prompt_tokens)
        self.generation_tokens.labels(**stream).inc(output_tokens)
        self.num_requests.labels(**stream).inc()
        if aborted:
            self.num_aborted.labels(**labels).inc()
        if structured:
            self.num_so.labels(**labels).inc()
        if cached_tokens > 0:
            self.cached_tokens.labels(**labels, cache_source="device").inc(cached_tokens)
        if spec_verify_ct > 0:
            self.spec_verify_calls.labels(**labels).inc(spec_verify_ct)
            if self.spec_groups is None:
                self.spec_groups = SpecGroupMetrics(self.registry, self._req_labels)
            self.spec_groups.on_finish(spec[0], spec_verify_ct, spec[1], spec[2])
        self.prompt_len.labels(**labels).observe(prompt_tokens)
        self.uncached_len.labels(**labels).observe(prompt_tokens - cached_tokens)
        self.generation_len.labels(**labels).observe(output_tokens)
        self.e2e.labels(**stream).observe(e2e)
        if ttft is not None:
            self.ttft.labels(**stream).observe(ttft)
        if decode_seconds is not None and output_tokens > 1:
            self.tpot.labels(**stream).observe(decode_seconds / (output_tokens - 1))

    def render(self, state: ipc.EngineState | None) -> bytes:
        if state is not None:
            self.engine.update(state)
        return generate_latest(self.registry)


class _EngineMetrics:
    """SGLang's SchedulerMetricsCollector gauges (and its retraction counter), set from the
    engine's state at scrape time; the speculative ones only while speculation is on."""

    GAUGES = {
        "num_running_reqs": "The number of running requests.",
        "num_queue_reqs": "The number of requests in the waiting queue.",
        "num_grammar_queue_reqs": "The number of requests in the grammar waiting queue.",
        "gen_throughput": "The generation throughput (token/s).",
        "cache_hit_rate": "The prefix cache hit rate.",
        "token_usage": "The token usage.",
        "num_used_tokens": "The number of used tokens.",
        "kv_available_tokens": "Number of free token slots in the KV cache pool.",
        "kv_evictable_tokens": "Number of evictable (radix-cached) token slots in the KV cache "
        "pool.",
        "kv_used_tokens": "Number of actively used token slots in the KV cache pool.",
    }
    SPEC_GAUGES = {
        "spec_accept_length": "Mean acceptance length of speculative decoding (accepted drafts "
        "+ bonus token per forward).",
        "spec_accept_rate": "Speculative acceptance rate (`accepted drafts / proposed drafts` "
        "in batch).",
        "spec_num_draft_tokens": "Currently active speculative_num_draft_tokens.",
    }
    # Ours, no SGLang equivalent: the counts behind the accept gauges (spec_stats() key ->
    # counter name, help).
    SPEC_COUNTS = {
        "verify_steps": ("radixserve_spec_verify_steps", "Engine steps that verified drafts"),
        "verified_requests": (
            "radixserve_spec_verify_ct",
            "Verify steps summed over requests (each request's spec_verify_ct)",
        ),
        "draft_tokens": ("radixserve_spec_draft_tokens", "Draft tokens proposed and verified"),
        "accepted_tokens": ("radixserve_spec_accepted_tokens", "Draft tokens accepted"),
    }

    PRIORITY_COUNTS = {
        "admitted": ("priority_admitted_requests", "Requests admitted, per priority value."),
        "queue_seconds": (
            "priority_queue_seconds",
            "Seconds admitted requests waited from arrival to admission, summed per priority.",
        ),
        "preempted": (
            "priority_preempted_requests",
            "Retractions for a request of a higher priority, per priority of the retracted.",
        ),
    }
    SESSION_GAUGES = {
        "open_sessions": ("open_sessions", "Sessions open (/open_session)."),
        "pinned_tokens": ("session_pinned_tokens", "KV tokens the open sessions keep pinned."),
        "demoted_pins": ("session_demoted_pins", "Session pins dropped to stay within the bound."),
    }
    # Ours (SGLang counts cached tokens per source per request; here
    # sglang:cached_tokens{cache_source="device"} counts them all): the hierarchical cache's
    # counts per tier (tier_stats() key -> counter name, help).
    HICACHE_COUNTS = {
        "device_hit_tokens": (
            "radixserve_hicache_device_hit_tokens", "Prefix tokens matched on the device"
        ),
        "host_hit_tokens": (
            "radixserve_hicache_host_hit_tokens", "Prefix tokens loaded back from host memory"
        ),
        "storage_hit_tokens": (
            "radixserve_hicache_storage_hit_tokens", "Prefix tokens loaded back from storage"
        ),
        "demoted_tokens": (
            "radixserve_hicache_demoted_tokens", "Tokens evicted from the device to the host"
        ),
        "host_evicted_tokens": (
            "radixserve_hicache_host_evicted_tokens", "Tokens evicted from the host pool"
        ),
        "storage_errors": (
            "radixserve_hicache_storage_errors", "Storage backend calls that failed"
        ),
        # --enable-hicache-prefetch (SGLang's name for storage -> host)
        "prefetch_storage_tokens": (
            "sglang:prefetched_tokens", "Prompt tokens prefetched from storage while queued"
        ),
        "prefetch_device_tokens": (
            "radixserve_hicache_prefetch_device_tokens",
            "Prompt tokens loaded from host memory to the device while queued",
        ),
        "prefetch_cancelled": (
            "radixserve_hicache_prefetch_cancelled",
            "Prefetches dropped because their request ended while queued",
        ),
    }  # fmt: skip

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels
        self.hicache: dict[str, _GrowingCounter] | None = None
        self.gauges = {name: self._gauge(name, doc) for name, doc in self.GAUGES.items()}
        self.retractions = _GrowingCounter(
            Counter(
                PREFIX + "num_retracted_requests",
                "Total number of retracted requests.",
                list(labels),
                registry=registry,
            ).labels(**labels)
        )
        self.spec: dict[str, Any] | None = None  # made on the first state with speculation on
        # ours, made on the first state that has them (a server without priorities or
        # sessions exports SGLang's names only): per priority value (core/priority.py) and the
        # sessions' pins (core/sessions.py)
        self.priority: dict[str, Any] | None = None
        self.session_gauges: dict[str, Any] | None = None

    def _gauge(self, name: str, doc: str) -> Any:
        gauge = Gauge(PREFIX + name, doc, list(self.labels), registry=self.registry)
        return gauge.labels(**self.labels)

    def update(self, state: ipc.EngineState) -> None:
        kv = state.kv
        used = kv["in_use"] + kv["locked"]  # held by requests; what eviction cannot free
        values = {
            "num_running_reqs": state.num_running,
            "num_queue_reqs": state.num_waiting,
            "num_grammar_queue_reqs": state.num_grammar_queue,
            "gen_throughput": state.gen_throughput,
            "cache_hit_rate": state.cache_hit_rate,
            "token_usage": used / kv["size"] if kv["size"] else 0.0,
            "num_used_tokens": used,
            "kv_available_tokens": kv["free"],
            "kv_evictable_tokens": kv["evictable"],
            "kv_used_tokens": used,
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        self.retractions.advance(state.retractions)
        self._update_priorities(state.priorities)
        self._update_sessions(state.sessions)
        if state.speculative is not None:
            self._update_spec(state.speculative)
        if state.hicache is not None:
            if self.hicache is None:
                self.hicache = {
                    key: _GrowingCounter(
                        Counter(name, doc, list(self.labels), registry=self.registry).labels(
                            **self.labels
                        )
                    )
                    for key, (name, doc) in self.HICACHE_COUNTS.items()
                }
            for key, counter in self.hicache.items():
                counter.advance(int(state.hicache.get(key, 0)))

    def _update_priorities(self, priorities: dict[str, dict[str, float]]) -> None:
        if priorities and self.priority is None:
            by_priority = [*self.labels, "priority"]
            self.priority = {
                key: Gauge(OURS + name, doc, by_priority, registry=self.registry)
                for key, (name, doc) in self.PRIORITY_COUNTS.items()
            }
        for priority, counts in priorities.items():
            for key, gauge in (self.priority or {}).items():
                gauge.labels(**self.labels, priority=priority).set(counts[key])

    def _update_sessions(self, sessions: dict[str, int]) -> None:
        if self.session_gauges is None and sessions.get("open_sessions"):
            self.session_gauges = {
                key: Gauge(OURS + name, doc, list(self.labels), registry=self.registry).labels(
                    **self.labels
                )
                for key, (name, doc) in self.SESSION_GAUGES.items()
            }
        for key, gauge in (self.session_gauges or {}).items():
            gauge.set(sessions.get(key, 0))

    def _update_spec(self, stats: dict[str, Any]) -> None:
        if self.spec is None:
            gauges = {name: self._gauge(name, doc) for name, doc in self.SPEC_GAUGES.items()}
            counters = {
                key: _GrowingCounter(
                    Counter(name, doc, list(self.labels), registry=self.registry).labels(
                        **self.labels
                    )
                )
                for key, (name, doc) in self.SPEC_COUNTS.items()
            }
            self.spec = {"gauges": gauges, "counters": counters}
        drafts = stats["draft_tokens"]
        gauges = self.spec["gauges"]
        gauges["spec_accept_length"].set(stats["avg_accept_length"])
        gauges["spec_accept_rate"].set(stats["accepted_tokens"] / drafts if drafts else 0.0)
        gauges["spec_num_draft_tokens"].set(stats["num_draft_tokens"])
        for key, counter in self.spec["counters"].items():
            counter.advance(int(stats[key]))


class _GrowingCounter:
    """A counter that follows one of the engine's cumulative counts."""

    def __init__(self, child: Any) -> None:
        self.child = child
        self.seen = 0

    def advance(self, value: int) -> None:
        if value > self.seen:  # the engine's counts only grow
            self.child.inc(value - self.seen)
            self.seen = value
