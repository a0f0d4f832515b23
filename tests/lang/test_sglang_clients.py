"""SGLang's own clients, unchanged, against our server on the default model (SmolLM2): a user
switching from SGLang keeps them.

- ``sglang.bench_serving`` (pip's ``sglang``, installed without its dependencies by ``make
  setup``) with the backends sglang (/generate), sglang-oai (/v1/completions) and
  sglang-oai-chat (/v1/chat/completions) on the random-ids and generated-shared-prefix
  datasets: every request completes with exactly the tokens asked for. The OpenAI backends
  send the tokenizer path as the model name, as the client does when given ``--model PATH``.
- SGLang's frontend on ``sglang.RuntimeEndpoint``: gen, select, fork, regex, run_batch and
  stream programs; SGLang's own test programs (sglang/test/test_programs.py) where they are
  short enough for the CPU, small ones otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_process import RunningServer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="sglang is not installed (make setup installs it with --no-deps)",
    ),
]

# Runs the bench client with torchvision from .venv/sglang-bench (make setup; it says why).
BENCH_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "sglang_bench.py"
OUTPUT_LEN = 8
DATASETS = {
    # dataset name -> (its size arguments, number of requests they make)
    "random-ids": (
        ["--num-prompts", "4", "--random-input-len", "32", "--random-range-ratio", "1"]
        + ["--random-output-len", str(OUTPUT_LEN)],
        4,
    ),
    "generated-shared-prefix": (
        ["--gsp-num-groups", "2", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len"]
        + ["64", "--gsp-question-len", "16", "--gsp-output-len", str(OUTPUT_LEN)],
        4,
    ),
}
BACKENDS = ("sglang", "sglang-oai", "sglang-oai-chat")
BENCH_CASES = [(b, d) for b in BACKENDS for d in DATASETS]
CASE_IDS = [f"{b}-{d}" for b, d in BENCH_CASES]


@pytest.fixture(scope="module")
def bench_results(
    smollm2_server: RunningServer, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[tuple[str, str], dict[str, Any]], str]:
    """Every bench_serving run, in one client process: (results by case, the client's log)."""
    out = tmp_path_factory.mktemp("sglang-bench")
    runs = []
    for backend, dataset in BENCH_CASES:
        argv = ["--backend", backend, "--base-url", smollm2_server.url, "--disable-tqdm"]
        argv += ["--tokenizer", str(smollm2_dir), "--dataset-name", dataset, *DATASETS[dataset][0]]
        argv += ["--output-file", str(out / f"{backend}-{dataset}.jsonl"), "--output-details"]
        if backend != "sglang":
            # The sglang runs take the model name from /v1/models, as SGLang's docs run the
            # client; these send the path, as `--model PATH` does (issue 21's 404).
            argv += ["--model", str(smollm2_dir)]
        runs.append(argv)
    env = {
        **os.environ,
        # generated-shared-prefix caches its prompts under ~/.cache/sglang: a fresh one per run.
        "HOME": str(out),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, str(BENCH_SCRIPT), json.dumps(runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    results = {}
    for backend, dataset in BENCH_CASES:
        path = out / f"{backend}-{dataset}.jsonl"
        if path.exists():
            results[(backend, dataset)] = json.loads(path.read_text().splitlines()[-1])
    return results, log


@pytest.mark.parametrize(("backend", "dataset"), BENCH_CASES, ids=CASE_IDS)
def test_bench_serving_completes_every_request(
    bench_results: tuple[dict[tuple[str, str], dict[str, Any]], str], backend: str, dataset: str
) -> None:
    results, log = bench_results
    assert (backend, dataset) in results, log[-6000:]
    result = results[(backend, dataset)]
    num_requests = DATASETS[dataset][1]
    # bench_serving counts a request failed when it got no (full) answer; its error says why.
    assert result["errors"] == [""] * num_requests, result["errors"]
    assert result["completed"] == num_requests
    # ignore_eos is on by default: every request streams exactly the tokens it asked for.
    assert result["output_lens"] == [OUTPUT_LEN] * num_requests
    assert result["total_output_tokens"] == OUTPUT_LEN * num_requests
    assert all(n > 0 for n in result["input_lens"])
    assert all(len(itl) == OUTPUT_LEN - 1 for itl in result["itls"]), "not streamed per token"


@pytest.fixture(scope="module")
def sgl(smollm2_server: RunningServer) -> Iterator[Any]:
    """SGLang's frontend module with a RuntimeEndpoint on the server as its default backend."""
    import sglang  # installed but not importable is a failure: a dependency is missing

    sglang.set_default_backend(sglang.RuntimeEndpoint(smollm2_server.url))
    yield sglang
    sglang.set_default_backend(None)


def test_sglangs_own_select_program(sgl: Any) -> None:
    from sglang.test.test_programs import test_select

    test_select(check_answer=False)  # a 135M model's answers are not checked, only the choices


def test_sglangs_own_regex_program(sgl: Any) -> None:
    from sglang.test.test_programs import test_regex

    test_regex()


def test_regex_constrained_gen_fullmatches(sgl: Any) -> None:
    regex = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}"

    @sgl.function
    def address(s: Any) -> None:
        s += "Q: What is the IP address of the Google DNS servers?\nA: "
        s += sgl.gen("answer", max_tokens=24, temperature=0, regex=regex)

    answer = address.run()["answer"]
    assert re.fullmatch(regex, answer), answer


def test_fork_branches_each_generate(sgl: Any) -> None:
    @sgl.function
    def tips(s: Any, topic: str) -> None:
        s += f"Here are two tips for {topic}.\n"
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += f"Tip {i + 1}: " + sgl.gen("tip", max_tokens=8, temperature=0)
        forks.join()
        s += "Tip 1: " + forks[0]["tip"] + "\nTip 2: " + forks[1]["tip"]

    state = tips.run(topic="sleeping well")
    # Each branch wrote its own text, and join brought both back into the parent.
    text = state.text()
    assert text.startswith("Here are two tips for sleeping well.\nTip 1: ")
    tips_text = text.split("Tip 1: ", 1)[1].split("\nTip 2: ")
    assert len(tips_text) == 2 and all(t.strip() for t in tips_text), text


@pytest.fixture(scope="module")
def qa(sgl: Any) -> Any:
    @sgl.function
    def qa(s: Any, question: str) -> None:
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))

    return qa


def test_run_batch_returns_one_state_per_input(sgl: Any, qa: Any) -> None:
    questions = ["What is 2 + 2?", "Name a color.", "What is the capital of France?"]
    states = qa.run_batch([{"question": q} for q in questions])
    assert len(states) == len(questions)
    for question, state in zip(questions, states, strict=True):
        assert question in state.text()  # in input order
        assert state["answer"].strip()


def test_stream_yields_the_non_streamed_text(sgl: Any, qa: Any) -> None:
    streamed = qa.run(question="Name a color.", stream=True)
    chunks = list(streamed.text_iter("answer"))
    whole = qa.run(question="Name a color.")["answer"]
    assert len(chunks) > 1 and "".join(chunks) == whole
