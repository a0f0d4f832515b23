"""Attention plugin ``triton``: paged-KV Triton kernels (extend, split-K decode, KV store).

Importing this package does not import Triton: the registry holds a lazy factory, so listing
plugins stays cheap. Usable where Triton is installed and a CUDA/ROCm device is present, or on
the CPU under ``TRITON_INTERPRET=1`` (how CI checks the kernels).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from radixserve.core.hookspecs import hookimpl


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed"
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "needs a CUDA or ROCm device (or TRITON_INTERPRET=1 on the CPU)"


def build_backend(*args: Any, **kwargs: Any) -> Any:
    from radixserve.plugins.attention.triton.backend import TritonAttention

    return TritonAttention(*args, **kwargs)


@hookimpl
def register_attention_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "triton",
        build_backend,
        available=unavailable_reason,
        description="paged attention in Triton: extend, split-K decode, GQA (GPU)",
    )
