"""The installed package works outside the checkout: build the wheel, install it into a fresh
virtual environment, and run ``radixserve plugins``, ``radixserve generate`` (the default model)
and one request to ``radixserve serve`` from a directory that is not the checkout.

(A hand-written package list once left entrypoints/tool_parsers out of the wheel: every command
of the installed package failed at import, and no test saw it, since every test imported the
checkout.)

Fast and offline: the wheel is installed without its dependencies, which come from the
environment running this test through a site directory of links to its packages, less
radixserve's own (the editable install of the checkout and the example plugin), so that
``radixserve`` can only resolve to the wheel. The test checks it does (``radixserve.__file__``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from server_process import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 300  # per command; only stops a hung test, no outcome depends on it
# What the project's environment has that must not shadow the wheel.
OURS = ("radixserve", "__editable__", "__editable___radixserve")
SGLANG_READY = "The server is fired up and ready to roll!"


def _sources(dest: Path) -> Path:
    """The checkout's files as a clean clone of it has them (tracked, plus new files not yet
    ignored), without build outputs or caches: an in-place build would write into the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=False,
    )  # fmt: skip
    if listed.returncode != 0:  # not a git checkout: everything but what git would ignore
        ignore = shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".pp",
            ".mypy_src", ".hypothesis",
        )  # fmt: skip
        shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
        return dest
    for name in listed.stdout.decode().split("\0"):
        src = ROOT / name
        if name and src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _dependency_site(dest: Path) -> Path:
    """Links to every package of this environment's site-packages but radixserve's own, and of
    the folders on PYTHONPATH first (where a machine keeps packages beside its image's)."""
    dest.mkdir()
    folders = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    on_path = [p for p in folders if p and Path(p).is_dir()]
    paths = sysconfig.get_paths()
    for base in dict.fromkeys([*on_path, paths["purelib"], paths["platlib"]]):
        for entry in Path(base).iterdir():
            if entry.name.startswith(OURS) or entry.name == "__pycache__":
                continue
            if not (dest / entry.name).exists():
                (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ folder of a fresh virtual environment with the wheel installed."""
    work = tmp_path_factory.mktemp("wheel")
    src = _sources(work / "src")
    dist = work / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        check=True, timeout=HANG_GUARD_S, cwd=work,
    )  # fmt: skip
    (wheel,) = dist.glob("radixserve-*.whl")
    _check_contents(wheel)
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", where], check=True, capture_output=True, text=True
    ).stdout.strip()
    deps = _dependency_site(work / "deps")
    # addsitedir: the dependencies' own .pth files run too; the venv's site-packages (the
    # wheel) stays first on sys.path
    pth = f"import site; site.addsitedir({str(deps)!r})\n"
    Path(purelib, "zz_dependencies.pth").write_text(pth)
    subprocess.run(
        [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index",
         str(wheel)],
        check=True, timeout=HANG_GUARD_S, cwd=work,
    )  # fmt: skip
    return venv / "bin"


def _check_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ROOT.rglob("__init__.py"):  # every package of the checkout ships
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {"tests", "bench", "examples", "docs", "tools"} or any(
            part.startswith(".") or part in {"build", "dist"} for part in rel.parts
        ):
            continue
        assert f"radixserve/{rel.as_posix()}" in names, f"{rel} is not in the wheel"
    # what the code reads at run time besides Python: the kernels' sources, the draft heads
    data = {"radixserve/plugins/hardware/cpu_kernels/vec_math.h"}
    data |= {f"radixserve/plugins/hardware/cpu_kernels/{p.name}"
             for p in (ROOT / "plugins/hardware/cpu_kernels").glob("*.cpp")}  # fmt: skip
    for head in (ROOT / "plugins/speculative/heads").iterdir():
        for part in ("config.json", "model.safetensors"):
            data.add(f"radixserve/plugins/speculative/heads/{head.name}/{part}")
    assert data <= names, sorted(data - names)
    # nothing of the checkout that is not the package, and no compiled caches
    for name in names:
        top = name.split("/")[1] if name.startswith("radixserve/") else ""
        assert top not in {"tests", "bench", "examples", "docs", "tools", "build"}, name
        assert "__pycache__" not in name and not name.endswith((".pyc", ".so")), name


def _env() -> dict[str, str]:
    """This environment less anything that would put the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME"}}
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # the CI machine's 2 cores are shared by the test workers
    return env


def _run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=_env(), capture_output=True,
        text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip


def test_radixserve_resolves_to_the_wheel(installed: Path, tmp_path: Path) -> None:
    out = _run(installed, "python", "-c", "import radixserve; print(radixserve.__file__)",
               cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    where = Path(out.stdout.strip())
    assert where.is_relative_to(installed.parent), where
    assert not where.resolve().is_relative_to(ROOT), where


def test_plugins_lists_every_builtin_plugin(installed: Path, tmp_path: Path) -> None:
    out = _run(installed, "radixserve", "plugins", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for name in ("cpu", "torch_native", "cpu_paged", "llama", "xgrammar", "ngram", "tcp"):
        assert name in out.stdout, name


def test_generate_runs_the_default_model(installed: Path, tmp_path: Path) -> None:
    out = _run(installed, "radixserve", "generate", "--prompt", "The capital of France is",
               "--max-new-tokens", "4", "--temperature", "0", "--json", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["meta_info"]["completion_tokens"] >= 1
    assert "Paris" in result["text"], result["text"]


def test_serve_answers_a_request(installed: Path, tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(installed / "radixserve"), "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_for_line(proc, log_path, SGLANG_READY)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["text"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_line(proc: subprocess.Popen[bytes], log_path: Path, line: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while line not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"server not ready ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        time.sleep(0.25)
