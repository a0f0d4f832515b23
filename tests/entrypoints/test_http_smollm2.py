"""End-to-end truth on the real default model (SmolLM2-135M-Instruct) through the HTTP server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import requests
from server_process import RunningServer, start_server, stop_server

pytestmark = pytest.mark.slow
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smollm2_server(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    # smollm2_dir converts (and caches) the GGUF first; the server then finds the cached copy.
    log = tmp_path_factory.mktemp("smollm2-server") / "server.log"
    running = start_server(["--max-total-tokens", "4096"], log, timeout=600)
    yield running
    assert stop_server(running) == 0, running.log()[-4000:]


def test_model_info_reports_the_hub_id(smollm2_server: RunningServer) -> None:
    info = requests.get(smollm2_server.url + "/get_model_info", timeout=30).json()
    assert info["model_path"] == DEFAULT_MODEL and info["is_generation"] is True
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]


def test_chat_answers_a_simple_question(smollm2_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in r.choices[0].message.content


def test_http_greedy_tokens_equal_the_offline_engine(smollm2_server: RunningServer) -> None:
    from radixserve import Engine

    prompt = "The three primary colors are"
    params = {"max_new_tokens": 16, "temperature": 0}
    body = {"text": prompt, "sampling_params": params}
    served = requests.post(smollm2_server.url + "/generate", json=body, timeout=120).json()
    with Engine(max_total_tokens=1024) as engine:
        offline = engine.generate(prompt, params)
    assert served["output_ids"] == offline["output_ids"]
    assert served["text"] == offline["text"]
