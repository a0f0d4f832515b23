"""Test side of ``radixserve_test_models``: install the plugin for a server subprocess, and the
gate that holds a request inside its model step until the test lets it go."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from radixserve_test_models import GATE_DIR_ENV, GATE_POSITION, GATE_TOKEN, PACE_S, STALL_TOKEN

__all__ = [
    "GATE_TOKEN", "PACE_S", "STALL_TOKEN", "Gate", "gated_prompt", "install_plugin",
    "install_test_models",
]  # fmt: skip


def install_plugin(site: Path, module: str) -> dict[str, str]:
    """Install ``tests/support/<module>.py`` into ``site`` as a package whose entry point in the
    ``radixserve`` group names it, the way a third-party plugin is installed; return the
    environment a server subprocess needs to find it."""
    site.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).with_name(f"{module}.py"), site)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    dist = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[radixserve]\n{module} = {module}\n")
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def install_test_models(site: Path) -> dict[str, str]:
    """Install ``radixserve_test_models`` (StallingLlama, GatedLlama) for a server."""
    return install_plugin(site, "radixserve_test_models")


def gated_prompt(first: int = 5, second: int = 6) -> list[int]:
    """A prompt that GatedLlama holds while the gate is closed: the gate token at its position,
    last, so that even a prompt served from the prefix cache runs it in a step."""
    prompt = [first, second, GATE_TOKEN]
    assert prompt.index(GATE_TOKEN) == GATE_POSITION
    return prompt


class Gate:
    """While closed, every prefill of a ``gated_prompt`` waits inside the model's forward."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path

    @property
    def env(self) -> dict[str, str]:
        return {GATE_DIR_ENV: str(self.path)}

    def close(self) -> None:
        (self.path / "closed").touch()

    def open(self) -> None:
        (self.path / "closed").unlink(missing_ok=True)

    def pace(self, on: bool = True) -> None:
        """While paced, every model step lasts at least PACE_S (a lower bound, not a speed)."""
        if on:
            (self.path / "paced").touch()
        else:
            (self.path / "paced").unlink(missing_ok=True)

    def entered(self) -> int:
        """How many model steps have waited at the gate so far."""
        entered = self.path / "entered"
        return len(entered.read_text().splitlines()) if entered.exists() else 0

    def wait_entered(self, count: int = 1, hang_guard_s: float = 120.0) -> None:
        """Wait until ``count`` steps have reached the gate (the bound only stops a hung test)."""
        deadline = time.monotonic() + hang_guard_s
        while self.entered() < count:
            assert time.monotonic() < deadline, f"no model step reached the gate at {self.path}"
            time.sleep(0.02)
