"""/v1/models/{id} with the official openai client: the served model's card under its name and
aliases, OpenAI's 404 for any other id (as SGLang answers)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import requests
from server_process import TINY_API_KEY, TINY_CONTEXT, TINY_MODEL_NAME, RunningServer


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=TINY_API_KEY, timeout=60, max_retries=0
    )


def test_the_served_model_and_its_aliases(client: openai.OpenAI, tiny_long_llama_dir: Path) -> None:
    # the model path has slashes: the id is the rest of the URL path
    for name in (TINY_MODEL_NAME, "default", str(tiny_long_llama_dir)):
        card = client.models.retrieve(name)
        assert card.id == name and card.object == "model", name
        assert card.model_extra is not None and card.model_extra["root"] == TINY_MODEL_NAME
        assert card.model_extra["max_model_len"] == TINY_CONTEXT


def test_an_unknown_model_is_openais_404(client: openai.OpenAI, server: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.status_code == 404
    body = requests.get(server.url + "/v1/models/gpt-4o", headers=server.headers, timeout=60)
    assert body.json() == {
        "error": {
            "message": "The model 'gpt-4o' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    # the key is needed, as on every /v1 route
    assert requests.get(server.url + "/v1/models/" + TINY_MODEL_NAME, timeout=60).status_code == 401
