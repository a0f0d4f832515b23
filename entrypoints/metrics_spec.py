"""Speculative decoding per workload group in /metrics: each finished request's accept length
(tokens a verify step gave it, its own included) as a histogram, and the draft tokens proposed
for it and accepted, as counters, labelled by its group. A request names its group with
``custom_labels: {"group": "..."}`` (native /generate and the OpenAI routes, as SGLang's
``custom_labels``); without one it counts under ``default``. At most MAX_GROUPS group values
are kept apart (the rest count under ``other``) so that clients cannot grow the series
without bound."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

OURS = "radixserve_"
LABELS = ("model_name", "engine_type", "group")
MAX_GROUPS = 32
DEFAULT_GROUP, OTHER_GROUP = "default", "other"
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0)


class SpecGroupMetrics:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._labels = labels
        self._groups: set[str] = set()
        self.accept_length = Histogram(
            OURS + "spec_request_accept_length",
            "Per finished request that verified drafts: tokens a verify step gave it "
            "((spec_verify_ct + accepted drafts) / spec_verify_ct), by workload group",
            LABELS, buckets=ACCEPT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.drafted = Counter(
            OURS + "spec_request_draft_tokens",
            "Draft tokens proposed and verified for finished requests, by workload group",
            LABELS, registry=registry,
        )  # fmt: skip
        self.accepted = Counter(
            OURS + "spec_request_accepted_tokens",
            "Draft tokens accepted for finished requests, by workload group",
            LABELS, registry=registry,
        )  # fmt: skip

    def group(self, custom_labels: dict[str, str] | None) -> str:
        name = (custom_labels or {}).get("group") or DEFAULT_GROUP
        if name not in self._groups:
            if len(self._groups) >= MAX_GROUPS:
                return OTHER_GROUP
            self._groups.add(name)
        return name

    def on_finish(
        self, custom_labels: dict[str, str] | None, verify_ct: int, drafted: int, accepted: int
    ) -> None:
        if verify_ct <= 0:
            return
        labels: dict[str, Any] = {**self._labels, "group": self.group(custom_labels)}
        self.accept_length.labels(**labels).observe((verify_ct + accepted) / verify_ct)
        self.drafted.labels(**labels).inc(max(drafted, 0))
        self.accepted.labels(**labels).inc(accepted)
