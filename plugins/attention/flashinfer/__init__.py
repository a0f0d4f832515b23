"""Attention plugin ``flashinfer``: FlashInfer's paged prefill and decode kernels (NVIDIA GPUs).

Importing this package does not import FlashInfer: the registry holds a lazy factory, so listing
plugins stays cheap. Usable where the ``flashinfer-python`` package (and its ``apache-tvm-ffi``)
is installed and a CUDA device is present; FlashInfer compiles its kernels on first use
(FLASHINFER_WORKSPACE_BASE says where it keeps them).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from radixserve.core.hookspecs import hookimpl


def unavailable_reason() -> str | None:
    if importlib.util.find_spec("flashinfer") is None:
        return "the 'flashinfer' package is not installed (pip install flashinfer-python)"
    if importlib.util.find_spec("tvm_ffi") is None:
        return "flashinfer needs the 'apache-tvm-ffi' package, which is not installed"
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        return "needs a CUDA device (FlashInfer has no CPU or ROCm kernels)"
    return None


def build_backend(*args: Any, **kwargs: Any) -> Any:
    from radixserve.plugins.attention.flashinfer.backend import FlashInferAttention

    return FlashInferAttention(*args, **kwargs)


@hookimpl
def register_attention_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "flashinfer",
        build_backend,
        available=unavailable_reason,
        description="FlashInfer paged prefill and decode, GQA, CUDA graphs (NVIDIA GPU, bf16/fp16)",
    )
