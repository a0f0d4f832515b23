"""Each program in examples/frontend/ against a live SmolLM2 server, asserting on its
variables."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import ModuleType

import pytest
from server_process import RunningServer

from radixserve.lang import RuntimeEndpoint

pytestmark = pytest.mark.slow
Load = Callable[[str], ModuleType]


@pytest.fixture(scope="module")
def backend(smollm2_server: RunningServer) -> RuntimeEndpoint:
    return RuntimeEndpoint(smollm2_server.url)


def test_few_shot_qa_answers_on_one_line(backend: RuntimeEndpoint, load_example: Load) -> None:
    state = load_example("few_shot_qa").run(backend)
    assert state["answer"].strip() == "Madrid"
    assert state.text().endswith("Q: What is the capital of Spain?\nA:" + state["answer"])


def test_classifier_labels_a_batch_by_select(backend: RuntimeEndpoint, load_example: Load) -> None:
    example = load_example("classifier")
    states = example.run(backend)
    assert [s["sentiment"] for s in states] == ["positive", "negative", "positive", "negative"]
    scores = states[1].get_meta_info("sentiment")["normalized_prompt_logprobs"]
    assert scores[1] > scores[0]  # "negative" scored higher for the bad review


def test_tip_suggestions_branch_in_parallel_on_a_cached_prefix(
    backend: RuntimeEndpoint, load_example: Load
) -> None:
    state = load_example("tip_suggestions").run(backend)
    tips = state["detailed_tip"]
    assert isinstance(tips, list) and len(tips) == 2
    assert all(t.strip() for t in tips) and tips[0] != tips[1]
    for tip in tips:
        assert f"{tip.strip()}\n" in state.text()
    assert state["summary"].strip()
    branch_meta = state.get_meta_info("detailed_tip")
    # fork() sent the shared text first: each branch found it in the radix cache.
    shared = backend.post(
        {"text": state.text().split("Tip 1:")[0], "sampling_params": {"max_new_tokens": 0}}
    )
    assert all(m["cached_tokens"] >= shared["meta_info"]["prompt_tokens"] - 1 for m in branch_meta)


def test_json_extraction_is_valid_json_matching_the_regex(
    backend: RuntimeEndpoint, load_example: Load
) -> None:
    example = load_example("json_extraction")
    state = example.run(backend)
    data = json.loads(state["json"])
    assert set(data) == {"name", "country", "population_millions"}
    assert data["name"] == "Paris"
    assert isinstance(data["population_millions"], int)


def test_multi_turn_chat_keeps_the_turns(backend: RuntimeEndpoint, load_example: Load) -> None:
    state = load_example("multi_turn_chat").run(backend)
    assert "Paris" in state["answer_1"]
    assert state["answer_2"].strip()
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["answer_1"].strip()
    assert state.text().count("<|im_end|>") == 5  # every turn closed by the template
