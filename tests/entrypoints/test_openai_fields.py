"""OpenAI request fields SGLang's clients send (issue 21), through the official ``openai`` client:
strict model names, max_completion_tokens, logit_bias, stop_regex and suffix (fill-in-the-middle).

The tiny shared server covers what needs no real text; one SmolLM2 server, started with
``--strict-model-name``, covers strict names and the fill-in-the-middle prompt of a real
tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_process import TINY_API_KEY, RunningServer, start_server, stop_server

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )


@pytest.fixture(scope="module")
def strict_smollm2(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("strict-smollm2") / "server.log"
    running = start_server(["--max-total-tokens", "4096", "--strict-model-name"], log, timeout=600)
    yield openai.OpenAI(base_url=running.url + "/v1", api_key="none", timeout=120, max_retries=0)
    assert stop_server(running) == 0, running.log()[-4000:]


# -- model names ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_strict_model_name_refuses_unknown_names(strict_smollm2: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        strict_smollm2.completions.create(model="gpt-17", prompt="Hi", max_tokens=1)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    # the served name and "default" still work
    for name in (SMOLLM2, "default"):
        r = strict_smollm2.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert r.model == SMOLLM2 and r.usage.completion_tokens == 1
