"""An in-memory frontend backend for interpreter tests: scripted replies, recorded calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from radixserve.lang.backends.base import Backend, BackendError, ProgramView
from radixserve.lang.chat_template import get_chat_template
from radixserve.lang.choices import ChoicesDecision, ChoicesMethod
from radixserve.lang.sampling import SamplingOptions

Reply = Callable[[ProgramView, SamplingOptions], str]
HANG_GUARD_S = 120  # only stops a hung test


class FakeBackend(Backend):
    """``reply`` decides each generation (default: ``"out<k>"``, k counting calls);
    ``delay`` makes each call take that long; with ``rendezvous=k`` each of the first k calls
    waits until all k are in progress at once, which shows overlap without timing (a call that
    would wait forever fails after ``HANG_GUARD_S``); select picks the choice ``prefer``
    returns (default: the longest)."""

    def __init__(
        self,
        reply: Reply | None = None,
        template: str = "default",
        delay: float = 0.0,
        prefer: Callable[[list[str]], str] | None = None,
        fail_on: str | None = None,
        rendezvous: int = 0,
    ) -> None:
        self.chat_template = get_chat_template(template)
        self.reply = reply
        self.delay = delay
        self.prefer = prefer or (lambda choices: max(choices, key=len))
        self.fail_on = fail_on
        self._rendezvous = (
            threading.Barrier(rendezvous, timeout=HANG_GUARD_S) if rendezvous else None
        )
        self.calls: list[tuple[str, ProgramView, Any]] = []
        self.prefixes: list[str] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()
        self._count = 0

    def cache_prefix(self, text: str) -> None:
        with self._lock:
            self.prefixes.append(text)
            self.calls.append(("cache_prefix", ProgramView(text), None))

    def generate(self, view: ProgramView, options: SamplingOptions) -> tuple[str, dict[str, Any]]:
        text = self._begin("generate", view, options)
        return text, {"prompt_tokens": len(view.text), "cached_tokens": 0}

    def generate_stream(
        self, view: ProgramView, options: SamplingOptions
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        text = self._begin("generate_stream", view, options)
        for i in range(0, len(text), 2):
            time.sleep(0.01)
            yield text[i : i + 2], {"completion_tokens": i // 2 + 1}

    def select(
        self, view: ProgramView, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        self._begin("select", view, (choices, method))
        return ChoicesDecision(self.prefer(choices), {"method": method.name})

    def _begin(self, kind: str, view: ProgramView, detail: Any) -> str:
        if self.fail_on is not None and self.fail_on in view.text:
            raise BackendError(f"fake backend refuses text containing {self.fail_on!r}")
        with self._lock:
            self.calls.append((kind, view, detail))
            self._count += 1
            count = self._count
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            if self._rendezvous is not None and count <= self._rendezvous.parties:
                self._rendezvous.wait()
            if self.delay:
                time.sleep(self.delay)
        finally:
            with self._lock:
                self.active -= 1
        if kind == "select":
            return ""
        return self.reply(view, detail) if self.reply else f"out{count}"

    def gens(self) -> list[tuple[ProgramView, SamplingOptions]]:
        return [(v, d) for k, v, d in self.calls if k.startswith("generate")]
