"""Makes radixserve's hardware auto-detection believe a CUDA device exists, to find on a CPU
machine the tests that would pick the CUDA platform on a GPU machine: the cuda platform then
registers as available (it wins on priority), so a test that leaves the platform to
auto-detection fails at engine start on a CPU build of torch, while one that asks for the CPU
(tests/support/platform_choice.py) runs as usual. Servers the tests spawn inherit it:

    PYTHONPATH=tests/support/pretend_cuda .venv/bin/python -m pytest -p no:xdist tests/core/...

Not a test and not imported by any; Python runs a ``sitecustomize`` module found on the path
at start-up."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

TARGET = "radixserve.plugins.hardware.cuda"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        original = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            original(module)
            module.cuda_unavailable_reason = lambda: None

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
