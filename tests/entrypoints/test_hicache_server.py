"""The hierarchical cache through the real server: the file storage tier across a server
restart (the second server prefetches the prompt's pages from the files the first one wrote
while the request is queued), the per-tier counts in /server_info and /metrics, /flush_cache
and /clear_hicache_storage_backend."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import requests
from server_process import start_server, stop_server, tiny_server_args

pytestmark = pytest.mark.slow


def _generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    reply = requests.post(url + "/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_file_tier_survives_a_restart(tiny_llama_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    args = [
        *tiny_server_args(tiny_llama_dir), "--page-size", "16", "--enable-hierarchical-cache",
        "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", json.dumps({"dir": str(store)}),
    ]  # fmt: skip
    rng = random.Random(3)
    prompt = [rng.randrange(3, 360) for _ in range(100)]
    server = start_server(args, tmp_path / "first.log")
    try:
        first = _generate(server.url, prompt)
        assert first["meta_info"]["cached_tokens"] == 0
    finally:
        stop_server(server)
    assert len(list(store.glob("*.kv"))) == 6  # the prompt's whole pages
    # the second server prefetches the stored pages while the request is queued
    prefetch = ["--enable-hicache-prefetch", "--hicache-storage-prefetch-policy", "wait_complete"]
    server = start_server([*args, *prefetch], tmp_path / "second.log")
    try:
        second = _generate(server.url, prompt)
        assert second["meta_info"]["cached_tokens"] == 96
        assert second["output_ids"] == first["output_ids"]
        info = requests.get(server.url + "/server_info", timeout=30).json()
        assert info["hicache"]["prefetch_storage_tokens"] == 96
        assert info["hicache"]["storage_hit_tokens"] == 0  # admission read no storage itself
        metrics = requests.get(server.url + "/metrics", timeout=30).text
        assert "radixserve_hicache_storage_hit_tokens_total" in metrics
        assert "sglang:prefetched_tokens_total" in metrics
        assert requests.post(server.url + "/flush_cache", timeout=30).status_code == 200
        cleared = requests.post(server.url + "/clear_hicache_storage_backend", timeout=30)
        assert cleared.status_code == 200, cleared.text
        assert not list(store.glob("*.kv"))
        third = _generate(server.url, prompt)  # nothing left in any tier: computed again
        assert third["meta_info"]["cached_tokens"] == 0
        assert third["output_ids"] == first["output_ids"]
    finally:
        stop_server(server)


def test_clearing_storage_without_a_backend_is_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    args = [*tiny_server_args(tiny_llama_dir), "--enable-hierarchical-cache"]
    server = start_server(args, tmp_path / "server.log")
    try:
        reply = requests.post(server.url + "/clear_hicache_storage_backend", timeout=30)
        assert reply.status_code == 400 and "hicache-storage-backend" in reply.text
    finally:
        stop_server(server)
