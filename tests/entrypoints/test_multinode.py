"""Multi-node launch on loopback (CPU, gloo, float32): two `radixserve serve` launches with
``--nnodes 2 --node-rank 0/1 --dist-init-addr`` make one --tp-size 2 server whose greedy outputs
equal --tp-size 1's token for token (KV-leak check on: stopping node 0 stops both with exit
0); killing node 1's rank mid-request ends both launches with a non-zero exit within 10 s,
each naming the rank, and so does killing node 1's launch outright (node 0 names it).

The reference is the offline Engine at --tp-size 1 in this process."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from platform_choice import CPU_FLAGS, on_cpu
from server_process import (
    RunningServer,
    free_port,
    start_server,
    stop_server,
    stream_in_background,
)
from tiny_models import make_tiny_llama_dir

from radixserve import Engine

HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it
DEATH_LIMIT_S = 10.0  # the requirement: a dead node ends every node within 10 s
PROMPTS = ["The quick brown fox jumps over", "def add(a, b):\n    return", "Hello world! I am"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
FLAGS = ["--dtype", "float32", "--max-total-tokens", "4096", "--chunked-prefill-size", "8",
         "--debug-leak-check", "--tp-size", "2"]  # fmt: skip


def _free_pair() -> int:
    """A loopback port whose next port is free too (the TCP store and the node watch)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(
        tmp_path_factory.mktemp("tiny-mnode"),
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
        intermediate_size=161,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    settings = {"dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 8}
    with Engine(str(model_dir), **on_cpu(settings)) as engine:
        return [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)]


class TwoNodes:
    def __init__(self, model_dir: Path, logs: Path) -> None:
        addr = f"127.0.0.1:{_free_pair()}"
        common = [*CPU_FLAGS, "--model-path", str(model_dir), *FLAGS,
                  "--nnodes", "2", "--dist-init-addr", addr]  # fmt: skip
        self.follower_log = logs / "node1.log"
        cmd = [sys.executable, "-m", "radixserve.launch_server", *common, "--node-rank", "1"]
        with open(self.follower_log, "wb") as log:
            self.follower = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.leader: RunningServer = start_server(
                [*common, "--node-rank", "0"], logs / "node0.log", timeout=HANG_GUARD_S
            )
        except BaseException:
            self.follower.kill()
            self.follower.wait()
            raise

    def follower_text(self) -> str:
        return self.follower_log.read_text(errors="replace")

    def kill(self) -> None:
        for proc in (self.leader.proc, self.follower):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def two_nodes(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    nodes = TwoNodes(model_dir, tmp_path_factory.mktemp("mnode-logs"))
    yield nodes
    nodes.kill()


def test_two_node_tp2_equals_tp1(two_nodes: TwoNodes, reference: list[list[int]]) -> None:
    assert "follows node 0" in two_nodes.follower_text()
    assert "no HTTP server" in two_nodes.follower_text()
    body = {"text": PROMPTS, "sampling_params": GREEDY}
    r = httpx.post(two_nodes.leader.url + "/generate", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 200, r.text
    assert [item["output_ids"] for item in r.json()] == reference
    info = httpx.get(two_nodes.leader.url + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == 2 and info["nnodes"] == 2
    # an orderly stop of node 0 stops node 1 too; both exit 0 (a KV leak would fail node 0)
    assert stop_server(two_nodes.leader) == 0, two_nodes.leader.log()[-3000:]
    assert two_nodes.follower.wait(HANG_GUARD_S) == 0, two_nodes.follower_text()[-3000:]
    assert "node 0 stopped the group" in two_nodes.follower_text()


def test_killing_node_1_ends_both_nodes(two_nodes: TwoNodes) -> None:
    follower = psutil.Process(two_nodes.follower.pid)
    ranks = [c for c in follower.children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(ranks) == 1, [c.cmdline() for c in follower.children()]
    # long enough to be in flight whatever the machine's speed
    client, _, started = stream_in_background(two_nodes.leader.url, PROMPTS[0], 2000, HANG_GUARD_S)
    assert started.wait(HANG_GUARD_S)
    killed = time.monotonic()
    ranks[0].send_signal(signal.SIGKILL)
    codes = {}
    for name, proc in (("node 0", two_nodes.leader.proc), ("node 1", two_nodes.follower)):
        codes[name] = proc.wait(HANG_GUARD_S)
        elapsed = time.monotonic() - killed
        assert elapsed < DEATH_LIMIT_S, f"{name} took {elapsed:.1f} s to exit"
    why = f"tensor-parallel rank 1 (pid {ranks[0].pid}) was killed by SIGKILL"
    assert codes["node 0"] != 0 and codes["node 1"] != 0, codes
    assert why in two_nodes.leader.log(), two_nodes.leader.log()[-3000:]
    assert why in two_nodes.follower_text(), two_nodes.follower_text()[-3000:]
    client.join(HANG_GUARD_S)
    assert stop_server(two_nodes.leader) == codes["node 0"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tp_size": 2, "nnodes": 2}, r"needs dist_init_addr host:port"),
        ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "127.0.0.1:9"}, r"does not divide"),
        ({"tp_size": 2, "nnodes": 2, "node_rank": 2}, r"0 <= node_rank < nnodes"),
        ({"tp_size": 4, "ep_size": 2}, r"ep_size=2 must be 1 or equal tp_size=4"),
    ],
)
def test_bad_node_settings_are_refused(settings: dict[str, object], message: str) -> None:
    from radixserve.core.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match=message):
        EngineConfig(**settings)  # type: ignore[arg-type]


def test_the_offline_engine_refuses_several_nodes(model_dir: Path) -> None:
    from radixserve.core.config import ConfigError

    settings = {"tp_size": 2, "nnodes": 2, "dist_init_addr": "127.0.0.1:9"}
    with pytest.raises(ConfigError, match="one launch per node"):
        Engine(str(model_dir), **on_cpu(settings))


@pytest.mark.slow
def test_a_node_killed_outright_ends_node_0(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Node 1's launch SIGKILLed mid-request (no word from it): node 0 exits non-zero within
    10 s naming node 1 and its rank; node 1's rank follows its launch."""
    nodes = TwoNodes(model_dir, tmp_path_factory.mktemp("mnode-kill-logs"))
    try:
        follower = psutil.Process(nodes.follower.pid)
        rank = next(c for c in follower.children() if "spawn_main" in " ".join(c.cmdline()))
        body = {"text": PROMPTS[0], "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}  # fmt: skip
        with httpx.stream("POST", nodes.leader.url + "/generate", json=body,
                          timeout=HANG_GUARD_S) as r:  # fmt: skip
            next(r.iter_lines())  # in flight
            killed = time.monotonic()
            nodes.follower.send_signal(signal.SIGKILL)
            code = nodes.leader.proc.wait(HANG_GUARD_S)
        elapsed = time.monotonic() - killed
        assert code != 0 and elapsed < DEATH_LIMIT_S, (code, elapsed)
        log = nodes.leader.log()
        assert "node 1 (tensor-parallel rank 1) is gone" in log, log[-3000:]
        rank.wait(HANG_GUARD_S)  # it does not outlive its launch
    finally:
        nodes.kill()


@pytest.mark.slow
def test_node_0_killed_outright_ends_node_1(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Node 0's server SIGKILLed: node 1 exits non-zero within 10 s naming node 0 (its engine
    may still stop the ranks on its way out: without node 0's word that is no orderly stop)."""
    nodes = TwoNodes(model_dir, tmp_path_factory.mktemp("mnode-kill0-logs"))
    try:
        killed = time.monotonic()
        nodes.leader.proc.send_signal(signal.SIGKILL)
        code = nodes.follower.wait(HANG_GUARD_S)
        elapsed = time.monotonic() - killed
        assert code != 0 and elapsed < DEATH_LIMIT_S, (code, elapsed, nodes.follower_text())
        assert "node 0 (tensor-parallel rank 0, the server)" in nodes.follower_text()
    finally:
        nodes.kill()
