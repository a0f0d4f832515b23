"""The HiCache storage backends against their real libraries: a page set, found, read back
and cleared (file; NIXL's POSIX plugin and a Mooncake Store with its own master where those
are installed); and the page keys (a hash chain over the prefix)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from server_process import free_port

from radixserve.core.hicache_storage import GuardedStorage, HiCacheStorage, page_keys
from radixserve.plugins.hicache_storage import file, mooncake, nixl


def _round_trip(store: HiCacheStorage) -> None:
    page = torch.randn(16, 2, 2, 2, 8)
    assert not store.exists("00aa")
    assert store.set("00aa", page)
    assert store.exists("00aa")
    out = torch.zeros_like(page)
    assert store.get("00aa", out) and torch.equal(out, page)
    assert not store.get("00ab", out)
    assert not store.get("00aa", torch.zeros(3))  # another size is a miss, not garbage


def test_file_backend(tmp_path: Path) -> None:
    store = file.FileStorage({"dir": str(tmp_path)})
    _round_trip(store)
    store.clear()
    assert not store.exists("00aa")


def test_nixl_backend(tmp_path: Path) -> None:
    reason = nixl._available()
    if reason is not None:
        pytest.skip(reason)
    _round_trip(nixl.NixlStorage({"dir": str(tmp_path)}))


def test_mooncake_backend() -> None:
    beside = Path(sys.executable).parent / "mooncake_master"
    master = shutil.which("mooncake_master") or (str(beside) if beside.exists() else None)
    if mooncake._available() is not None or master is None:
        pytest.skip("mooncake (and its mooncake_master) is not installed")
    port = free_port()
    proc = subprocess.Popen([master, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        time.sleep(1.0)
        config: dict[str, Any] = {
            "master_server_address": f"127.0.0.1:{port}",
            "global_segment_size": 16 << 20,
            "local_buffer_size": 16 << 20,
        }
        _round_trip(mooncake.MooncakeStorage(config))
    finally:
        proc.terminate()
        proc.wait(10)


def test_guard_turns_failures_into_misses(tmp_path: Path) -> None:
    target = tmp_path / "gone"
    guarded = GuardedStorage(file.FileStorage({"dir": str(target)}), "file")
    shutil.rmtree(target)
    target.write_text("a file where the directory was")
    page = torch.ones(4)
    assert not guarded.set("00aa", page) and not guarded.exists("00aa")
    assert not guarded.get("00aa", page) and guarded.errors == 2


def test_page_keys_chain_the_prefix() -> None:
    a = page_keys(list(range(48)), 16, "m", None, 3)
    assert len(set(a)) == 3
    assert page_keys(list(range(32)), 16, "m", None, 2) == a[:2]
    changed = page_keys([99, *range(1, 48)], 16, "m", None, 3)
    assert all(x != y for x, y in zip(a, changed, strict=True))  # a change in page 0 moves all
    assert page_keys(list(range(48)), 16, "m", "salt", 3)[0] != a[0]
    assert page_keys(list(range(48)), 16, "other model", None, 3)[0] != a[0]


def test_page_keys_are_stable_across_versions() -> None:
    """Storage outlives the process: the keys of a prefix are fixed values (a change would
    orphan every page already stored), and no extra key hashes as an empty one."""
    assert page_keys([1, 2, 3, 4], 2, "m", None, 2) == [
        "55be28c97cd3f4e69b80aad7c2ef0d2cc8bce4b479e1c7a36bed998e0046d51c",
        "26ebc262c696f255cb107d3d323ffb777a2948ed6643f420221137c811bba799",
    ]
    assert page_keys([1, 2], 2, "m", "salt", 1) == [
        "275f57227c8eea4f386c02363beccd78550af7ad4c3cb52887c46247b60df1e6"
    ]
    assert page_keys([1, 2], 2, "m", "", 1) == page_keys([1, 2], 2, "m", None, 1)
    assert page_keys([1, 2, 3], 2, "m", None, 0) == []


class _Broken(HiCacheStorage):
    def exists(self, key: str) -> bool:
        raise OSError("exists " + key)

    def get(self, key: str, out: torch.Tensor) -> bool:
        raise OSError("get")

    def set(self, key: str, value: torch.Tensor) -> bool:
        raise OSError("set")

    def clear(self) -> None:
        raise OSError("clear")

    def close(self) -> None:
        raise OSError("close")


def test_guard_passes_a_working_backends_answers_through(tmp_path: Path) -> None:
    guarded = GuardedStorage(file.FileStorage({"dir": str(tmp_path)}), "file")
    page, out = torch.arange(8.0), torch.zeros(8)
    assert guarded.set("00aa", page) is True
    assert guarded.exists("00aa") is True and guarded.exists("00ab") is False
    assert guarded.get("00aa", out) is True and torch.equal(out, page)
    assert guarded.get("00ab", out) is False
    assert guarded.clear() is True and guarded.exists("00aa") is False
    guarded.close()
    assert guarded.errors == 0 and guarded.name == "file"


def test_guard_counts_every_failure_and_logs_the_first_of_each_hundred(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guarded = GuardedStorage(_Broken(), "broken")
    with caplog.at_level("WARNING", logger="radixserve.core.hicache_storage"):
        assert guarded.exists("k1") is False
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message == (
        "hicache storage broken: exists failed (OSError('exists k1')); recomputing instead "
        "(1 errors so far)"
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="radixserve.core.hicache_storage"):
        assert guarded.get("k", torch.zeros(1)) is False
        assert guarded.set("k", torch.zeros(1)) is False
        assert guarded.clear() is False
        guarded.close()  # swallowed
        for _ in range(95):
            guarded.exists("k")
        assert guarded.errors == 100 and caplog.records == []
        guarded.exists("k")
    assert guarded.errors == 101 and len(caplog.records) == 1
    assert "(101 errors so far)" in caplog.records[0].getMessage()


def test_guard_names_a_failed_clear_and_close(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="radixserve.core.hicache_storage"):
        GuardedStorage(_Broken(), "b").clear()
        GuardedStorage(_Broken(), "b").close()
    assert [r.getMessage() for r in caplog.records] == [
        "hicache storage b: clear failed (OSError('clear')); recomputing instead (1 errors so far)",
        "hicache storage b: close failed (OSError('close')); recomputing instead (1 errors so far)",
    ]
