"""--grammar-compile-timeout over HTTP, with a real grammar backend: a schema that compiles for
longer than the timeout is a 400 naming the timeout, and the server goes on serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hardening import assert_openai_error, generate, own_server
from server_process import RunningServer

pytestmark = pytest.mark.slow  # its own server: ~10 s to start on a 2-core machine

# outlines-core takes ~2 ms per field of this schema over the tiny tokenizer (~0.2 s in all):
# far past the timeout. The timeout is judged by when the compile finished, so poll timing
# cannot let it through, and building the backend does not count against it.
SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string", "maxLength": 12} for i in range(100)},
    "required": [f"field_{i}" for i in range(100)],
}


@pytest.fixture(scope="module")
def impatient(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("grammar-timeout") / "server.log"
    flags = ["--grammar-backend", "outlines", "--grammar-compile-timeout", "0.001"]
    with own_server(tiny_long_llama_dir, log, *flags) as running:
        yield running


def test_slow_compile_is_a_400_naming_the_timeout_and_the_server_goes_on(
    impatient: RunningServer,
) -> None:
    params = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 8}
    body = {"text": "hello", "sampling_params": params}
    url = impatient.url + "/generate"
    r = httpx.post(url, json=body, headers=impatient.headers, timeout=60)
    assert_openai_error(r, range(400, 401))
    message = r.json()["error"]["message"]
    assert "json_schema did not compile within grammar_compile_timeout=0.001s" in message
    assert "grammar backend outlines" in message
    ok = generate(impatient, 4)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4, ok.text
