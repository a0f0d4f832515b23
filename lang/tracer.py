"""Find the text every run of a program starts with, before its arguments or a generation.

run_batch sends that prefix to the backend once (no generation) so the radix cache holds it
before the batch's programs run. The program is run once against a backend that refuses to
generate, with each argument replaced by a marker string; the text before the first marker or
the first gen/select is the shared prefix. Anything the program does with a marker that fails
(arithmetic, indexing a list) just ends the trace there.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from radixserve.lang.backends.base import Backend, ProgramView
from radixserve.lang.chat_template import ChatTemplate
from radixserve.lang.choices import ChoicesDecision, ChoicesMethod
from radixserve.lang.interpreter import StreamExecutor
from radixserve.lang.sampling import SamplingOptions
from radixserve.lang.state import ProgramState

logger = logging.getLogger(__name__)
_MARK = "\x00radixserve-arg\x00"


class _StopTrace(Exception):
    pass


class _TraceBackend(Backend):
    def __init__(self, chat_template: ChatTemplate) -> None:
        self.chat_template = chat_template

    def generate(self, view: ProgramView, options: SamplingOptions) -> tuple[str, dict[str, Any]]:
        raise _StopTrace

    def select(
        self, view: ProgramView, choices: list[str], temperature: float, method: ChoicesMethod
    ) -> ChoicesDecision:
        raise _StopTrace


class _TraceState(ProgramState):
    def __iadd__(self, other: Any) -> ProgramState:
        super().__iadd__(other)  # runs synchronously: the executor has no thread
        if self.executor.error is not None or _MARK in self.executor.text_:
            raise _StopTrace
        return self

    def fork(self, size: int = 1) -> Any:
        raise _StopTrace


def shared_prefix(func: Callable[..., Any], template: ChatTemplate) -> str:
    """The text every run of ``func`` (a program body taking the state first) starts with."""
    executor = StreamExecutor(_TraceBackend(template), use_thread=False)
    state = _TraceState(executor)
    params = list(inspect.signature(func).parameters.values())[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name: _MARK for p in params if p.kind == p.KEYWORD_ONLY}
    try:
        func(state, *[_MARK] * len(positional), **keywords)
    except _StopTrace:
        pass
    except Exception as e:  # noqa: BLE001 - a program failing on a marker only ends the trace
        logger.debug("prefix trace of %s ended at %r", getattr(func, "__name__", func), e)
    return executor.text_.split(_MARK, 1)[0]
