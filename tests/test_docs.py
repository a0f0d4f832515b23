"""The docs site: generated pages are current, the site builds with no warning, the pages'
marked code examples run, and the README, bench/ and dashboard match what they describe.

A fenced block on a docs page preceded by ``<!-- example: offline -->`` runs as is; one preceded
by ``<!-- example: server -->`` runs against a real server this module starts on loopback with
the default model (its ``127.0.0.1:30000`` is rewritten to the server's port). Python blocks run
with this interpreter, bash blocks with ``bash -euo pipefail``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from server_process import RunningServer, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLE_TIMEOUT_S = 300
DEFAULT_URL = "127.0.0.1:30000"
_EXAMPLE = re.compile(
    r"^<!-- example: (?P<kind>offline|server) -->\n```(?P<lang>\w+)\n(?P<code>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)


class Example(NamedTuple):
    page: str
    line: int
    kind: str
    lang: str
    code: str


def collect_examples() -> list[Example]:
    examples = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for m in _EXAMPLE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            rel = str(page.relative_to(DOCS))
            examples.append(Example(rel, line, m["kind"], m["lang"], m["code"]))
    return examples


EXAMPLES = collect_examples()


def run_example(example: Example, url: str = DEFAULT_URL) -> subprocess.CompletedProcess[str]:
    code = example.code.replace(DEFAULT_URL, url)
    if example.lang == "python":
        cmd = [sys.executable, "-c", code]
    elif example.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        raise AssertionError(f"{example.page}:{example.line}: no runner for ```{example.lang}")
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S, cwd=ROOT, check=False
    )


def check_ran(example: Example, result: subprocess.CompletedProcess[str]) -> None:
    where = f"{example.page}:{example.line}"
    assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{where} printed nothing"


def test_examples_are_found() -> None:
    kinds = {e.kind for e in EXAMPLES}
    assert kinds == {"offline", "server"}, kinds
    assert {e.lang for e in EXAMPLES} <= {"python", "bash"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("docs-server") / "server.log"
    running = start_server([], log, timeout=300)  # the default model, as `make serve`
    yield running
    stop_server(running)


@pytest.mark.slow
@pytest.mark.parametrize(
    "example",
    [e for e in EXAMPLES if e.kind == "server"],
    ids=lambda e: f"{e.page}:{e.line}",
)
def test_server_example(example: Example, server: RunningServer) -> None:
    check_ran(example, run_example(example, server.url.removeprefix("http://")))


@pytest.mark.slow
@pytest.mark.parametrize(
    "example",
    [e for e in EXAMPLES if e.kind == "offline"],
    ids=lambda e: f"{e.page}:{e.line}",
)
def test_offline_example(example: Example) -> None:
    check_ran(example, run_example(example))


def test_generated_pages_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_docs.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_site_builds_without_warnings(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "reference" / "flags" / "index.html").exists()


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 120
    first_block = lines[lines.index("```bash") + 1 :][:2]
    assert [line.split()[:2] for line in first_block] == [["make", "serve"], ["make", "test"]]


def test_readme_layout_table_lists_the_tree() -> None:
    """Every tracked top-level folder is in README's layout table, and nothing else is."""
    tracked = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.split()
    folders = {path.split("/")[0] for path in tracked if "/" in path}
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w.-]+)/` \|", layout, flags=re.MULTILINE))
    assert listed == folders


def test_bench_holds_the_benchmarks_and_the_page_names_each() -> None:
    files = [p for p in (ROOT / "bench").rglob("*") if p.is_file() and "experiments" not in p.parts]
    files = [p for p in files if "__pycache__" not in p.parts and "results" not in p.parts]
    # one script per capability and its helpers; one-off studies go to bench/experiments/
    assert len(files) < 20, sorted(str(p.relative_to(ROOT)) for p in files)
    page = (DOCS / "benchmarks.md").read_text()
    scripts = [p for p in files if p.suffix in (".py", ".sh")]
    missing = [p.name for p in scripts if f"bench/{p.name}" not in page]
    assert not missing, f"not on docs/benchmarks.md: {missing}"
    experiments = (ROOT / "bench" / "experiments" / "README.md").read_text()
    moved = [
        p.name
        for p in (ROOT / "bench" / "experiments").iterdir()
        if p.suffix in (".py", ".sh") and f"`{p.name}`" not in experiments
    ]
    assert not moved, f"not in bench/experiments/README.md: {moved}"


def test_grafana_dashboard_uses_exported_metric_names() -> None:
    dashboard = json.loads((DOCS / "assets" / "grafana" / "radixserve-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    names = {n for e in exprs for n in re.findall(r"sglang:(\w+)", e)}
    source = (ROOT / "entrypoints" / "metrics.py").read_text()
    unknown = sorted(
        n for n in names if f'"{re.sub(r"_(total|bucket|sum|count)$", "", n)}"' not in source
    )
    assert names and not unknown, f"not exported by entrypoints/metrics.py: {unknown}"


def test_benchmark_charts_exist_and_are_shown() -> None:
    """Each chart of docs/assets/benchmarks/figures.json is drawn (bench/charts.py) and on the
    benchmarks page."""
    figures = DOCS / "assets" / "benchmarks" / "figures.json"
    charts = json.loads(figures.read_text())["charts"]
    page = (DOCS / "benchmarks.md").read_text()
    for chart in charts:
        assert (DOCS / "assets" / "benchmarks" / f"{chart['name']}.svg").is_file(), chart["name"]
        assert f"(assets/benchmarks/{chart['name']}.svg)" in page, chart["name"]
