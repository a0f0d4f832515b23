"""The core's shape rules (DESIGN.md section 8): the three files of the step loop stay small and
free of capability words, no core file grows past 500 lines, no function in core/ or
entrypoints/ past 60 lines. A capability is a step strategy or its own module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOOP_FILES = ("core/scheduler.py", "core/engine_core.py", "core/model_runner.py")
CAPABILITY_WORDS = {
    "speculation": r"draft|verify|specul",
    "disaggregation": r"disagg|bootstrap|transfer",
    "parallelism": r"tp_rank|tp_size|parallel",
}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("name", LOOP_FILES)
def test_loop_files_stay_under_450_lines_without_capability_words(name: str) -> None:
    text = (REPO / name).read_text()
    assert lines(REPO / name) < 450, f"{name}: move a concern into its own module"
    for capability, words in CAPABILITY_WORDS.items():
        found = re.findall(words, text, re.IGNORECASE)
        assert not found, f"{name} names {capability} ({found}): make it a step strategy"


def test_no_core_file_over_500_lines() -> None:
    over = {str(p.relative_to(REPO)): n for p in (REPO / "core").rglob("*.py")
            if (n := lines(p)) > 500}  # fmt: skip
    assert not over


def test_no_function_over_60_lines_in_core_or_entrypoints() -> None:
    long = []
    for folder in ("core", "entrypoints"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    size = node.end_lineno - node.lineno + 1
                    if size > 60:
                        long.append(f"{path.relative_to(REPO)}:{node.name} ({size} lines)")
    assert not long
