"""Every third-party import of the package is declared in pyproject.toml for the install that
runs it: the base dependencies everywhere, plus the extra that a module belongs to (the
frontend's HTTP backends: ``lang``; grammar backends: ``grammar``; Triton code: ``gpu``).

Imports are read from the source (AST, so nothing is imported and the test takes well under a
second); an import inside ``try: ... except ImportError`` or ``if TYPE_CHECKING:`` is optional
and not counted. Import names map to distributions through the installed metadata
(``packages_distributions``), with a small table for when a package is absent.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("core", "entrypoints", "plugins", "lang")
TOP_MODULES = ("__init__.py", "launch_server.py")

# Modules that run only in an install with an extra (path prefix -> extra).
MODULE_EXTRAS = {
    "lang/": "lang",
    "plugins/grammar/xgrammar_backend.py": "grammar",
    "plugins/grammar/outlines_backend.py": "grammar",
    "plugins/grammar/llguidance_backend.py": "grammar",
    "plugins/attention/triton/": "gpu",
    "plugins/models/fused_ops.py": "gpu",
    "plugins/models/fused_moe.py": "gpu",
    "plugins/hardware/allreduce_norm.py": "gpu",
    "plugins/hardware/gemv.py": "gpu",
    "plugins/hardware/host_kv_copy.py": "gpu",
    "plugins/models/lora_triton.py": "gpu",
    "plugins/models/fp8_kernels.py": "gpu",
    "plugins/models/invariant_gemm.py": "gpu",
    "plugins/attention/flashinfer/": "flashinfer",
}
# Import name -> distribution where the two differ, for packages that may not be installed.
KNOWN_DISTRIBUTIONS = {
    "zmq": "pyzmq",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "flashinfer": "flashinfer-python",
}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {_normalize(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in requirements}


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return _requirement_names(project["dependencies"]), {
        name: _requirement_names(reqs) for name, reqs in extras.items()
    }


def _optional_nodes(tree: ast.AST) -> set[int]:
    """ids of import nodes guarded by ``except ImportError`` or ``if TYPE_CHECKING``."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        body: list[ast.stmt] = []
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            body = node.body
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body = node.body
        for stmt in body:
            guarded.update(id(n) for n in ast.walk(stmt))
    return guarded


def third_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    optional = _optional_nodes(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "radixserve"}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def distribution(import_name: str) -> str:
    dists = _installed().get(import_name)
    if dists:
        return _normalize(dists[0])
    return _normalize(KNOWN_DISTRIBUTIONS.get(import_name, import_name))


def modules() -> list[Path]:
    found = [p for d in PACKAGE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return found + [ROOT / m for m in TOP_MODULES]


def extra_of(path: Path) -> str | None:
    rel = path.relative_to(ROOT).as_posix()
    return next((e for prefix, e in MODULE_EXTRAS.items() if rel.startswith(prefix)), None)


def test_every_import_is_declared_for_its_install() -> None:
    base, extras = declared()
    missing = []
    for path in modules():
        extra = extra_of(path)
        allowed = base | (extras[extra] if extra else set())
        for name in sorted(third_party_imports(path)):
            dist = distribution(name)
            if dist not in allowed:
                install = f"base + [{extra}]" if extra else "base"
                missing.append(
                    f"{path.relative_to(ROOT)} imports {name} ({dist}): not in {install}"
                )
    assert not missing, "undeclared imports:\n" + "\n".join(missing)


def test_module_extras_name_real_extras_and_files() -> None:
    _, extras = declared()
    for prefix, extra in MODULE_EXTRAS.items():
        assert extra in extras, f"{prefix}: no extra named {extra!r} in pyproject.toml"
        assert (ROOT / prefix).exists(), prefix


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import requests", {"requests"}),
        ("try:\n    import orjson\nexcept ImportError:\n    orjson = None", set()),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import openai", set()),
        ("def f():\n    from xgrammar import testing", {"xgrammar"}),
        ("import json, os.path\nfrom . import x\nfrom radixserve.core import y", set()),
    ],
)
def test_the_scanner_sees_hard_imports_only(
    tmp_path: Path, source: str, expected: set[str]
) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert third_party_imports(path) == expected
