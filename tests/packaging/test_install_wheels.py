"""tools/install_wheels.py's choices for the lent GPU machine: what is missing is installed, the
image's torch stack is kept, and a replaced wheel brings its carried requirements."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "install_wheels.py"


@pytest.fixture()
def tool(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("install_wheels", TOOL)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "install_wheels", module)
    spec.loader.exec_module(module)
    machine = {"transformers": "5.17.0", "huggingface-hub": "1.3.0", "torch": "2.11.0"}
    monkeypatch.setattr(module, "installed", machine.get)
    return module


def wheels(tool, **requires: list[str]) -> dict:
    versions = {"transformers": "5.25.0", "huggingface-hub": "2.4.0", "kernels": "0.19.1",
                "torch": "2.13.0", "fastapi": "0.165.0"}  # fmt: skip
    return {n: tool.Wheel(Path(f"{n}.whl"), n, versions[n], r) for n, r in requires.items()}


def test_missing_installed_protected_kept(tool) -> None:
    carried = wheels(tool, fastapi=[], transformers=[], torch=[])
    chosen, warnings = tool.choose(carried, ["transformers>=5.25", "torch>=2.13"])
    assert set(chosen) == {"fastapi"}
    assert any("transformers>=5.25" in w for w in warnings)
    assert any("torch>=2.13" in w for w in warnings)


def test_replaced_wheel_brings_its_requirements_but_never_torch(tool) -> None:
    carried = wheels(
        tool,
        transformers=["huggingface-hub>=2.4.0", "kernels>=0.19.1", "torch>=2.13"],
        **{"huggingface-hub": [], "kernels": ["huggingface-hub>=1.32.0"], "torch": []},
    )
    chosen, warnings = tool.choose(carried, [], ("transformers",))
    assert set(chosen) == {"transformers", "huggingface-hub", "kernels"}
    assert "--replace" in chosen["transformers"]
    assert "too old" in chosen["huggingface-hub"]
    assert warnings == ["transformers needs torch>=2.13; found 2.11.0"]
