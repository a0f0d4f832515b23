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
