"""A tensor-parallel rank that dies while it starts fails the engine at once, with the likely
cause: spawned ranks re-import the main module, and a script that creates
``Engine(tp_size=2)`` at its top level (no ``if __name__ == "__main__":``) starts the engine
again in every rank, which dies. Before, rank 0 waited in the rendezvous for the whole
watchdog timeout (5 minutes) and raised RuntimeError('Wait timeout') without a word of why.

Each script runs in a fresh interpreter from a temporary directory, on CPU (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Only stops a hung test: the old behaviour waited the 300 s watchdog before failing, and the
# engine's watchdog is left at its default in the scripts so that this is what they would do.
HANG_GUARD_S = 200

UNGUARDED = """
from radixserve import Engine

engine = Engine({model!r}, plugins=["hardware=cpu"], tp_size=2, dtype="float32",
                max_total_tokens=512)
print("OUTPUT", engine.generate("Hello", {{"max_new_tokens": 2}})["output_ids"])
engine.shutdown()
"""


def _run(script: Path, cwd: Path, stdin: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-" if stdin else str(script)], cwd=cwd, capture_output=True,
        text=True, timeout=HANG_GUARD_S, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        input=script.read_text() if stdin else "",
    )  # fmt: skip


@pytest.mark.parametrize("stdin", [False, True], ids=["script", "stdin"])
def test_an_unguarded_main_module_fails_fast_and_says_why(
    tiny_llama_dir: Path, tmp_path: Path, stdin: bool
) -> None:
    """From a file the ranks run the script's top level again; from stdin they cannot find
    the main module's file ('<stdin>'). Either way rank 1 dies before it starts."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(model=str(tiny_llama_dir)))
    result = _run(script, tmp_path, stdin)
    assert result.returncode != 0, result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: tensor-parallel rank 1 (pid "), result.stderr[-3000:]
    assert "exited with code 1 before it started" in last
    assert 'if __name__ == "__main__":' in last
    assert "Wait timeout" not in result.stderr
    assert "OUTPUT" not in result.stdout


@pytest.mark.slow
def test_the_same_script_guarded_runs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The remedy the message names works: the same code under the guard generates."""
    body = textwrap.indent(UNGUARDED.format(model=str(tiny_llama_dir)).strip(), "    ")
    script = tmp_path / "guarded.py"
    script.write_text(f'if __name__ == "__main__":\n{body}\n')
    result = _run(script, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OUTPUT [" in result.stdout
