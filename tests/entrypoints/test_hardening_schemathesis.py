"""Schemathesis against the server's own /openapi.json: every operation, positive and negative
modes, no 5xx and every documented response matching its schema.

Up to 100 examples per operation and mode, schemathesis' and hypothesis' own default
(RADIXSERVE_FUZZ_EXAMPLES raises or lowers it): the two modes take about 20 s on one loaded
core; 500 took about 100 s there, nearly all of it in the six operations with a body schema
(embeddings, score, weights from disk, completions, chat completions, a model by name). The
others take a single example: they declare no parameters or body in /openapi.json (the native
routes read their raw body; the field-wise fuzz of /generate, /tokenize and /abort_request is
test_hardening_fuzz.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hardening import own_server
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance
from server_process import RunningServer

EXAMPLES = int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", "100"))
# Routes whose job is to disturb the server (flushing, aborting) still run: none may answer 5xx.
# Profiling writes a trace file per start/stop pair (test_profile.py checks its errors).
SKIP = {"/metrics", "/start_profile", "/stop_profile"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzzed(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    # Short requests: positive examples are valid and would otherwise decode up to the context.
    flags = ["--request-timeout", "0.5", "--max-n", "2", "--max-queued-requests", "64"]
    with own_server(tiny_long_llama_dir, log, *flags) as running:
        yield running


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_openapi_fuzz_no_5xx_and_schema_conformance(
    fuzzed: RunningServer, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(
        fuzzed.url + "/openapi.json", headers=fuzzed.headers, timeout=30
    )
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.path not in SKIP]
    assert len(operations) >= 10, [op.label for op in operations]
    checks = [not_a_server_error, response_schema_conformance]
    tested: list[str] = []
    for op in operations:

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        def run(case: schemathesis.Case) -> None:
            response = case.call(base_url=fuzzed.url, headers=fuzzed.headers, timeout=30)
            case.validate_response(response, checks=checks)

        try:
            run()
        except Unsatisfiable:
            # An operation with no parameters or body has no invalid input to generate.
            assert mode == GenerationMode.NEGATIVE, op.label
            continue
        tested.append(op.label)
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= set(tested), tested
    assert fuzzed.proc.poll() is None, fuzzed.log()[-3000:]
