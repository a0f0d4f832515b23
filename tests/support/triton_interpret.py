"""Interpreted Triton (TRITON_INTERPRET=1, how the CPU suite runs the kernels) without
re-patching ``triton.language`` on every call of a ``@triton.jit`` helper, and without integer
overflow checks whose verdict the interpreter throws away.

A kernel launch patches the language modules its function sees, runs the grid and restores
them. Every call of a jitted helper from inside the kernel patches them again (and never
restores: Triton drops that scope); the launch has already patched them, so those calls change
nothing, yet they were ~30% of an interpreted test's time (``inspect.getmembers`` over the
language modules, per call). Here such a call is skipped when the launch in progress already
patched every module the helper sees; anything else patches exactly as before.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any


class _NoChanges:
    def restore(self) -> None:
        pass


def skip_nested_patching() -> None:
    """Install the wrapper around ``triton.runtime.interpreter._patch_lang`` (once)."""
    from triton.runtime import interpreter

    original: Callable[[Any], Any] = interpreter._patch_lang
    if getattr(original, "skips_nested", False):
        return
    lang_modules = (interpreter.tl, interpreter.tl.core)
    patched: list[frozenset[int]] = [frozenset()]  # the modules patched by the launch running

    def patch_lang(fn: Any) -> Any:
        seen = frozenset(
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in lang_modules
        )
        if seen and seen <= patched[0]:
            return _NoChanges()
        before = patched[0]
        scope = original(fn)
        patched[0] = before | seen
        restore = scope.restore

        def restore_and_forget() -> None:
            restore()
            patched[0] = before

        scope.restore = restore_and_forget
        return scope

    patch_lang.skips_nested = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang


def skip_discarded_overflow_checks() -> None:
    """Turn off the interpreter's ``sanitize_overflow`` where its checks are dead code.

    Every integer ``+``, ``-`` and ``*`` on 32-bit or narrower values in a kernel computes the
    operation again in int64 and compares it with the type's bounds, then hands the result to
    ``device_assert``, which does nothing unless the options' ``debug`` is on (it never is in
    the interpreter, as on the GPU without TRITON_DEBUG). Skipping it cut test_head_chain.py
    from 64 to 47 s of CPU on one core. With ``debug`` on, the checks stay."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if builder.options.sanitize_overflow and not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
