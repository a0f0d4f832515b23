"""The C++ CPU kernels' checked entry points (plugins/hardware/cpu_kernels/checks.py) with the
library itself out of reach: a bad operand must be refused in Python, before any C++ runs
(on some builds of torch, a C++ check's exception crashed the interpreter)."""

from __future__ import annotations

from typing import Any

import pytest


def checked_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> Any:
    from radixserve.plugins.hardware.cpu_kernels import checked, checks

    ops = checked()  # the library is loaded (built) here, before it is put out of reach

    def unreachable() -> Any:
        pytest.fail("a bad operand reached the C++ kernel")

    monkeypatch.setattr(checks, "_library", unreachable)
    return ops
