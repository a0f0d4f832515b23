"""The OpenAI backend with a scripted client: what it sends for chat and completion models,
select from logprobs, and its errors."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest
from server_process import free_port

from radixserve.lang import BackendError, OpenAI, assistant, function, gen, gen_int, select, user


class FakeCreate:
    def __init__(self, reply: Any) -> None:
        self.reply = reply
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self.reply(kwargs) if callable(self.reply) else self.reply


def chat_reply(content: str, top: list[tuple[str, float]] | None = None) -> Any:
    logprobs = None
    if top is not None:
        tops = [NS(token=t, logprob=lp) for t, lp in top]
        logprobs = NS(content=[NS(token=top[0][0], logprob=top[0][1], top_logprobs=tops)])
    choice = NS(message=NS(content=content), finish_reason="stop", logprobs=logprobs)
    usage = NS(prompt_tokens=10, completion_tokens=2, prompt_tokens_details=NS(cached_tokens=4))
    return NS(id="chat-1", choices=[choice], usage=usage)


def backend(chat: Any = None, completion: Any = None, is_chat_model: bool = True) -> OpenAI:
    b = OpenAI(
        "my-model", base_url="http://127.0.0.1:9/v1", api_key="k", is_chat_model=is_chat_model
    )
    b.client = NS(  # type: ignore[assignment]
        base_url="http://fake/v1",
        chat=NS(completions=NS(create=chat)),
        completions=NS(create=completion),
    )
    return b


@function
def chat_prog(s):
    s += user("Capital of France?")
    s += assistant(gen("answer", max_tokens=8, temperature=0, top_k=3))
    s += user("Is it in Europe?")
    s += assistant(select("yes_no", ["Yes", "No"]))


def test_chat_model_gets_messages_and_ranks_choices_by_first_token() -> None:
    replies = iter([chat_reply("Paris"), chat_reply("Yes", [("Yes", -0.1), ("No", -2.5)])])
    create = FakeCreate(lambda kw: next(replies))
    state = chat_prog.run(backend=backend(chat=create))
    assert state["answer"] == "Paris" and state["yes_no"] == "Yes"
    assert state.get_meta_info("answer")["cached_tokens"] == 4
    first, second = create.calls
    assert first["messages"] == [{"role": "user", "content": "Capital of France?"}]
    assert first["max_tokens"] == 8 and first["temperature"] == 0
    assert first["extra_body"] == {"top_k": 3}
    assert second["logprobs"] is True and second["top_logprobs"] == 20
    assert second["max_tokens"] == 1
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert state.get_meta_info("yes_no")["first_token_logprobs"] == [-0.1, -2.5]


def test_chat_select_errors_without_logprobs_or_with_indistinguishable_choices() -> None:
    @function
    def pick(s, choices, method=None):
        s += user("Pick")
        s += assistant(select("x", choices, choices_method=method))

    no_logprobs = backend(chat=FakeCreate(chat_reply("Yes")))
    with pytest.raises(BackendError, match="returned no logprobs"):
        pick.run(["Yes", "No"], backend=no_logprobs)
    same_start = backend(chat=FakeCreate(chat_reply("Po", [("Po", -0.1)])))
    with pytest.raises(BackendError, match="start with the same token"):
        pick.run(["Positive", "Possible"], backend=same_start)
    unlisted = backend(chat=FakeCreate(chat_reply("Hm", [("Hm", -0.1)])))
    with pytest.raises(BackendError, match="none of the choices"):
        pick.run(["Yes", "No"], backend=unlisted)
    with pytest.raises(BackendError, match="needs token ids"):
        pick.run(["Yes", "No"], "unconditional_likelihood_normalized", backend=same_start)


def test_chat_model_generates_only_at_the_start_of_an_assistant_turn() -> None:
    @function
    def plain(s):
        s += "Once upon a time" + gen("story")

    with pytest.raises(BackendError, match="start of an assistant turn"):
        plain.run(backend=backend(chat=FakeCreate(chat_reply("x"))))


def test_completion_model_sends_the_rendered_text_and_scores_echoed_logprobs() -> None:
    def reply(kw: dict[str, Any]) -> Any:
        if not kw.get("echo"):
            return NS(id="c", choices=[NS(text=" Paris", finish_reason="stop")], usage=None)
        rows = []
        for i, prompt in enumerate(kw["prompt"]):
            # "Q? " then the choice: tokens split at the prefix boundary
            tokens = ["Q", "?", " ", prompt[3:]]
            lps = [None, -0.5, -0.25, -1.0 if prompt.endswith("A") else -3.0]
            offsets = [0, 1, 2, 3]
            lp = NS(tokens=tokens, token_logprobs=lps, text_offset=offsets)
            rows.append(NS(index=i, logprobs=lp, text=prompt))
        return NS(id="c", choices=rows, usage=None)

    create = FakeCreate(reply)
    b = backend(completion=create, is_chat_model=False)

    @function
    def prog(s):
        s += "Q? " + select("x", ["A", "B"]) + "\n" + gen("y", max_tokens=2)

    state = prog.run(backend=b)
    assert state["x"] == "A" and state["y"] == " Paris"
    echo, plain = create.calls
    assert echo["prompt"] == ["Q? A", "Q? B"] and echo["echo"] is True and echo["max_tokens"] == 0
    assert state.get_meta_info("x")["normalized_prompt_logprobs"] == [-1.0, -3.0]
    assert plain["prompt"] == "Q? A\n" and plain["max_tokens"] == 2


def test_regex_is_refused_clearly() -> None:
    @function
    def number(s):
        s += user("Pick a number")
        s += assistant(gen_int("n"))

    with pytest.raises(BackendError, match="cannot constrain output with a regex"):
        number.run(backend=backend(chat=FakeCreate(chat_reply("4"))))


def test_a_server_that_is_down_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    down = OpenAI("m", base_url=url, api_key="k", max_retries=0, timeout=5)
    with pytest.raises(BackendError, match="cannot reach"):
        chat_prog.run(backend=down)
