"""The server prints SGLang's ready line as well as its own, and means it: a script written for
SGLang that waits for "The server is fired up and ready to roll!" and then sends a request gets
its answer (a real server on loopback, the tiny model)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from platform_choice import CPU_FLAGS
from server_process import free_port

# Word for word what SGLang prints (scripts grep for it): not imported from the server.
SGLANG_READY = "The server is fired up and ready to roll!"
HANG_GUARD_S = 300  # only stops a hung test; no outcome depends on it


def test_a_script_waiting_for_sglangs_ready_line_is_served(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1",
           "--port", str(port), "--model-path", str(tiny_llama_dir), *CPU_FLAGS]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: list[str] = []
    guard = threading.Timer(HANG_GUARD_S, proc.kill)
    guard.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # as a script would: read until the line, nothing else
            lines.append(line.rstrip("\n"))
            if line.strip() == SGLANG_READY:
                break
        assert lines and lines[-1] == SGLANG_READY, "\n".join(lines[-40:])
        reply = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            json={"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["meta_info"]["completion_tokens"] == 3
        # radixserve's own line is still there, just before
        assert lines[-2] == f"radixserve ready at http://127.0.0.1:{port}"
        # the banner names the numerics the engine resolved (an HF directory: exact float32)
        banner = next(line for line in lines if line.startswith("radixserve: model "))
        assert banner.endswith("| float32 weights, float32 KV, eager decode"), banner
    finally:
        guard.cancel()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
