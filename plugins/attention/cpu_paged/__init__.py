"""Attention plugin ``cpu_paged``: decode attention in a C++ kernel that reads the paged KV pool
in place (CPU, float32), prefill as torch_native. The CPU platform's default where the kernel can
be built (a C++ compiler and ninja on PATH); built once per machine
(``plugins/hardware/cpu_kernels``)."""

from __future__ import annotations

from typing import Any

from radixserve.core.hookspecs import hookimpl
from radixserve.plugins.hardware.cpu_kernels import unavailable_reason


def build_backend(*args: Any, **kwargs: Any) -> Any:
    from radixserve.plugins.attention.cpu_paged.backend import CpuPagedAttention

    return CpuPagedAttention(*args, **kwargs)


@hookimpl
def register_attention_backends(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "cpu_paged",
        build_backend,
        available=unavailable_reason,
        description="C++ paged decode attention reading the KV pool in place (CPU, float32)",
    )
