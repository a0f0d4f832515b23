"""Pipeline parallelism on CPU (gloo, float32): greedy outputs at --pp-size 2 equal one
process's token for token, on a tiny random Llama of 5 layers (stages of 2 + 3, untied LM
head), a tiny random Qwen3 of 3 layers (1 + 2, LM head tied to the embedding, which the last
stage holds too) and a tiny random Qwen3-MoE, through the offline Engine; and on the Llama
through a real server on loopback at --pp-size 2 and at --tp-size 2 x --pp-size 2 (4 ranks).
The KV-leak check is on everywhere. Killing a stage's process mid-request (the 4-rank
server's rank 3) ends the server within 10 s with a non-zero exit and a message naming the
rank, and no rank is left behind.

Prompts prefill in chunks of 8 tokens mixed with decodes, and several requests run at once, so
the steps split into two micro-batches of disjoint requests."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from platform_choice import CPU_FLAGS, on_cpu
from server_process import RunningServer, start_server, stop_server, stream_in_background
from tiny_models import make_tiny_llama_dir, make_tiny_model_dir

from radixserve import Engine

HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it
DEATH_LIMIT_S = 10.0  # the requirement: a stage killed -> server gone

PROMPTS = [
    "The quick brown fox jumps over",
    "def add(a, b):\n    return",
    "Hello world! How are you today? I am",
    "One two three four five six seven eight nine ten eleven",
]
CACHED = ["The quick brown fox jumps over the lazy dog. The quick"]  # partly a cached prefix
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
SETTINGS: dict[str, Any] = {
    "dtype": "float32",
    "max_total_tokens": 4096,
    "chunked_prefill_size": 8,
    "debug_leak_check": True,
}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5 layers (stages 2 + 3), 6 query heads over 3 KV heads, intermediate 161 (TP: 80+81)."""
    return make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny-llama-5"),
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
        intermediate_size=161, num_hidden_layers=5, max_position_embeddings=2048,
    )  # fmt: skip


#: tiny random Qwen3s of 3 layers (stages 1 + 2): dense with the LM head tied to the
#: embedding (the last stage holds the embedding too), and MoE with a dense layer between
#: sparse ones (6 experts, 2 per token)
QWEN3 = {
    "qwen3-tied": ("qwen3", "Qwen3ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3-moe": ("qwen3_moe", "Qwen3MoeForCausalLM", {
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "norm_topk_prob": True, "mlp_only_layers": [1],
    }),
}  # fmt: skip


def _engine_outputs(model_dir: Path, **settings: Any) -> list[list[int]]:
    with Engine(str(model_dir), **on_cpu({**SETTINGS, **settings})) as engine:
        runner = engine.core.runner
        stage = runner.ranks.group.stage
        if stage is not None:  # rank 0's model and KV pool hold only the first stage's layers
            layers = stage.layers.size
            assert len(runner.model.layers) == layers and len(runner.kv_pool.k) == layers
            assert layers < runner.model_config.num_layers
        first = engine.generate(PROMPTS, GREEDY)
        second = engine.generate(CACHED, GREEDY)
        ranks = runner.ranks
    if stage is not None:  # every stage ran its layers on micro-batches
        assert len(ranks.pipeline_stats) == ranks.size
        assert all(s["busy_s"] > 0 for s in ranks.pipeline_stats)
    return [r["output_ids"] for r in first + second]


@pytest.fixture(scope="module")
def llama_reference(llama_dir: Path) -> list[list[int]]:
    outputs = _engine_outputs(llama_dir)
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in outputs)
    return outputs


def test_engine_pp2_equals_one_process(llama_dir: Path, llama_reference: list[list[int]]) -> None:
    # overlap scheduling on (as on GPUs): a step is launched before the last one is committed
    assert _engine_outputs(llama_dir, pp_size=2, enable_overlap_schedule=True) == llama_reference


@pytest.mark.parametrize("family", sorted(QWEN3))
def test_engine_pp2_of_qwen3_families_equals_one_process(family: str, tmp_path: Path) -> None:
    model_type, architecture, overrides = QWEN3[family]
    model_dir = make_tiny_model_dir(
        tmp_path, model_type, architecture, num_hidden_layers=3, max_position_embeddings=2048,
        **overrides,
    )  # fmt: skip
    assert _engine_outputs(model_dir, pp_size=2) == _engine_outputs(model_dir)


def _flags(settings: dict[str, Any]) -> list[str]:
    out = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


#: server configurations: name -> (tp_size, pp_size)
LAYOUTS = {"pp2": (1, 2), "tp2xpp2": (2, 2)}


class Servers:
    """One server per layout of LAYOUTS on the tiny Llama, started on first use and kept for
    the module (the kill test ends the tp2xpp2 one). Servers still running at the end must
    exit 0: with --debug-leak-check a KV leak fails the engine and the exit code."""

    def __init__(self, model_dir: Path, logs: Path) -> None:
        self.model_dir, self.logs = model_dir, logs
        self.running: dict[str, RunningServer] = {}

    def get(self, layout: str) -> RunningServer:
        if layout not in self.running:
            tp, pp = LAYOUTS[layout]
            args = [*CPU_FLAGS, "--model-path", str(self.model_dir), "--tp-size", str(tp),
                    "--pp-size", str(pp), *_flags(SETTINGS)]  # fmt: skip
            log = self.logs / f"{layout}.log"
            self.running[layout] = start_server(args, log, timeout=HANG_GUARD_S)
        return self.running[layout]

    def stop_all(self) -> None:
        codes = {name: (stop_server(s), s) for name, s in self.running.items()}
        for name, (code, server) in codes.items():
            assert code == 0, f"{name}: exit {code}\n{server.log()[-3000:]}"


@pytest.fixture(scope="module")
def servers(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    running = Servers(llama_dir, tmp_path_factory.mktemp("pp-server-logs"))
    yield running
    running.stop_all()


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_server_equals_one_process(
    layout: str, servers: Servers, llama_reference: list[list[int]]
) -> None:
    server = servers.get(layout)
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert (info["tp_size"], info["pp_size"]) == LAYOUTS[layout]
    out = []
    for prompts in (PROMPTS, CACHED):
        r = httpx.post(
            server.url + "/generate",
            json={"text": prompts, "sampling_params": GREEDY},
            timeout=HANG_GUARD_S,
        )
        assert r.status_code == 200, r.text
        out += [item["output_ids"] for item in r.json()]
    assert out == llama_reference


def _ranks(server: RunningServer) -> list[psutil.Process]:
    """The engine ranks, rank 0 first: the server's spawned children in start order."""
    children = psutil.Process(server.proc.pid).children()
    ranks = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    return sorted(ranks, key=lambda p: p.create_time())


@pytest.mark.slow
def test_killing_a_stage_ends_the_server(servers: Servers) -> None:
    """tp2 x pp2: rank 3 is the last stage's tensor-parallel rank 1."""
    server = servers.get("tp2xpp2")  # the equality test's, when it ran
    del servers.running["tp2xpp2"]  # it will not exit 0
    ranks = _ranks(server)
    assert len(ranks) == 4, [p.cmdline() for p in ranks]
    client, stream, first_chunk = stream_in_background(server.url, PROMPTS[0], 1900, HANG_GUARD_S)
    assert first_chunk.wait(HANG_GUARD_S)
    killed = time.monotonic()
    ranks[3].send_signal(signal.SIGKILL)  # in the middle of the request
    code = server.proc.wait(HANG_GUARD_S)
    elapsed = time.monotonic() - killed
    log = server.log()
    assert code != 0, log[-3000:]
    assert elapsed < DEATH_LIMIT_S, f"the server took {elapsed:.1f} s to exit:\n{log[-3000:]}"
    named = f"engine rank 3 (pipeline stage 1, tensor-parallel rank 1) (pid {ranks[3].pid})"
    assert f"{named} was killed by SIGKILL" in log, log[-3000:]
    # every process ends: no rank (waiting on the dead one) is left behind
    deadline = time.monotonic() + DEATH_LIMIT_S
    for rank in ranks:
        while rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"{rank.pid} outlived the server"
            time.sleep(0.05)
    client.join(HANG_GUARD_S)
    assert not client.is_alive()
    finals = [json.loads(s[6:]) for s in stream if s.startswith("data: {")]
    assert finals and "error" in finals[-1], stream[-3:]
