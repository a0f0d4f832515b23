"""The enabled step strategies (core/interfaces.py, ``StepStrategy``) as the loop calls them:
per hook, only the strategies that implement it.

Every hook has a default that does nothing, and most strategies implement a few hooks, so
calling every strategy at every fixed point spends the step's host time on no-ops (a dozen
calls a step with only the sessions' strategy enabled; on an eager GPU step the host's
Python is the step's time). ``StrategyList`` is the list the engine core, scheduler and model
runner share; ``on.<hook>`` holds the strategies that override each per-step hook (an
attribute read, not a call, at each fixed point), worked out again after any change to the
list; ``implementing(hook)`` answers for any hook, worked out at the call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, SupportsIndex

from radixserve.core.interfaces import StepStrategy


def overrides(strategy: object, hook: str) -> bool:
    """Whether ``strategy`` implements ``hook`` (its class or the object itself replaces
    ``StepStrategy``'s default)."""
    if hook in getattr(strategy, "__dict__", ()):
        return True
    default = getattr(StepStrategy, hook)
    return getattr(type(strategy), hook, default) is not default


class StepHooks:
    """Per hook called at every step (or turn of the engine loop), the strategies that
    implement it, in order."""

    __slots__ = (
        "poll", "ended", "has_work", "wait_timeout", "needs_host_tokens", "run_own_step",
        "step_done", "extend_plan", "add_rows", "before_forward", "after_forward", "sample_rows",
    )  # fmt: skip
    poll: tuple[StepStrategy, ...]
    ended: tuple[StepStrategy, ...]
    has_work: tuple[StepStrategy, ...]
    wait_timeout: tuple[StepStrategy, ...]
    needs_host_tokens: tuple[StepStrategy, ...]
    run_own_step: tuple[StepStrategy, ...]
    step_done: tuple[StepStrategy, ...]
    extend_plan: tuple[StepStrategy, ...]
    add_rows: tuple[StepStrategy, ...]
    before_forward: tuple[StepStrategy, ...]
    after_forward: tuple[StepStrategy, ...]
    sample_rows: tuple[StepStrategy, ...]

    def __init__(self, strategies: Iterable[StepStrategy]) -> None:
        strategies = list(strategies)
        for hook in self.__slots__:
            setattr(self, hook, tuple(s for s in strategies if overrides(s, hook)))


class StrategyList(list[StepStrategy]):
    """A list of step strategies that knows which of them implement each hook. A hook set
    on a strategy object after it joined the list is seen after the list's next change."""

    def __init__(self, strategies: Iterable[StepStrategy] = ()) -> None:
        super().__init__(strategies)
        self._changed()

    def implementing(self, hook: str) -> list[StepStrategy]:
        """The strategies that implement ``hook``, in order (any hook; the per-step ones are
        kept in ``on``)."""
        return implementing(self, hook)

    # -- every change works the hooks out again ----------------------------------------------

    def _changed(self) -> None:
        #: the per-step hooks' strategies (``StepHooks``)
        self.on = StepHooks(self)

    def append(self, strategy: StepStrategy) -> None:
        super().append(strategy)
        self._changed()

    def extend(self, strategies: Iterable[StepStrategy]) -> None:
        super().extend(strategies)
        self._changed()

    def insert(self, index: SupportsIndex, strategy: StepStrategy) -> None:
        super().insert(index, strategy)
        self._changed()

    def remove(self, strategy: StepStrategy) -> None:
        super().remove(strategy)
        self._changed()

    def pop(self, index: SupportsIndex = -1) -> StepStrategy:
        strategy = super().pop(index)
        self._changed()
        return strategy

    def clear(self) -> None:
        super().clear()
        self._changed()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        super().sort(*args, **kwargs)
        self._changed()

    def reverse(self) -> None:
        super().reverse()
        self._changed()

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._changed()

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        self._changed()

    def __iadd__(self, strategies: Iterable[StepStrategy]) -> StrategyList:  # type: ignore[override,misc]
        super().__iadd__(strategies)
        self._changed()
        return self


def implementing(strategies: Iterable[StepStrategy], hook: str) -> list[StepStrategy]:
    """The strategies of any iterable that implement ``hook``, in order."""
    return [s for s in strategies if overrides(s, hook)]
