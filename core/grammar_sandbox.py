"""Grammar compiles bounded in time and memory: each spec is first compiled in a child process.

A grammar can make a backend run away: compile for minutes, or grow memory until the kernel
kills the largest process, the engine. So before the engine compiles a spec, a sandbox (a child
process with its own grammar backend, its address space capped with RLIMIT_AS) compiles it and
takes the first steps a request would take (a mask, the jump-forward text). A sandbox that does
not answer within the time left is killed; one that runs out of memory says so or dies. Either
way the request is refused with the reason and the engine, which never ran the spec, goes on.
Only a spec that passed is compiled again in the engine, where it takes about the same time and
memory it just took in the sandbox.

Why not ship the compiled grammar back instead of compiling twice: backends have no common
serialized form, and xgrammar's (``serialize_json``) is far larger than the grammar itself (8.5
MB for 200 JSON properties; past 8 GB, std::bad_alloc, for 5,000).

The child runs ``python -m radixserve.core.grammar_sandbox`` (no multiprocessing: the engine
is a daemon process, which may not fork workers). Messages are length-prefixed JSON over its
stdin and a private copy of its stdout; nothing is pickled.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
START_TIMEOUT_S = 300.0  # importing the backend (torch, for xgrammar) on a loaded machine


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What a sandbox needs to build the engine's grammar backend on its own."""

    backend: str
    model_dir: str
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    plugin_allow: tuple[str, ...]
    memory_mb: int  # address space allowed on top of what the built backend uses


class SandboxRefused(ValueError):
    """The spec ran out of time or memory in the sandbox (the message says which)."""


class GrammarSandbox:
    """One child process; ``probe`` is called from one thread at a time."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.spec = spec
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.core.grammar_sandbox"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout.fileno()
        self._send({"spec": asdict(self.spec)})
        reply = self._receive(START_TIMEOUT_S)
        if reply is None or "error" in reply:
            self.close()
            why = reply["error"] if reply else f"it did not start ({self._death()})"
            raise RuntimeError(f"the grammar sandbox could not build backend {spec.backend}: {why}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def probe(self, kind: str, spec: str, timeout_s: float) -> int:
        """Return once ``spec`` compiled in the sandbox, with the fewest tokens of a complete
        output (``Grammar.min_output_tokens``); raise ValueError with the backend's complaint,
        or SandboxRefused when it took longer than ``timeout_s`` or too much memory (the sandbox
        is then gone; make a new one)."""
        self._send({"kind": kind, "spec": spec})
        reply = self._receive(timeout_s)
        if reply is None:
            if self.alive:
                self.close()
                raise SandboxRefused(
                    f"it did not compile within {timeout_s:.3g} s; the compile was stopped"
                )
            death = self._death()
            self.close()
            raise SandboxRefused(
                f"the compile process died ({death}), most likely past the compile memory limit "
                f"of {self.spec.memory_mb} MiB (--grammar-compile-memory)"
            )
        if reply.get("oom"):
            self.close()  # a heap that hit its limit is not worth reusing
            raise SandboxRefused(
                f"it needs more memory than the compile limit of {self.spec.memory_mb} MiB "
                f"allows (--grammar-compile-memory): {reply['error']}"
            )
        if "error" in reply:
            raise ValueError(reply["error"])
        return int(reply.get("min_tokens", 0))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except BrokenPipeError:
                    pass  # a request left unsent to a child that was gone (closed all the same)

    def _death(self) -> str:
        code = self.proc.wait()
        return f"signal {-code}" if code < 0 else f"exit code {code}"

    def _send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode()
        try:
            self._in.write(_HEADER.pack(len(data)) + data)
            self._in.flush()
        except BrokenPipeError:
            pass  # it died; _receive reports how

    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The next reply, or None on timeout or when the child is gone."""
        deadline = time.monotonic() + timeout_s
        header = _read_exactly(self._out, _HEADER.size, deadline)
        if header is None:
            return None
        body = _read_exactly(self._out, _HEADER.unpack(header)[0], deadline)
        return None if body is None else json.loads(body)  # type: ignore[no-any-return]


def _read_exactly(fd: int, size: int, deadline: float) -> bytes | None:
    data = b""
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# -- the child ----------------------------------------------------------------------------------


def _child_main() -> None:
    # Replies go to a private copy of stdout; whatever a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _die_with_parent()
    read = sys.stdin.buffer

    def reply(message: dict[str, Any]) -> None:
        data = json.dumps(message).encode()
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()

    def receive() -> dict[str, Any] | None:
        header = read.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return None  # the engine is gone
        return json.loads(read.read(_HEADER.unpack(header)[0]))  # type: ignore[no-any-return]

    first = receive()
    if first is None:
        return
    given = first["spec"]
    spec = SandboxSpec(
        **{
            **given,
            "stop_token_ids": tuple(given["stop_token_ids"]),
            "plugin_allow": tuple(given["plugin_allow"]),
        }
    )
    try:
        backend = _build_backend(spec)
    except Exception as e:  # noqa: BLE001 - reported to the engine, which refuses the request
        reply({"error": f"{type(e).__name__}: {e}"})
        return
    _cap_memory(spec.memory_mb)
    reply({"ready": True})
    while (request := receive()) is not None:
        try:
            min_tokens = _exercise(backend, request["kind"], request["spec"], spec.vocab_size)
        except Exception as e:  # noqa: BLE001 - reported: a bad spec, or the backend's failure
            oom = isinstance(e, MemoryError) or "bad_alloc" in str(e)
            message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            reply({"error": message, "oom": oom})
        else:
            reply({"ok": True, "min_tokens": min_tokens})


def _build_backend(spec: SandboxSpec) -> Any:
    from pathlib import Path

    from radixserve.core.plugins import default_host
    from radixserve.core.tokenizer import Tokenizer

    host = default_host(spec.plugin_allow)
    factory = host.registries["grammar"].get(spec.backend).factory
    return factory(Tokenizer(Path(spec.model_dir)), spec.vocab_size, list(spec.stop_token_ids))


def _exercise(backend: Any, kind: str, spec: str, vocab_size: int) -> int:
    """What a request does with a fresh grammar before its first token: compile it, take a
    matcher, fill a mask and read the jump-forward text. Returns its min_output_tokens."""
    matcher = backend.compile(kind, spec).copy()
    bitmask = backend.allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    matcher.forced_string()
    return int(matcher.min_output_tokens())


def _cap_memory(memory_mb: int) -> None:
    """Allow ``memory_mb`` of address space beyond what the process maps now."""
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        used = int(status["VmSize"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return  # not Linux: no cap
    limit = used + memory_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _die_with_parent() -> None:
    """Linux: end this process when the engine ends, even in the middle of a compile."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # elsewhere a closed stdin ends it once the compile returns


if __name__ == "__main__":
    _child_main()
