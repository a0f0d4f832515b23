"""Tensor parallelism on CPU (gloo, 2 ranks, float32): greedy outputs at --tp-size 2 equal
--tp-size 1 token for token, through a real server on loopback and through the offline Engine,
on SmolLM2 (9 query heads over 3 KV heads) and on a tiny random Llama with 3 KV heads (KV heads
split 1 + 2, an uneven MLP split); the KV-leak check is on everywhere. Killing one rank ends
the server with a clear one-line error within 5 s: /health answers 503, the exit is non-zero
and no rank is left behind.

The reference is the offline Engine at --tp-size 1 in this process; each TP run starts its
ranks as separate processes."""

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
from tiny_models import make_tiny_llama_dir

from radixserve import Engine

HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it
DEATH_LIMIT_S = 5.0  # the requirement: kill of one rank -> server gone

PROMPTS = [
    "The quick brown fox jumps over",
    "def add(a, b):\n    return",
    "Hello world! How are you today? I am",
]
# A second round that shares the first prompt's prefix: served partly from the radix cache.
CACHED = ["The quick brown fox jumps over the lazy dog. The quick"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
# Chunks of 8 tokens: prompts prefill over several steps, mixed with decodes.
SETTINGS: dict[str, Any] = {
    "dtype": "float32",
    "max_total_tokens": 4096,
    "chunked_prefill_size": 8,
    "debug_leak_check": True,
}


def _flags(settings: dict[str, Any]) -> list[str]:
    out = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


@pytest.fixture(scope="module")
def tiny3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query heads over 3 KV heads (2 ranks: 2+1 and 4+2 heads), intermediate 161 (80+81)."""
    return make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny-3kv"),
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
        intermediate_size=161, max_position_embeddings=2048,
    )  # fmt: skip


def _engine_outputs(model_dir: Path, **settings: Any) -> list[list[int]]:
    with Engine(str(model_dir), **on_cpu({**SETTINGS, **settings})) as engine:
        runner = engine.core.runner
        if runner.ranks.size > 1:  # rank 0's KV pool holds only its KV heads (1 of 3 here)
            mc = runner.model_config
            assert mc.num_kv_heads == 3 and runner.kv_pool.k[0].shape[1] == 1
        first = engine.generate(PROMPTS, GREEDY)
        second = engine.generate(CACHED, GREEDY)
    return [r["output_ids"] for r in first + second]


def _server_outputs(server: RunningServer) -> list[list[int]]:
    out = []
    for prompts in (PROMPTS, CACHED):
        r = httpx.post(
            server.url + "/generate",
            json={"text": prompts, "sampling_params": GREEDY},
            timeout=HANG_GUARD_S,
        )
        assert r.status_code == 200, r.text
        out += [item["output_ids"] for item in r.json()]
    return out


@pytest.fixture(scope="module", params=["tiny3", "smollm2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("tiny3_dir" if request.param == "tiny3" else "smollm2_dir")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    outputs = _engine_outputs(model_dir, tp_size=1)
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in outputs)
    return outputs


def test_engine_tp2_equals_tp1(model_dir: Path, reference: list[list[int]]) -> None:
    # overlap scheduling on: step N+1 is broadcast before step N's tokens are committed
    assert _engine_outputs(model_dir, tp_size=2, enable_overlap_schedule=True) == reference


def test_a_start_refused_after_joining_leaves_no_group_behind(tiny3_dir: Path) -> None:
    """Speculation with draft trees is refused with TP once the group is up: the failed engine
    leaves the group and gives the process its torch threads back (a rank took its share), so
    this process can go on and start another engine."""
    import torch

    from radixserve.core.config import ConfigError

    threads = torch.get_num_threads()
    settings = on_cpu({**SETTINGS, "tp_size": 2, "speculative_algorithm": "ngram",
                       "speculative_eagle_topk": 2})  # fmt: skip
    refused = r"speculative decoding \(ngram, speculative_eagle_topk=2\) does not run with"
    with pytest.raises(ConfigError, match=refused):
        Engine(str(tiny3_dir), **settings)
    assert not torch.distributed.is_initialized()
    assert torch.get_num_threads() == threads


class TP2Servers:
    """One --tp-size 2 server per model, started on first use and kept for the module (the
    kill test ends the tiny model's). Servers still running at the end must exit 0: with
    --debug-leak-check a KV leak fails the engine and the exit code."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: dict[Path, RunningServer] = {}

    def get(self, model_dir: Path) -> RunningServer:
        if model_dir not in self.running:
            args = [*CPU_FLAGS, "--model-path", str(model_dir), "--tp-size", "2",
                    *_flags(SETTINGS)]  # fmt: skip
            log = self.logs / f"{model_dir.name}.log"
            self.running[model_dir] = start_server(args, log, timeout=HANG_GUARD_S)
        return self.running[model_dir]

    def stop_all(self) -> None:
        codes = {d.name: (stop_server(s), s) for d, s in self.running.items()}
        for name, (code, server) in codes.items():
            assert code == 0, f"{name}: exit {code}\n{server.log()[-3000:]}"


@pytest.fixture(scope="module")
def tp2_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TP2Servers]:
    servers = TP2Servers(tmp_path_factory.mktemp("tp-server-logs"))
    yield servers
    servers.stop_all()


def test_server_tp2_equals_tp1(
    model_dir: Path, reference: list[list[int]], tp2_servers: TP2Servers
) -> None:
    server = tp2_servers.get(model_dir)
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == 2
    assert _server_outputs(server) == reference


def _ranks(server: RunningServer) -> list[psutil.Process]:
    """The engine ranks, rank 0 first: the server's spawned children in start order."""
    children = psutil.Process(server.proc.pid).children()
    ranks = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
    return sorted(ranks, key=lambda p: p.create_time())


def test_killing_one_rank_ends_the_server(tiny3_dir: Path, tp2_servers: TP2Servers) -> None:
    tp_server = tp2_servers.get(tiny3_dir)  # the equality test's, when it ran
    del tp2_servers.running[tiny3_dir]  # it will not exit 0
    ranks = _ranks(tp_server)
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    # long enough to be in flight whatever the machine's speed
    client, stream, first_chunk = stream_in_background(
        tp_server.url, PROMPTS[0], 2000, HANG_GUARD_S
    )
    assert first_chunk.wait(HANG_GUARD_S)
    killed = time.monotonic()
    ranks[1].send_signal(signal.SIGKILL)
    health = []
    while tp_server.proc.poll() is None and time.monotonic() - killed < HANG_GUARD_S:
        try:
            health.append(httpx.get(tp_server.url + "/health", timeout=2).status_code)
        except httpx.HTTPError:
            pass  # the server has closed its listener on the way out
        time.sleep(0.05)
    code = tp_server.proc.wait(HANG_GUARD_S - (time.monotonic() - killed))
    elapsed = time.monotonic() - killed
    log = tp_server.log()
    assert code != 0, log[-3000:]
    assert elapsed < DEATH_LIMIT_S, f"the server took {elapsed:.1f} s to exit:\n{log[-3000:]}"
    assert 503 in health, health
    assert f"tensor-parallel rank 1 (pid {ranks[1].pid}) was killed by SIGKILL" in log, log[-3000:]
    assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE
    client.join(HANG_GUARD_S)
    assert not client.is_alive()
    # the request in flight did not end as if nothing happened
    finals = [json.loads(s[6:]) for s in stream if s.startswith("data: {")]
    assert finals and "error" in finals[-1], stream[-3:]
