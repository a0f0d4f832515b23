"""core/grammar_sandbox.py without an engine: real sandbox processes building the test plugin's
grammar backend (``runaway``: xgrammar with a regex that sleeps and one that grows, in
tests/support/radixserve_test_faults.py) for a tiny BPE tokenizer, and the same backend built
in this process to say what each probe must answer."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from model_gate import install_plugin
from radixserve_test_faults import GROW_SPEC, SLEEP_SPEC
from tiny_models import make_tokenizer_json

import radixserve
from radixserve.core import grammar_sandbox
from radixserve.core.grammar_sandbox import GrammarSandbox, SandboxRefused, SandboxSpec

VOCAB = 384
MEMORY_MB = 256


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxSpec]:
    tmp = tmp_path_factory.mktemp("sandbox")
    make_tokenizer_json(tmp / "tokenizer.json", VOCAB)
    env = install_plugin(tmp / "site", "radixserve_test_faults")
    # the sandbox imports this radixserve (the one under test), and the plugin from its site
    package_root = str(Path(radixserve.__file__).resolve().parents[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([package_root, env["PYTHONPATH"]]))
        mp.syspath_prepend(str(tmp / "site"))
        yield SandboxSpec("runaway", str(tmp), VOCAB, (0,), ("radixserve_test_faults",), MEMORY_MB)


def expected(backend: Any, kind: str, text: str) -> int | str:
    """What the probe of ``text`` answers: min_output_tokens, or the ValueError's message."""
    try:
        return grammar_sandbox._exercise(backend, kind, text, VOCAB)
    except ValueError as e:
        return str(e)


@pytest.mark.slow  # sandbox processes: ~3 s each
def test_a_sandbox_answers_as_the_backend_would_here_until_it_dies(spec: SandboxSpec) -> None:
    backend = grammar_sandbox._build_backend(spec)  # the same backend, in this process
    fixed, bad = expected(backend, "regex", "abc"), expected(backend, "regex", "(")
    longer = expected(backend, "regex", "abc[0-9]{8}")
    assert isinstance(fixed, int) and isinstance(longer, int) and longer > fixed
    assert isinstance(bad, str) and bad
    box = GrammarSandbox(spec)
    try:
        assert box.alive
        assert box.probe("regex", "abc", 60.0) == fixed
        with pytest.raises(ValueError) as err:
            box.probe("regex", "(", 60.0)
        assert not isinstance(err.value, SandboxRefused) and str(err.value) == bad
        assert box.probe("regex", "abc[0-9]{8}", 60.0) == longer  # a bad spec left it usable
        os.kill(box.proc.pid, signal.SIGKILL)
        box.proc.wait()
        with pytest.raises(SandboxRefused) as died:
            box.probe("regex", "abc", 60.0)
        assert str(died.value) == (
            "the compile process died (signal 9), most likely past the compile memory limit "
            f"of {MEMORY_MB} MiB (--grammar-compile-memory)"
        )
        assert not box.alive
    finally:
        box.close()


@pytest.mark.slow  # sandbox processes: ~3 s each
def test_a_runaway_in_memory_or_time_is_refused_and_ends_the_sandbox(spec: SandboxSpec) -> None:
    box = GrammarSandbox(spec)
    try:
        with pytest.raises(SandboxRefused) as err:
            box.probe("regex", GROW_SPEC, 60.0)
        assert str(err.value).startswith(
            f"it needs more memory than the compile limit of {MEMORY_MB} MiB allows "
            "(--grammar-compile-memory): MemoryError"
        )
        assert not box.alive and box.proc.stdin is not None and box.proc.stdin.closed
    finally:
        box.close()
    box = GrammarSandbox(spec)
    try:
        with pytest.raises(SandboxRefused) as err:
            box.probe("regex", SLEEP_SPEC, 0.5)
        assert str(err.value) == "it did not compile within 0.5 s; the compile was stopped"
        assert box.proc.returncode == -signal.SIGKILL
    finally:
        box.close()


@pytest.mark.slow  # sandbox processes: ~3 s each
def test_a_backend_the_sandbox_cannot_build_is_an_error_naming_it(spec: SandboxSpec) -> None:
    with pytest.raises(RuntimeError) as err:
        GrammarSandbox(SandboxSpec("nope", spec.model_dir, VOCAB, (0,), (), MEMORY_MB))
    assert str(err.value).startswith(
        "the grammar sandbox could not build backend nope: PluginError: "
    )
    assert "nope" in str(err.value).partition("PluginError: ")[2]


def test_reads_take_exactly_the_size_or_give_up() -> None:
    read, write = os.pipe()
    try:
        os.write(write, b"abc")
        soon = time.monotonic() + 0.05
        assert grammar_sandbox._read_exactly(read, 2, soon) == b"ab"
        assert grammar_sandbox._read_exactly(read, 2, time.monotonic() + 0.05) is None  # 1 of 2
        os.write(write, b"de")
        assert grammar_sandbox._read_exactly(read, 2, time.monotonic() - 1) is None  # past due
        assert grammar_sandbox._read_exactly(read, 2, time.monotonic() + 5) == b"de"
        os.close(write)
        write = -1
        assert grammar_sandbox._read_exactly(read, 1, time.monotonic() + 5) is None  # closed
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)


# ---- the child's side, run in this process (its stdin and stdout are pipes here) -------------


class Matcher:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def copy(self) -> Matcher:
        self.log.append("copy")
        return self

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.log.append(f"fill {bitmask} {row}")

    def forced_string(self) -> str:
        self.log.append("forced")
        return ""

    def min_output_tokens(self) -> int:
        return 3


class Backend:
    """Compiles "ok"; every other spec raises what its name says."""

    raises = {"bad": ValueError("no good"), "oom": MemoryError("heap"),
              "alloc": RuntimeError("std::bad_alloc"), "other": KeyError("x")}  # fmt: skip

    def __init__(self) -> None:
        self.log: list[str] = []

    def compile(self, kind: str, spec: str) -> Matcher:
        self.log.append(f"compile {kind} {spec}")
        if spec in self.raises:
            error = self.raises[spec]
            raise type(error)(*error.args)  # a fresh one: no traceback kept in the class
        return Matcher(self.log)

    def allocate_bitmask(self, rows: int, vocab_size: int) -> str:
        return f"mask{rows}x{vocab_size}"


def run_child(monkeypatch: pytest.MonkeyPatch, messages: list[dict[str, Any]]) -> list[Any]:
    """``_child_main`` fed ``messages`` then the end of its input; its replies."""
    import io
    import json
    import sys
    from types import SimpleNamespace

    header = grammar_sandbox._HEADER
    data = b"".join(header.pack(len(b)) + b for b in (json.dumps(m).encode() for m in messages))
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(data)))
    read, write = os.pipe()
    saved = os.dup(1)
    os.dup2(write, 1)
    os.close(write)
    try:
        grammar_sandbox._child_main()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    os.set_blocking(read, False)  # every reply was flushed; the child's copy may be open yet
    raw = b""
    try:
        while chunk := os.read(read, 1 << 16):
            raw += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(read)
    replies = []
    while raw:
        (n,) = header.unpack(raw[: header.size])
        replies.append(json.loads(raw[header.size : header.size + n]))
        raw = raw[header.size + n :]
    return replies


def test_the_child_answers_each_probe_and_ends_with_its_input(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[SandboxSpec] = []
    capped: list[int] = []
    backend = Backend()
    monkeypatch.setattr(grammar_sandbox, "_build_backend", lambda s: built.append(s) or backend)
    monkeypatch.setattr(grammar_sandbox, "_cap_memory", capped.append)
    monkeypatch.setattr(grammar_sandbox, "_die_with_parent", lambda: capped.append(-1))
    spec = SandboxSpec("b", "/m", 40, (1, 2), ("p",), 77)
    from dataclasses import asdict

    probes = [{"kind": "regex", "spec": s} for s in ("ok", "bad", "oom", "alloc", "other")]
    replies = run_child(monkeypatch, [{"spec": asdict(spec)}, *probes])
    assert built == [spec]  # tuples again, as the engine gave them
    assert capped == [-1, 77]  # tied to the parent first, capped once the backend is built
    assert replies == [
        {"ready": True},
        {"ok": True, "min_tokens": 3},
        {"error": "no good", "oom": False},
        {"error": "MemoryError: heap", "oom": True},
        {"error": "RuntimeError: std::bad_alloc", "oom": True},
        {"error": "KeyError: 'x'", "oom": False},
    ]
    assert backend.log[:5] == ["compile regex ok", "copy", "fill mask1x40 0", "forced",
                               "compile regex bad"]  # fmt: skip

    # a backend that cannot be built: its error, and the child ends
    def broken(s: SandboxSpec) -> Any:
        raise OSError("no tokenizer")

    monkeypatch.setattr(grammar_sandbox, "_build_backend", broken)
    capped.clear()
    replies = run_child(monkeypatch, [{"spec": asdict(spec)}, probes[0]])
    assert replies == [{"error": "OSError: no tokenizer"}] and capped == [-1]
    assert run_child(monkeypatch, []) == []  # the engine gone before it spoke


def test_the_cap_allows_the_given_memory_beyond_what_is_mapped() -> None:
    import resource

    def mapped() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    given = 1 << 22  # MiB: 4 TiB beyond what is mapped, a cap that never bites here
    before = resource.getrlimit(resource.RLIMIT_AS)
    low = mapped()
    grammar_sandbox._cap_memory(given)
    high = mapped()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        assert soft == hard
        assert min(low, high) + (given << 20) <= soft <= max(low, high) + (given << 20)
    finally:
        try:
            resource.setrlimit(resource.RLIMIT_AS, before)
        except (ValueError, OSError):
            pass  # not allowed to raise it again: 4 TiB of headroom stays


def test_the_child_dies_with_its_parent() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig, pr_get_pdeathsig = 1, 2
    sig = ctypes.c_int(-1)
    try:
        grammar_sandbox._die_with_parent()
        libc.prctl(pr_get_pdeathsig, ctypes.byref(sig))
        assert sig.value == signal.SIGKILL
    finally:
        libc.prctl(pr_set_pdeathsig, 0)
