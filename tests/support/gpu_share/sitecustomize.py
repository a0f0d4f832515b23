"""Lets many test processes share one GPU: the CUDA platform sizes an engine's KV pool from
the card's memory (most of it, for one server on its own card), so the second of two engines
started at once by parallel test workers finds no room. With this module on the path, each
engine's KV budget is its share of the card, ``RADIXSERVE_TEST_GPU_SHARE`` shares (default
16), for the whole suite on a GPU machine:

    PYTHONPATH=tests/support/gpu_share python -m pytest -n 12 --dist loadfile tests

Not a test and not imported by any; Python runs a ``sitecustomize`` module found on the path
at start-up, and the servers the tests spawn inherit it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "radixserve.plugins.hardware.cuda"
SHARES = int(os.environ.get("RADIXSERVE_TEST_GPU_SHARE", "16"))


def _shared(original):  # type: ignore[no-untyped-def]
    def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:  # type: ignore[no-untyped-def]
        """This engine's share of the card, less what other processes already hold (and 2 GiB
        for its activations and graphs). A test that replaced torch's memory query (a unit
        test of the sizing itself) gets the platform's own answer."""
        import torch

        if getattr(torch.cuda.mem_get_info, "__module__", "").startswith("test"):
            return original(self, weight_bytes, mem_fraction)
        free, total = torch.cuda.mem_get_info(self.device)
        share = int(total * mem_fraction / SHARES) - weight_bytes
        return max(min(share, free - weight_bytes - (2 << 30)), 0)

    return kv_cache_bytes


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
            platform = module.CudaPlatform
            platform.kv_cache_bytes = _shared(platform.kv_cache_bytes)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
