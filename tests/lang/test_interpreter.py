"""The interpreter against an in-memory backend: text, variables, roles, fork/join, errors."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from lang_fake_backend import FakeBackend

import radixserve as rs
from radixserve.lang import BackendError, function, gen, gen_int, gen_string, select
from radixserve.lang.chat_template import SMOLLM_SYSTEM
from radixserve.lang.sampling import REGEX_INT


@function
def qa(s, question, suffix="?"):
    s += "Q: " + question + suffix + "\nA:" + gen("answer", max_tokens=3, stop="\n")


def test_text_and_variables_assemble_in_order() -> None:
    backend = FakeBackend(reply=lambda view, o: " forty-two")
    state = qa.run("What is six times seven", backend=backend)
    assert state["answer"] == " forty-two"
    assert state.text() == "Q: What is six times seven?\nA: forty-two"
    ((view, options),) = backend.gens()
    assert view.text == "Q: What is six times seven?\nA:"
    assert options.max_new_tokens == 3 and options.stop == ["\n"]


def test_run_defaults_apply_where_gen_leaves_options_unset() -> None:
    backend = FakeBackend()
    qa.run(question="x", backend=backend, max_new_tokens=50, temperature=0.0, top_k=5)
    ((_, options),) = backend.gens()
    assert options.max_new_tokens == 3  # gen's own value wins
    assert options.temperature == 0.0 and options.top_k == 5
    native = options.resolved().native()
    assert native == {"max_new_tokens": 3, "stop": ["\n"], "temperature": 0.0, "top_k": 5}


def test_arguments_bind_like_a_python_call() -> None:
    backend = FakeBackend()
    assert qa.run("a", "!", backend=backend).text().startswith("Q: a!")
    with pytest.raises(TypeError, match="question"):
        qa.run(backend=backend)
    with pytest.raises(TypeError, match="bogus"):
        qa.run("a", backend=backend, bogus=1)
    assert qa.bind(suffix="??").run("b", backend=backend).text().startswith("Q: b??")


def test_no_backend_is_a_clear_error() -> None:
    rs.set_default_backend(None)
    with pytest.raises(RuntimeError, match="set_default_backend"):
        qa.run("x")
    backend = FakeBackend()
    rs.set_default_backend(backend)
    try:
        assert qa.run("x")["answer"] == "out1"
    finally:
        rs.set_default_backend(None)


def test_role_blocks_render_the_template_and_record_messages() -> None:
    @function
    def chat(s):
        s += rs.user("Hi there")
        s += rs.assistant(gen("reply"))
        with s.user():
            s += "And now?"
        s += rs.assistant_begin() + gen("second") + rs.assistant_end()

    backend = FakeBackend(template="smollm2", reply=lambda v, o: "Hello")
    state = chat.run(backend=backend)
    system = f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
    assert state.text() == (
        system + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    )
    assert [m["role"] for m in state.messages()] == [
        "system", "user", "assistant", "user", "assistant",
    ]  # fmt: skip
    assert state.messages()[1] == {"role": "user", "content": "Hi there"}
    view, options = backend.gens()[0]
    assert view.role == "assistant" and view.role_text == ""
    assert view.messages[-1] == {"role": "user", "content": "Hi there"}
    assert "<|im_end|>" in options.stop  # the assistant turn's end stops generation


def test_nested_or_mismatched_roles_fail_clearly() -> None:
    @function
    def nested(s):
        s += rs.user_begin()
        s += rs.assistant_begin()

    with pytest.raises(ValueError, match="inside the open 'user' block"):
        nested.run(backend=FakeBackend())


def test_unknown_variable_is_a_key_error_naming_what_exists() -> None:
    state = qa.run("x", backend=FakeBackend())
    with pytest.raises(KeyError, match=r"no variable 'nope' \(variables set: answer\)"):
        state["nope"]

    @function
    def reads_missing(s):
        s += gen("a")
        s += s["b"]

    with pytest.raises(KeyError, match="'b'"):
        reads_missing.run(backend=FakeBackend())


def test_a_read_waits_for_the_latest_assignment_of_a_variable() -> None:
    @function
    def chat(s, questions):
        seen = []
        for q in questions:
            s += rs.user(q)
            s += rs.assistant(gen("answer"))
            seen.append((s["answer"], s.get_meta_info("answer")["prompt_tokens"]))
        s += gen("twice") + select("twice", ["a", "bb"])  # queued together: the last one wins
        seen.append(s["twice"])
        return seen

    backend = FakeBackend(delay=0.05)  # each read comes before its generation ends
    state = chat.run(["q1", "q2", "q3"], backend=backend)
    prompts = [len(view.text) for view, _ in backend.gens()]
    assert state.ret_value == [
        ("out1", prompts[0]), ("out2", prompts[1]), ("out3", prompts[2]), "bb",
    ]  # fmt: skip


def test_state_sets_and_checks_variables_like_sglang() -> None:
    @function
    def prog(s):
        s += gen("x")
        s["x"] = "mine"  # after the queued gen, so the gen does not overwrite it
        s.set_var("y", 2)
        s += "x=" + s["x"]
        return "x" in s, "y" in s, "z" in s

    state = prog.run(backend=FakeBackend(delay=0.05))
    assert state.ret_value == (True, True, False)
    assert state.text() == "out1x=mine"
    assert state.variables() == {"x": "mine", "y": 2}
    assert state.get_meta_info("y") is None


def test_backend_errors_surface_from_run_and_from_the_state() -> None:
    backend = FakeBackend(fail_on="boom")
    with pytest.raises(BackendError, match="boom"):
        qa.run("boom", backend=backend)
    states = qa.run_batch([{"question": "ok"}, {"question": "boom"}], backend=backend)
    assert states[0].error() is None and states[0]["answer"].startswith("out")
    assert isinstance(states[1].error(), BackendError)
    with pytest.raises(BackendError):
        states[1].text()


def test_select_and_gen_with_choices() -> None:
    @function
    def pick(s):
        s += "Pick: " + select("a", ["x", "yy", "z"]) + " then "
        s += gen("b", choices=["p", "qq"], choices_method="greedy")

    backend = FakeBackend(prefer=lambda c: c[-1])
    state = pick.run(backend=backend)
    assert (state["a"], state["b"]) == ("z", "qq")
    assert state.text() == "Pick: z then qq"
    assert state.get_meta_info("b") == {"method": "greedy"}
    selects = [d for k, _, d in backend.calls if k == "select"]
    assert [m.name for _, m in selects] == ["token_length_normalized", "greedy"]
    with pytest.raises(ValueError, match="unknown choices_method 'best'"):
        select("a", ["x"], choices_method="best")
    with pytest.raises(ValueError, match="non-empty list"):
        select("a", [])


def test_gen_int_and_gen_string_send_their_regex() -> None:
    @function
    def typed(s):
        s += (
            "n=" + gen_int("n") + " s=" + gen_string("t") + gen("j", json_schema={"type": "object"})
        )

    backend = FakeBackend(reply=lambda v, o: "7")
    typed.run(backend=backend)
    first, second, third = (o.resolved().native() for _, o in backend.gens())
    assert first["regex"] == REGEX_INT and {" ", "\n"} <= set(first["stop"])
    assert second["regex"].startswith('\\"')
    assert third["json_schema"] == '{"type": "object"}' and "regex" not in third


def test_fork_caches_the_prefix_then_runs_branches_in_parallel() -> None:
    @function
    def tips(s, topic):
        s += f"Tips about {topic}:\n"
        forks = s.fork(4)
        forks += lambda i: f"{i + 1}." + gen("tip", max_tokens=4)
        forks.join()
        s += "Summary:" + gen("summary")

    def reply(view: Any, options: Any) -> str:
        return f"[{view.text.splitlines()[-1]}]"

    backend = FakeBackend(rendezvous=4, reply=reply)  # each branch waits for all four
    state = tips.run("sleep", backend=backend)
    assert backend.prefixes == ["Tips about sleep:\n"]
    assert backend.calls[0][0] == "cache_prefix"  # before any branch generates
    assert backend.max_active == 4  # the four branches overlapped
    assert state["tip"] == ["[1.]", "[2.]", "[3.]", "[4.]"]
    # gather_variable leaves the parent's text alone
    assert state.text() == "Tips about sleep:\nSummary:[Summary:]"


def test_join_concate_and_append_adds_each_branch_text_in_order() -> None:
    @function
    def branches(s):
        s += "Start."
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" b{i}:" + gen("x")
        forks.join("concate_and_append")
        s += " End."

    state = branches.run(backend=FakeBackend(reply=lambda v, o: v.text[-3:-1]))
    assert state.text() == "Start. b0:b0 b1:b1 b2:b2 End."
    with pytest.raises(RuntimeError, match="has ended"):
        state += "more"

    @function
    def bad_join(s):
        s.fork(2).join("zip")

    with pytest.raises(ValueError, match="unknown join mode 'zip'"):
        bad_join.run(backend=FakeBackend())


def test_run_batch_caches_the_traced_prefix_and_keeps_order() -> None:
    @function
    def classify(s, text):
        s += rs.system("Classify the sentiment.")
        s += rs.user(f"Text: {text}")
        s += rs.assistant(gen("label"))

    backend = FakeBackend(
        template="chatml", delay=0.05, reply=lambda v, o: v.messages[-1]["content"]
    )
    states = classify.run_batch(
        [{"text": f"item {i}"} for i in range(16)],
        backend=backend,
        num_threads=4,
        progress_bar=True,
    )
    assert [s["label"] for s in states] == [f"Text: item {i}" for i in range(16)]
    assert backend.prefixes == [
        "<|im_start|>system\nClassify the sentiment.<|im_end|>\n<|im_start|>user\nText: "
    ]
    assert backend.max_active <= 4
    assert all(v.text.startswith(backend.prefixes[0]) for v, _ in backend.gens())
    with pytest.raises(TypeError, match="unknown keyword"):
        classify.run_batch([{"text": "a"}], backend=backend, tempurature=0)


def test_run_batch_binds_lists_positionally_and_dicts_by_keyword() -> None:
    backend = FakeBackend(reply=lambda v, o: "!")
    states = qa.run_batch([("a",), ["b", "?!"], {"question": "c"}], backend=backend)
    assert [s.text() for s in states] == ["Q: a?\nA:!", "Q: b?!\nA:!", "Q: c?\nA:!"]
    with pytest.raises(TypeError, match="qa.run_batch: item 1 is a str; give a dict"):
        qa.run_batch([("a",), "b"], backend=backend)


def test_run_batch_prefix_stops_at_the_first_generation() -> None:
    @function
    def gen_first(s, x):
        s += "Fixed intro. " + gen("a") + x

    backend = FakeBackend()
    gen_first.run_batch([{"x": "1"}, {"x": "2"}], backend=backend)
    assert backend.prefixes == ["Fixed intro. "]


def test_run_batch_prefix_trace_survives_arguments_used_as_non_text() -> None:
    @function
    def listing(s, items, n):
        s += "List:\n"
        for item in items[:n]:
            s += f"- {item}\n"
        s += gen("x")

    backend = FakeBackend(reply=lambda v, o: "!")
    batch = [{"items": ["a", "b"], "n": 1}, {"items": ["c"], "n": 1}]
    states = listing.run_batch(batch, backend=backend)
    assert backend.prefixes == ["List:\n"]
    assert [s.text() for s in states] == ["List:\n- a\n!", "List:\n- c\n!"]


def test_the_frontend_names_import_without_torch_or_openai() -> None:
    code = (
        "import sys, radixserve\n"
        "from radixserve import function, gen, select, user, RuntimeEndpoint, set_default_backend\n"
        "bad = sorted(m for m in ('torch', 'openai') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
