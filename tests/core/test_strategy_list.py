"""core/strategy_list.py: the loop calls a hook only on the strategies that implement it, and
a change to the list (a strategy added or removed mid-run) is seen at the next call."""

from __future__ import annotations

from typing import Any

from radixserve.core.interfaces import StepStrategy
from radixserve.core.strategy_list import StrategyList, implementing, overrides


class Polls(StepStrategy):
    def poll(self) -> list[Any]:
        return ["polled"]


class Ends(StepStrategy):
    def __init__(self) -> None:
        self.seen: list[Any] = []

    def ended(self, reqs: list[Any]) -> None:
        self.seen += reqs


class PollsToo(Polls):  # inherits the override
    pass


def test_implementing_names_only_the_strategies_that_override_the_hook() -> None:
    polls, ends, too = Polls(), Ends(), PollsToo()
    strategies = StrategyList([polls, ends, too])
    assert strategies.implementing("poll") == [polls, too]
    assert strategies.implementing("ended") == [ends]
    assert strategies.implementing("sample_rows") == []
    assert overrides(too, "poll") and not overrides(ends, "poll")


def test_an_override_set_on_the_object_counts() -> None:
    plain = StepStrategy()
    plain.poll = lambda: ["patched"]  # type: ignore[method-assign]
    assert StrategyList([plain]).implementing("poll") == [plain]


def test_every_change_to_the_list_is_seen() -> None:
    polls, ends = Polls(), Ends()
    strategies = StrategyList([ends])
    assert strategies.implementing("poll") == []
    strategies.append(polls)
    assert strategies.implementing("poll") == [polls]
    strategies.remove(polls)
    assert strategies.implementing("poll") == []
    strategies += [polls]
    assert strategies.implementing("poll") == [polls]
    strategies.insert(0, PollsToo())
    assert len(strategies.implementing("poll")) == 2
    del strategies[0]
    assert strategies.implementing("poll") == [polls]
    strategies[1] = Ends()
    assert strategies.implementing("poll") == []
    strategies.extend([polls])
    assert strategies.implementing("poll") == [polls]
    assert strategies.pop() is polls
    assert strategies.implementing("poll") == []
    assert strategies.on.poll == (), "the step hooks are worked out after the pop, not before"
    strategies.clear()
    assert strategies.implementing("ended") == []


def test_a_plain_list_is_worked_out_at_each_call() -> None:
    polls = Polls()
    plain: list[StepStrategy] = [Ends()]
    assert implementing(plain, "poll") == []
    plain.append(polls)
    assert implementing(plain, "poll") == [polls]


def test_the_step_hooks_follow_the_list() -> None:
    polls, ends = Polls(), Ends()
    strategies = StrategyList([ends])
    assert strategies.on.poll == () and strategies.on.ended == (ends,)
    strategies.append(polls)
    assert strategies.on.poll == (polls,) and strategies.on.ended == (ends,)
    strategies.clear()
    assert strategies.on.ended == () and strategies.on.sample_rows == ()


def test_an_object_without_the_hook_or_a_dict_implements_nothing() -> None:
    # object(): no __dict__ and no StepStrategy base; a duck-typed strategy with the hook counts
    assert not overrides(object(), "poll")

    class Duck:
        __slots__ = ()

        def poll(self) -> list[Any]:
            return []

    assert overrides(Duck(), "poll") and not overrides(Duck(), "ended")


def test_a_replaced_or_sorted_strategy_is_the_one_in_the_list() -> None:
    polls, ends, too = Polls(), Ends(), PollsToo()
    strategies = StrategyList([ends, polls])
    strategies[0] = too
    assert list(strategies) == [too, polls] and strategies.on.poll == (too, polls)
    strategies.sort(key=lambda s: type(s).__name__)  # Polls < PollsToo
    assert list(strategies) == [polls, too] and strategies.on.poll == (polls, too)
    strategies.sort(key=lambda s: type(s).__name__, reverse=True)
    assert strategies.on.poll == (too, polls)
