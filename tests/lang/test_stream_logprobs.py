"""SGLang's streaming-logprob program (sglang/test/test_programs.py: test_stream_logprobs)
against our server: through SGLang's own frontend (pip's ``sglang``, installed without its
dependencies by ``make setup``) on a SmolLM2 server with ``--incremental-streaming-output``
(the flag SGLang's own CI runs it with), and the same program logic through our frontend on a
server with cumulative streams.

What the program checks in every streamed chunk: ``output_token_logprobs`` and
``output_token_logprobs_length`` are in meta_info, the length equals ``completion_tokens``, and
the chunk's list holds exactly the tokens that arrived since the previous chunk.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from server_process import TINY_API_KEY, RunningServer, start_server, stop_server

import radixserve as rs

QUESTION = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
    "experiences and must-see attractions."
)


def check_chunks(chunks: list[tuple[str, dict[str, Any]]]) -> None:
    """test_stream_logprobs' assertions, unchanged in substance."""
    assert len(chunks) > 0
    prev_completion_tokens = 0
    prev_length = 0
    for chunk_text, meta_info in chunks:
        assert chunk_text
        assert "output_token_logprobs" in meta_info
        assert "output_token_logprobs_length" in meta_info
        completion_tokens = meta_info["completion_tokens"]
        length = meta_info["output_token_logprobs_length"]
        chunk_logprobs = meta_info["output_token_logprobs"]
        assert completion_tokens == length
        assert len(chunk_logprobs) == completion_tokens - prev_completion_tokens
        assert len(chunk_logprobs) == length - prev_length
        prev_completion_tokens, prev_length = completion_tokens, length


def run_program(sgl: Any) -> list[tuple[str, dict[str, Any]]]:
    """test_stream_logprobs' program, written against either frontend's module."""

    @sgl.function
    def qa(s, question):  # type: ignore[no-untyped-def]
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", return_logprob=True))

    async def collect_chunks() -> list[tuple[str, dict[str, Any]]]:
        ret = qa(question=QUESTION, stream=True, temperature=0, max_new_tokens=64)
        chunks = []
        async for chunk_text, meta_info in ret.text_async_iter("answer", return_meta_data=True):
            chunks.append((chunk_text, meta_info))
        return chunks

    return asyncio.run(collect_chunks())


@pytest.fixture(scope="module")
def incremental_server(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    # SmolLM2, not a tiny model: SGLang's frontend keeps only the latest event's meta_info when
    # several events arrive before its async iterator wakes up (its own race), so the program
    # needs tokens that come at a real model's pace, as on SGLang's CI.
    log = tmp_path_factory.mktemp("incremental-server") / "server.log"
    args = ["--max-total-tokens", "4096", "--incremental-streaming-output"]
    running = start_server(args, log, TINY_API_KEY, timeout=600)
    yield running
    assert stop_server(running) == 0, running.log()[-4000:]


@pytest.mark.slow
def test_sglangs_own_stream_logprobs_program(incremental_server: RunningServer) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (make setup installs it with --no-deps)")
    import sglang as sgl  # installed but not importable is a failure: a dependency is missing

    backend = sgl.RuntimeEndpoint(incremental_server.url, api_key=TINY_API_KEY)
    sgl.set_default_backend(backend)
    try:
        chunks = run_program(sgl)
    finally:
        sgl.set_default_backend(None)
    check_chunks(chunks)
    assert chunks[-1][1]["completion_tokens"] > 1  # more than one chunk's worth was checked


@pytest.mark.slow
def test_incremental_stream_events_are_deltas(incremental_server: RunningServer) -> None:
    body = {
        "text": "The quick brown fox",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": True,
    }
    r = requests.post(
        incremental_server.url + "/generate",
        json=body,
        headers=incremental_server.headers,
        stream=True,
        timeout=60,
    )
    events = [
        json.loads(line[5:])
        for line in r.iter_lines(decode_unicode=True)
        if line.startswith("data:") and line != "data: [DONE]"
    ]
    ids = [i for e in events for i in e["output_ids"]]
    logprob_ids = [t[1] for e in events for t in e["meta_info"]["output_token_logprobs"]]
    assert len(ids) == 12 and logprob_ids == ids
    assert [e["meta_info"]["output_token_logprobs_length"] for e in events][-1] == 12
    full = requests.post(
        incremental_server.url + "/generate",
        json={**body, "stream": False},
        headers=incremental_server.headers,
        timeout=60,
    ).json()
    assert "".join(e["text"] for e in events) == full["text"]
    assert full["output_ids"] == ids and full["meta_info"]["output_token_logprobs_length"] == 12


@pytest.mark.slow
def test_stream_logprobs_program_through_our_frontend(smollm2_server: RunningServer) -> None:
    # Our server streams cumulative lists by default; our frontend hands each chunk its own
    # tokens (as SGLang's frontend does against an incremental server).
    backend = rs.RuntimeEndpoint(smollm2_server.url)
    rs.set_default_backend(backend)
    try:
        chunks = run_program(rs)
    finally:
        rs.set_default_backend(None)
    check_chunks(chunks)
    text = "".join(c for c, _ in chunks)
    assert len(text) > 40 and chunks[-1][1]["completion_tokens"] == 64


def test_merging_empty_pieces_keeps_every_token() -> None:
    from radixserve.lang.interpreter import merge_stream_meta

    pieces = [
        {"completion_tokens": 1, "output_token_logprobs": [[-0.1, 5, None]]},
        {"completion_tokens": 2, "output_token_logprobs": [[-0.2, 6, None]]},
    ]
    merged = merge_stream_meta(pieces)
    assert merged["completion_tokens"] == 2 and len(merged["output_token_logprobs"]) == 2
    assert merge_stream_meta([]) == {}
