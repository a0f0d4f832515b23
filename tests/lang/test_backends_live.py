"""The frontend on a live SmolLM2 server: prefix reuse (fork, run_batch), select scores equal
to a manual computation from the server's logprobs, and the same greedy program on the
RuntimeEndpoint, in-process Engine and OpenAI backends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from server_process import RunningServer

from radixserve.lang import (
    BackendError,
    EngineBackend,
    OpenAI,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    select,
    user,
)

pytestmark = pytest.mark.slow
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LONG_PREFIX = (
    "You are a travel assistant. You know every country's capital, its museums, parks, food "
    "markets and the best season to visit. Answer in one short sentence, name one concrete "
    "place, and never repeat the question. "
) * 3


@pytest.fixture(scope="module")
def backend(smollm2_server: RunningServer) -> RuntimeEndpoint:
    return RuntimeEndpoint(smollm2_server.url)


@function
def branches(s, nonce):
    s += f"[{nonce}] " + LONG_PREFIX
    forks = s.fork(4)
    forks += lambda i: f"\nCity {i + 1}:" + gen("city", max_tokens=3, temperature=0)
    forks.join()


def test_fork_branches_reuse_the_cached_prefix(backend: RuntimeEndpoint) -> None:
    backend.flush_cache()
    nonce = uuid.uuid4().hex[:8]
    state = branches.run(nonce, backend=backend)
    metas = state.get_meta_info("city")
    assert len(metas) == 4 and len(state["city"]) == 4
    shared = backend.post(
        {"text": f"[{nonce}] " + LONG_PREFIX, "sampling_params": {"max_new_tokens": 0}}
    )
    prefix_tokens = shared["meta_info"]["prompt_tokens"]
    assert prefix_tokens > 100
    # Without fork's prefix commit the first branch to run would find nothing cached.
    for meta in metas:
        assert meta["cached_tokens"] >= prefix_tokens - 1, meta


@function
def labelled(s, item):
    s += LONG_PREFIX + f"\nItem: {item}\nLabel:" + gen("label", max_tokens=2, temperature=0)


def test_run_batch_of_16_hits_the_cache_for_most_prompt_tokens(backend: RuntimeEndpoint) -> None:
    backend.flush_cache()
    states = labelled.run_batch([{"item": f"thing number {i}"} for i in range(16)], backend=backend)
    metas = [s.get_meta_info("label") for s in states]
    # run_batch sent the traced prefix first, so even the first program to run hits it.
    assert min(m["cached_tokens"] for m in metas) > 100
    cached = sum(m["cached_tokens"] for m in metas)
    prompt = sum(m["prompt_tokens"] for m in metas)
    assert cached / prompt > 0.5, (cached, prompt)


def _manual_entries(url: str, prefix: str, choices: list[str]) -> list[list[Any]]:
    """SGLang's select steps by hand: count the prefix, score each prefix + choice from one
    token early, drop the first entry when it is still prefix text."""
    head = requests.post(
        url + "/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 0}}
    ).json()
    start = max(head["meta_info"]["prompt_tokens"] - 2, 0)
    rows = []
    for c in choices:
        body = {
            "text": prefix + c,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
        }
        entries = requests.post(url + "/generate", json=body).json()["meta_info"]
        entries = entries["input_token_logprobs"]
        rows.append(entries[1:] if prefix.endswith(entries[0][2]) else entries)
    return rows


@function
def capital(s, method):
    s += "Q: What is the capital of France?\nA: The capital of France is"
    s += select("city", [" Paris", " London", " a city in Europe"], choices_method=method)


@pytest.mark.parametrize(
    "method", ["token_length_normalized", "greedy", "unconditional_likelihood_normalized"]
)
def test_select_scores_equal_a_manual_computation(backend: RuntimeEndpoint, method: str) -> None:
    state = capital.run(method, backend=backend)
    meta = state.get_meta_info("city")
    choices = [" Paris", " London", " a city in Europe"]
    rows = _manual_entries(
        backend.base_url, "Q: What is the capital of France?\nA: The capital of France is", choices
    )
    means = [sum(e[0] for e in r) / len(r) for r in rows]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-4)
    if method == "token_length_normalized":
        expected = choices[means.index(max(means))]
    elif method == "greedy":
        width = max(len(r) for r in rows)
        matrix = [
            [e[0] for e in r] + [sum(e[0] for e in r) / len(r)] * (width - len(r)) for r in rows
        ]
        for got, want in zip(meta["greedy_logprob_matrix"], matrix, strict=True):
            assert got == pytest.approx(want, abs=1e-4)
        alive = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == best]
            if len(alive) == 1:
                break
        expected = choices[alive[0]]
    else:
        alone = requests.post(
            backend.base_url + "/generate",
            json={
                "input_ids": [[e[1] for e in r] for r in rows],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
            },
        ).json()
        scores = []
        for r, a in zip(rows, alone, strict=True):
            u = a["meta_info"]["input_token_logprobs"]
            scores.append(sum(c[0] - (x[0] or 0.0) for c, x in zip(r, u, strict=True)) / len(r))
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx(scores, abs=1e-4)
        expected = choices[scores.index(max(scores))]
    assert state["city"] == expected
    assert state["city"] == " Paris"


@function
def colors(s):
    s += "The three primary colors are" + gen("colors", max_tokens=12, temperature=0)
    s += "\nQ: Is the sky blue?\nA:" + select("yes_no", [" Yes", " No"])


@pytest.fixture(scope="module")
def engine_backend() -> Iterator[EngineBackend]:
    backend = EngineBackend(max_total_tokens=1024)
    yield backend
    backend.shutdown()


def test_one_program_gives_the_same_greedy_result_on_three_backends(
    backend: RuntimeEndpoint, engine_backend: EngineBackend, smollm2_server: RunningServer
) -> None:
    served = colors.run(backend=backend)
    offline = colors.run(backend=engine_backend)
    assert engine_backend.chat_template.name == backend.chat_template.name == "smollm2"
    assert served["colors"] == offline["colors"] and served["colors"].strip()
    assert served["yes_no"] == offline["yes_no"]
    assert served.get_meta_info("yes_no")["normalized_prompt_logprobs"] == pytest.approx(
        offline.get_meta_info("yes_no")["normalized_prompt_logprobs"], abs=1e-4
    )

    @function
    def colors_text_only(s):
        s += "The three primary colors are" + gen("colors", max_tokens=12, temperature=0)

    openai = OpenAI(MODEL, base_url=smollm2_server.url + "/v1", api_key="none", is_chat_model=False)
    assert colors_text_only.run(backend=openai)["colors"] == served["colors"]


@function
def chat_capital(s):
    s += user("What is the capital of France?")
    s += assistant(gen("answer", max_tokens=16, temperature=0))
    s += user("Answer with one word: is Paris in Europe?")
    s += assistant(select("yes_no", ["Yes", "No"]))


def test_openai_chat_backend_maps_roles_to_messages(
    backend: RuntimeEndpoint, smollm2_server: RunningServer
) -> None:
    chat = OpenAI(MODEL, base_url=smollm2_server.url + "/v1", api_key="none")
    state = chat_capital.run(backend=chat)
    assert "Paris" in state["answer"]
    assert state["yes_no"] == "Yes"  # ranked from the first token's top logprobs
    assert [m["role"] for m in state.messages()][-2:] == ["user", "assistant"]
    # The server renders the same messages with the same template: the same greedy answer.
    assert chat_capital.run(backend=backend)["answer"].strip() == state["answer"].strip()


def test_openai_completion_select_uses_echoed_prompt_logprobs(
    smollm2_server: RunningServer,
) -> None:
    completion = OpenAI(
        MODEL, base_url=smollm2_server.url + "/v1", api_key="none", is_chat_model=False
    )
    state = capital.run("token_length_normalized", backend=completion)
    assert state["city"] == " Paris"
    with pytest.raises(BackendError, match="needs token ids"):
        capital.run("unconditional_likelihood_normalized", backend=completion)


@function
def haiku(s):
    s += user("Write a haiku about the sea.")
    s += assistant(gen("poem", max_tokens=16, temperature=0))


def test_streaming_gives_the_same_text_as_a_plain_run(
    backend: RuntimeEndpoint, smollm2_server: RunningServer
) -> None:
    plain = haiku.run(backend=backend)["poem"]
    streamed = haiku.run(backend=backend, stream=True)
    assert "".join(streamed.text_iter("poem")) == plain == streamed["poem"]
    chat = OpenAI(MODEL, base_url=smollm2_server.url + "/v1", api_key="none")
    over_openai = haiku.run(backend=chat, stream=True)
    assert "".join(over_openai.text_iter("poem")) == plain
