"""The CPU platform, asked for by name: tests whose assertions hold on the CPU only (outputs
equal to transformers' on the CPU token for token, greedy outputs that do not depend on the
batch or the cache, CPU-only features, tensor parallelism over gloo on one host) would pick
the CUDA platform on a machine with a GPU, where kernels round differently, when they left the
choice to the platform's auto-detection (the highest-priority available platform wins)."""

from __future__ import annotations

from typing import Any

CPU = "hardware=cpu"
#: server flags that choose the CPU platform, in float32 (a GGUF model's default on the CPU is
#: the fast mode, whose outputs are not transformers' float32 ones; a later --dtype wins)
CPU_FLAGS = ["--plugin", CPU, "--dtype", "float32"]


def on_cpu(settings: dict[str, Any]) -> dict[str, Any]:
    """Engine/EngineConfig keyword settings with the CPU platform chosen, unless they choose a
    hardware platform themselves. (No dtype is added: callers pass one beside these settings;
    the suite's RADIXSERVE_CPU_MODE=exact, tests/conftest.py, keeps a GGUF model in float32.)"""
    plugins = settings.get("plugins", ())
    if isinstance(plugins, dict):
        plugins = [f"{kind}={name}" for kind, name in plugins.items()]
    elif isinstance(plugins, str):
        plugins = [plugins]
    plugins = list(plugins)
    if not any(p.split("=", 1)[0].strip() == "hardware" for p in plugins):
        plugins.append(CPU)
    return {**settings, "plugins": tuple(plugins)}
