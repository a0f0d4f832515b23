"""bench/experiments/host_overhead.py --count-syncs: the TorchFunctionMode that counts the
calls a CUDA step would wait on or copy with, by the first stack frame inside the tree."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "experiments" / "host_overhead.py"

STEP = """import torch


def step(x):
    n = x.sum().item()
    ids = x.tolist()
    kept = x[x > 0]
    if x.any():
        pass
    dev = torch.tensor(ids, device="cpu")
    moved = x.to("cpu", non_blocking=True)
    rows = torch.nonzero(x)
    return n, kept, dev, moved, rows
"""


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def host_overhead() -> ModuleType:
    return load(SCRIPT, "bench_host_overhead")


def test_counts_sync_like_calls_by_site_in_the_tree(host_overhead, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "stepmod.py").write_text(STEP)
    step = load(tree / "stepmod.py", "stepmod_for_sync_count").step
    x = torch.tensor([0, 2, 3])
    counter = host_overhead.sync_counter(tree)
    with counter:
        step(x)
        step(x)
    x.sum().item()  # outside the mode: not counted
    by_kind = {kind: (site, c) for (kind, site), c in counter.counts.items() if site != "-"}
    assert by_kind["sync item"] == ("stepmod.py:5 step", 2)
    assert by_kind["sync tolist"] == ("stepmod.py:6 step", 2)
    assert by_kind["sync masked __getitem__"] == ("stepmod.py:7 step", 2)
    assert by_kind["sync __bool__"] == ("stepmod.py:8 step", 2)
    assert by_kind["h2d tensor device=cpu"] == ("stepmod.py:10 step", 2)
    assert by_kind["copy to dev=cpu nb=True pinned=False"] == ("stepmod.py:11 step", 2)
    assert by_kind["sync nonzero"] == ("stepmod.py:12 step", 2)
    total = counter.counts[("(every torch function call)", "-")]
    assert total >= 2 * 8  # every call, counted or not (sum, gt, any, ...)
