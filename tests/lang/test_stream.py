"""run(stream=True): text_iter over the whole text or one variable, and the async iterator."""

from __future__ import annotations

import asyncio

import pytest
from lang_fake_backend import FakeBackend

from radixserve.lang import BackendError, function, gen


@function
def story(s, topic):
    s += f"A story about {topic}:" + gen("story") + "\nThe end." + gen("moral")


def _backend(**kw: object) -> FakeBackend:
    return FakeBackend(
        reply=lambda v, o: "!" if v.text.endswith("end.") else " once upon a time", **kw
    )


def test_text_iter_of_a_variable_streams_its_pieces() -> None:
    state = story.run("cats", stream=True, backend=_backend())
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 3  # several pieces, not one finished value
    assert "".join(pieces) == " once upon a time" == state["story"]


def test_text_iter_of_the_program_streams_all_text_then_ends() -> None:
    state = story.run("dogs", stream=True, backend=_backend())
    pieces = list(state.text_iter())
    assert len(pieces) > 3
    assert "".join(pieces) == state.text()
    assert state.text() == "A story about dogs: once upon a time\nThe end.!"


def test_text_iter_of_a_reassigned_variable_streams_the_latest_assignment() -> None:
    @function
    def turns(s):
        s += "1:" + gen("a")
        first = "".join(s.text_iter("a"))
        s += "2:" + gen("a")
        second = "".join(s.text_iter("a"))
        s += "3:" + gen("a") + "4:" + gen("a")  # both queued: stream only the last
        return first, second, list(s.text_iter("a"))

    replies = iter(["first answer", "second", "third one, longer", "4th"])
    state = turns.run(stream=True, backend=FakeBackend(reply=lambda v, o: next(replies)))
    list(state.text_iter())  # ends once the program has returned
    first, second, last = state.ret_value
    assert (first, second, "".join(last)) == ("first answer", "second", "4th")


def test_async_iterator_yields_the_same_text() -> None:
    async def collect() -> list[str]:
        state = story.run("owls", stream=True, backend=_backend())
        return [piece async for piece in state.text_async_iter("story")]

    assert "".join(asyncio.run(collect())) == " once upon a time"


def test_without_stream_text_iter_yields_the_final_value_once() -> None:
    state = story.run("bees", backend=_backend())
    assert list(state.text_iter("story")) == [" once upon a time"]


def test_stream_errors_and_unknown_variables_raise_at_the_end_of_iteration() -> None:
    state = story.run("boom", stream=True, backend=_backend(fail_on="boom"))
    with pytest.raises(BackendError, match="boom"):
        list(state.text_iter())
    state = story.run("cats", stream=True, backend=_backend())
    with pytest.raises(KeyError, match="'nope'"):
        list(state.text_iter("nope"))
