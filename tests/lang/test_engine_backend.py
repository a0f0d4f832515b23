"""EngineBackend over a tiny random model, in process: the native bodies reach
Engine.generate, select scores come from prompt logprobs, forks hit the prefix cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.entrypoints.engine import Engine
from radixserve.lang import BackendError, EngineBackend, function, gen, select


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    with Engine(str(tiny_llama_dir), max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture
def backend(engine: Engine) -> EngineBackend:
    return EngineBackend(engine)


@function
def prog(s, word):
    s += f"Say {word} " * 20
    forks = s.fork(3)
    forks += gen("g", max_tokens=4, temperature=0, ignore_eos=True)
    forks.join()
    s += select("pick", ["alpha", "beta gamma"])


def test_generate_select_and_fork_in_process(backend: EngineBackend, engine: Engine) -> None:
    state = prog.run("hi", backend=backend)
    texts = state["g"]
    assert len(texts) == 3 and len(set(texts)) == 1  # greedy: the same 4 tokens in each branch
    for meta in state.get_meta_info("g"):
        assert meta["completion_tokens"] == 4
        assert meta["cached_tokens"] >= meta["prompt_tokens"] - 1  # fork committed the prefix
    scores = state.get_meta_info("pick")["normalized_prompt_logprobs"]
    assert state["pick"] == ["alpha", "beta gamma"][scores.index(max(scores))]
    # The same scoring the server does: the engine's own prompt logprobs, by hand.
    prefix = "Say hi " * 20
    ids = engine.tokenizer.encode(prefix + "alpha")
    n = len(engine.tokenizer.encode(prefix))
    out = engine.generate(
        prefix + "alpha",
        {"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=n - 2,
        return_text_in_logprobs=True,
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[n - 2 :]
    if prefix.endswith(entries[0][2]):
        entries = entries[1:]
    assert scores[0] == pytest.approx(sum(e[0] for e in entries) / len(entries), abs=1e-5)


def test_stream_in_process(backend: EngineBackend) -> None:
    @function
    def story(s):
        s += "Once" + gen("x", max_tokens=6, temperature=0, ignore_eos=True)

    whole = story.run(backend=backend)["x"]
    state = story.run(backend=backend, stream=True)
    assert "".join(state.text_iter("x")) == whole == state["x"]


def test_refused_requests_are_backend_errors(backend: EngineBackend) -> None:
    @function
    def bad(s):
        s += "x" + gen("y", max_tokens=-3)

    with pytest.raises(BackendError, match="max_new_tokens"):
        bad.run(backend=backend)


def test_aborted_requests_raise_with_and_without_stream(backend: EngineBackend) -> None:
    @function
    def bad_regex(s):
        s += "x" + gen("y", max_tokens=4, regex="[0-9")

    with pytest.raises(BackendError, match="aborted the request: regex rejected"):
        bad_regex.run(backend=backend)
    state = bad_regex.run(backend=backend, stream=True)
    with pytest.raises(BackendError, match="aborted the request: regex rejected"):
        list(state.text_iter("y"))
