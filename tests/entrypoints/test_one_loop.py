"""The offline Engine and the server run one engine loop and one request check: the same
greedy outputs for the same prompts, the same refusals (word for word) for the same bad
requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import zmq
from platform_choice import on_cpu
from server_process import RunningServer

from radixserve import Engine
from radixserve.core.request import InvalidRequest, Req, SamplingParams
from radixserve.entrypoints.engine_client import EngineClient
from radixserve.entrypoints.engine_loop import EngineLoop
from radixserve.entrypoints.engine_process import ZmqTransport, _ready, server_loop
from radixserve.entrypoints.engine_transport import QueueTransport
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[1, 150, 43, 186], [1, 45, 96, 173, 170, 299, 16], [5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def engine(tiny_long_llama_dir: Path) -> Iterator[Engine]:
    # the shared server's model, KV pool and platform (tests/support/server_process.py): the
    # CPU, which that server asks for, so a GPU machine compares like with like
    eng = Engine(str(tiny_long_llama_dir), **on_cpu({"max_total_tokens": 16384}))
    yield eng
    eng.shutdown()


def _server_generate(server: RunningServer, body: dict[str, Any]) -> requests.Response:
    return requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=120)


def test_both_entrypoints_run_the_same_loop(engine: Engine) -> None:
    assert type(engine.loop) is EngineLoop and isinstance(engine.loop.transport, QueueTransport)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:  # built, not run: the offline Engine's loop owns this core
        served = server_loop(engine.core, pull, push)
        assert type(served) is EngineLoop and isinstance(served.transport, ZmqTransport)
        assert served.isolate_failures and not engine.loop.isolate_failures
    finally:
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("ids", PROMPTS)
def test_greedy_outputs_are_identical(
    engine: Engine, server: RunningServer, ids: list[int]
) -> None:
    offline = engine.generate(input_ids=ids, sampling_params=GREEDY)
    r = _server_generate(server, {"input_ids": ids, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    online = r.json()
    assert len(offline["output_ids"]) == GREEDY["max_new_tokens"]
    assert online["output_ids"] == offline["output_ids"]
    assert online["text"] == offline["text"]
    assert online["meta_info"]["finish_reason"] == offline["meta_info"]["finish_reason"]


BAD_REQUESTS = [
    # (an empty input_ids list is refused earlier by the server, as a malformed body)
    ({"text": ""}, "the prompt is empty"),
    ({"input_ids": [1, 2, 10**6]}, "token id 1000000 is outside the vocabulary"),
    ({"input_ids": [5] * 2100}, "this model's context length is 2048"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature must be in"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k must be -1"),
    (
        {"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
        "min_new_tokens (5) exceeds max_new_tokens (2)",
    ),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
]


@pytest.mark.parametrize(("body", "expected"), BAD_REQUESTS)
def test_bad_requests_are_refused_alike(
    engine: Engine, server: RunningServer, body: dict[str, Any], expected: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        engine.generate(
            body.get("text"), body.get("sampling_params"), input_ids=body.get("input_ids")
        )
    r = _server_generate(server, body)
    assert r.status_code == 400, r.text
    assert expected in str(err.value)
    assert r.json()["error"]["message"] == str(err.value)


@pytest.mark.parametrize(
    ("pooling", "labels", "expected"),
    [
        ("max", None, "pooling must be one of ('last', 'mean'), got 'max'"),
        (None, [], "label_token_ids must be token ids in"),
        (None, [3, 10**6], "label_token_ids must be token ids in"),
    ],
)
def test_pooling_and_labels_are_refused_alike(
    engine: Engine, pooling: str | None, labels: list[int] | None, expected: str
) -> None:
    """The server's early check (TokenizerManager, over this engine's EngineReady) and the
    engine's own (EngineCore.validate) give the same message."""
    params = SamplingParams(max_new_tokens=0)
    req = Req("r", [1, 2, 3], params)
    req.pooling, req.label_token_ids = pooling, labels
    with pytest.raises(InvalidRequest) as in_engine:
        engine.core.validate(req)
    client = EngineClient()
    try:
        tm = TokenizerManager(client, _ready(engine.core), engine.tokenizer)
        with pytest.raises(InvalidRequest) as in_server:
            tm.check([1, 2, 3], SamplingParams(max_new_tokens=0), pooling=pooling,
                     label_token_ids=labels)  # fmt: skip
    finally:
        client.shutdown()
    assert expected in str(in_engine.value)
    assert str(in_server.value) == str(in_engine.value)


def test_the_engine_goes_on_after_refusals(engine: Engine, server: RunningServer) -> None:
    ids = PROMPTS[0]
    offline = engine.generate(input_ids=ids, sampling_params=GREEDY)
    r = _server_generate(server, {"input_ids": ids, "sampling_params": GREEDY})
    assert r.status_code == 200 and r.json()["output_ids"] == offline["output_ids"]
