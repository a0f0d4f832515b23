"""A SmolLM2 server shared by the frontend's live tests, and the example programs."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from server_process import RunningServer, start_server, stop_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "frontend"


@pytest.fixture(scope="session")
def smollm2_server(
    smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    # smollm2_dir converts (and caches) the GGUF first; the server then finds the cached copy.
    log = tmp_path_factory.mktemp("lang-smollm2-server") / "server.log"
    running = start_server(["--max-total-tokens", "8192"], log, timeout=600)
    yield running
    assert stop_server(running) == 0, running.log()[-4000:]


@pytest.fixture(scope="session")
def load_example() -> Callable[[str], ModuleType]:
    """Import examples/frontend/<name>.py (its folder goes on sys.path for _common)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(
            f"frontend_example_{name}", EXAMPLES / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
