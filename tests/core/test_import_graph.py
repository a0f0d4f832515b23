"""The import graph of the files under core/ and plugins/: no cycle, type-only imports included,
and core/ imports nothing from plugins/, entrypoints/ or lang/ (nor the package root, which
re-exports them).

Every import statement of a file counts, wherever it is: module level, inside a function, under
``if TYPE_CHECKING:`` or in a ``try``; absolute (``radixserve.…``) and relative forms. An edge
goes from a file to the file of the module it names: for ``from M import a`` that is ``M/a.py``
when ``a`` is a submodule, else ``M``'s own file. Packages a dotted name passes through (whose
``__init__`` runs first) are not edges: a package's ``__init__`` that registers a lazy factory
importing its own submodule is not a cycle here. Imports through strings (``importlib``) are not
seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path

PACKAGE = "radixserve"
REPO = Path(__file__).resolve().parents[2]  # the repository root is the package ``radixserve``
SCANNED = ("core", "plugins")
#: what core/ may not import (the package root re-exports entrypoints and lang)
CORE_MAY_NOT_IMPORT = tuple(f"{PACKAGE}.{f}" for f in ("plugins", "entrypoints", "lang"))

Graph = dict[str, set[str]]


def module_files(root: Path, folders: Sequence[str]) -> dict[str, Path]:
    """{absolute module name: file} of every .py file under ``folders`` of ``root``."""
    out = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((PACKAGE, *parts))] = path
    return out


def imports_of(path: Path, module: str) -> Iterator[tuple[str, list[str]]]:
    """(the module an import statement names, the names it takes from it) for every import
    statement of ``path`` (module ``module``), in absolute form; ``import M`` takes nothing."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            yield source, [a.name for a in node.names]


def _file_of(name: str, files: dict[str, Path]) -> str | None:
    """The scanned module ``name`` is, or is inside (its longest scanned prefix)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in files:
            return prefix
    return None


def build_graph(root: Path, folders: Sequence[str] = SCANNED) -> tuple[Graph, list[str]]:
    """(module -> the scanned modules it imports, and one line per forbidden import of core/)."""
    files = module_files(root, folders)
    graph: Graph = {m: set() for m in files}
    forbidden = []
    core = f"{PACKAGE}.core"
    for module, path in files.items():
        for source, names in imports_of(path, module):
            submodules = [f"{source}.{n}" for n in names if f"{source}.{n}" in files]
            targets = set(submodules)
            if len(submodules) < len(names) or not names:
                targets.add(source)  # names defined in ``source`` itself
            for target in targets:
                found = _file_of(target, files)
                if found is not None and found != module:
                    graph[module].add(found)
                in_core = module == core or module.startswith(core + ".")
                if in_core and (target == PACKAGE or target.startswith(CORE_MAY_NOT_IMPORT)):
                    what = f"{', '.join(names)} from {source}" if names else source
                    forbidden.append(f"{path.relative_to(root)} imports {what}")
    return graph, sorted(set(forbidden))


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle (its modules in import order, the first repeated at the end) per back edge a
    depth-first walk meets; empty when the graph has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def _describe(cycles: list[list[str]], root: Path) -> str:
    files = module_files(root, SCANNED)
    return "\n".join(
        " -> ".join(str(files[m].relative_to(root)) if m in files else m for m in cycle)
        for cycle in cycles
    )


def test_no_import_cycle_between_the_files_of_core_and_plugins() -> None:
    graph, _ = build_graph(REPO)
    assert len(graph) > 50 and graph[f"{PACKAGE}.core.model_runner"]  # the scan saw the code
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (type-only imports count):\n" + _describe(cycles, REPO)


def test_core_imports_nothing_from_plugins_entrypoints_or_lang() -> None:
    _, forbidden = build_graph(REPO)
    assert not forbidden, "\n".join(forbidden)


# ---- the checker itself, on a planted tree ---------------------------------------------------


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


PLANTED = {
    "core/__init__.py": "",
    # a -> b inside a function, absolute form through the package
    "core/a.py": "def f():\n    from radixserve.core import b\n",
    # b -> c under TYPE_CHECKING, relative form
    "core/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"),
    # c -> a, relative form two levels up; a name of a (not a submodule)
    "core/c.py": "from ..core.a import f\nclass C: ...\n",
    # one way only: no cycle
    "core/d.py": "import radixserve.core.a as a\n",
    # core imports plugins (in a try block) and the package root
    "core/e.py": (
        "try:\n    from radixserve.plugins.p import g\nexcept ImportError:\n    pass\n"
        "from radixserve import Engine\n"
    ),
    "plugins/__init__.py": "",
    "plugins/p.py": "from radixserve.core.d import a\ndef g(): ...\n",
    # a package whose __init__ imports its own submodule lazily, a submodule importing a
    # sibling through the package's name: not a cycle (the package is only passed through)
    "plugins/k/__init__.py": "def load():\n    from radixserve.plugins.k.impl import X\n",
    "plugins/k/impl.py": "from radixserve.plugins.k.util import h\nclass X: ...\n",
    "plugins/k/util.py": "def h(): ...\n",
}


def test_the_checker_reports_a_planted_cycle_with_its_files(tmp_path: Path) -> None:
    _plant(tmp_path, PLANTED)
    graph, _ = build_graph(tmp_path)
    cycles = find_cycles(graph)
    assert [sorted(set(c)) for c in cycles] == [
        ["radixserve.core.a", "radixserve.core.b", "radixserve.core.c"]
    ]
    assert _describe(cycles, tmp_path) == "core/a.py -> core/b.py -> core/c.py -> core/a.py"
    assert graph["radixserve.core.d"] == {"radixserve.core.a"}
    assert graph["radixserve.plugins.k"] == {"radixserve.plugins.k.impl"}  # the lazy import
    assert graph["radixserve.plugins.k.impl"] == {"radixserve.plugins.k.util"}
    # the same submodule importing a name of its package's __init__ closes a cycle
    _plant(tmp_path, {"plugins/k/util.py": "from radixserve.plugins.k import load\n"})
    cycles = find_cycles(build_graph(tmp_path)[0])
    assert _describe(cycles, tmp_path).splitlines()[1] == (
        "plugins/k/__init__.py -> plugins/k/impl.py -> plugins/k/util.py -> plugins/k/__init__.py"
    )


def test_the_checker_reports_what_core_may_not_import(tmp_path: Path) -> None:
    _plant(tmp_path, PLANTED)
    _, forbidden = build_graph(tmp_path)
    assert forbidden == [
        "core/e.py imports Engine from radixserve",
        "core/e.py imports g from radixserve.plugins.p",
    ]
