"""/start_profile and /stop_profile run torch.profiler in the engine process and write a Chrome
trace; and /metrics without --enable-metrics. One tiny-model server for the module, started
without --enable-metrics and with SGLANG_TORCH_PROFILER_DIR set."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from server_process import (
    TINY_API_KEY,
    RunningServer,
    start_server,
    stop_server,
    tiny_server_args,
)

TIMEOUT = 120
# CPU ops a Llama forward runs; a trace of generation steps holds some of them
FORWARD_OPS = {"aten::linear", "aten::mm", "aten::addmm", "aten::embedding", "aten::matmul"}


@pytest.fixture(scope="module")
def profiled(
    tiny_long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningServer, Path]]:
    tmp = tmp_path_factory.mktemp("profile")
    env_dir = tmp / "from-env"
    args = [a for a in tiny_server_args(tiny_long_llama_dir) if a != "--enable-metrics"]
    env = {"SGLANG_TORCH_PROFILER_DIR": str(env_dir)}
    running = start_server(args, tmp / "server.log", TINY_API_KEY, timeout=300, env=env)
    yield running, env_dir
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{running.log()[-4000:]}"


def post(server: RunningServer, path: str, body: Any = None) -> requests.Response:
    return requests.post(server.url + path, json=body, headers=server.headers, timeout=TIMEOUT)


def generate(server: RunningServer, max_new_tokens: int) -> None:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    r = post(server, "/generate", {"text": "Hello there", "sampling_params": params})
    assert r.status_code == 200, r.text


def trace_events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    assert isinstance(trace["traceEvents"], list)
    return trace["traceEvents"]


def error(response: requests.Response) -> str:
    assert response.status_code == 400, response.text
    return response.json()["error"]["message"]


def test_profile_writes_a_chrome_trace_of_the_forward(
    profiled: tuple[RunningServer, Path],
) -> None:
    server, env_dir = profiled
    out = env_dir / "traces"  # a directory inside the profile directory, made for the trace
    start = post(server, "/start_profile", {"output_dir": str(out), "record_shapes": True})
    assert start.status_code == 200, start.text
    # the activities default to CPU and GPU; without a GPU only the CPU is recorded
    assert "profiling CPU" in start.json()["message"]
    generate(server, 4)
    generate(server, 4)
    stop = post(server, "/stop_profile")
    assert stop.status_code == 200, stop.text
    path = Path(stop.json()["trace_path"])
    assert path == Path(start.json()["trace_path"]) and path.parent == out
    assert path.name.endswith("-TP-0.trace.json.gz")  # SGLang's file name
    names = {e.get("name") for e in trace_events(path)}
    assert names & FORWARD_OPS, sorted(n for n in names if n)[:50]


def test_num_steps_stops_by_itself_in_the_env_directory(
    profiled: tuple[RunningServer, Path],
) -> None:
    server, env_dir = profiled
    # SGLang's bench client sends num_steps as a string
    body = {"num_steps": "3", "activities": ["CPU"], "profile_prefix": "bench"}
    start = post(server, "/start_profile", body)
    assert start.status_code == 200, start.text
    path = Path(start.json()["trace_path"])
    assert path.parent == env_dir and path.name.startswith("bench-")
    generate(server, 8)  # more steps than the profile's 3
    assert path.exists()  # written at the third step, before the request went on
    assert {e.get("name") for e in trace_events(path)} & FORWARD_OPS
    assert "not in progress" in error(post(server, "/stop_profile"))


def test_profile_errors(profiled: tuple[RunningServer, Path], tmp_path: Path) -> None:
    server, env_dir = profiled
    assert "not in progress" in error(post(server, "/stop_profile"))
    bad = [
        {"activities": ["MEM"]},
        {"activities": "CPU"},
        {"num_steps": 0},
        {"num_steps": "many"},
        {"output_dir": 5},
        {"start_step": 2},
        {"profile_by_stage": True},
        {"profile_prefix": "../x"},
        # a NUL made the engine's mkdir (or the trace's write) raise ValueError: the engine died
        {"output_dir": str(tmp_path / "a\x00b")},
        {"profile_id": "a\x00b", "num_steps": 1},
        {"profile_prefix": "a\nb"},
        {"num_steps": 2**70},  # past the engine messages' 64-bit integers: was a 500
        {"num_steps": str(2**70)},
    ]
    for body in bad:
        assert error(post(server, "/start_profile", body)), body
    assert "not in progress" in error(post(server, "/stop_profile"))  # none of them started
    generate(server, 2)  # and the engine still serves
    env_dir.mkdir(parents=True, exist_ok=True)
    blocked = env_dir / "a-file"
    blocked.write_text("")
    assert "output_dir" in error(post(server, "/start_profile", {"output_dir": str(blocked)}))
    assert error(post(server, "/start_profile", [1, 2]))
    first = post(server, "/start_profile", {"output_dir": "relative/sub"})
    assert Path(first.json()["trace_path"]).parent == env_dir / "relative" / "sub", first.text
    assert first.status_code == 200, first.text
    assert "already in progress" in error(post(server, "/start_profile"))
    assert post(server, "/stop_profile").status_code == 200
    # the refused second start changed nothing: the first profile's trace was written
    assert Path(first.json()["trace_path"]).exists()


def test_profile_output_stays_in_the_profile_directory(
    profiled: tuple[RunningServer, Path], tmp_path: Path
) -> None:
    """An output_dir outside the profile directory ($SGLANG_TORCH_PROFILER_DIR here) is a 400
    and nothing is written: not an absolute path elsewhere, not one that climbs out with ..,
    not a symlink inside that points out; and num_steps is capped."""
    server, env_dir = profiled
    env_dir.mkdir(parents=True, exist_ok=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (env_dir / "link-out").symlink_to(outside)
    for output_dir in [
        str(outside),
        "../outside",
        str(env_dir / ".." / "escaped"),
        "link-out",
        "/etc",
        "/",
    ]:
        message = error(post(server, "/start_profile", {"output_dir": output_dir}))
        assert "outside the profile directory" in message, (output_dir, message)
    assert "not in progress" in error(post(server, "/stop_profile"))  # none started
    assert list(outside.iterdir()) == []
    assert not (env_dir.parent / "escaped").exists()
    assert "positive integer up to" in error(
        post(server, "/start_profile", {"num_steps": 2147483648})
    )


def test_metrics_need_enable_metrics(profiled: tuple[RunningServer, Path]) -> None:
    server, _ = profiled
    r = requests.get(server.url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 404
    assert "--enable-metrics" in r.json()["error"]["message"]


def test_a_link_at_the_trace_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    """Was followed: a symlink planted in the profile directory at the trace's name got the
    trace written into whatever file it pointed to."""
    import torch

    from radixserve.entrypoints.profiler import EngineProfiler

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    root = tmp_path / "profiles"
    root.mkdir()
    (root / "p1-TP-0.trace.json.gz").symlink_to(victim)
    profiler = EngineProfiler()
    profiler.start(str(root), "p1-TP-0.trace.json.gz", ["CPU"])
    torch.ones(4) @ torch.ones(4)
    path = Path(profiler.stop())
    assert victim.read_text() == "keep me"
    assert not path.is_symlink() and json.loads(gzip.decompress(path.read_bytes()))
    assert [p.name for p in root.iterdir()] == ["p1-TP-0.trace.json.gz"]  # no temp file left


def test_a_directory_that_became_a_link_is_refused(tmp_path: Path) -> None:
    """The server checks output_dir as a real path inside the profile directory; a link put in
    its place before the engine creates it must not lead the trace elsewhere."""
    from radixserve.entrypoints.profiler import EngineProfiler, ProfilerError

    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "profiles"
    root.mkdir()
    (root / "run").symlink_to(outside)  # the checked path was <root>/run, a real directory
    with pytest.raises(ProfilerError, match="changed into a link"):
        EngineProfiler().start(str(root / "run"), "p-TP-0.trace.json.gz", ["CPU"])
    assert list(outside.iterdir()) == []
