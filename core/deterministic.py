"""--enable-deterministic-inference: the same tokens for a request whatever shares its step.

Resolved once at start-up; nothing here runs per step. The engine hands the mode to the parts
whose arithmetic could depend on the batch, through their ``BatchInvariant`` capability
(core/interfaces_capabilities.py): the attention backend (a fixed KV split, the same code path
for prefill, extend, decode and verify rows) and the model (linears in fixed row blocks,
per-row RMSNorm). The sampler needs no switch: seeded rows already draw their noise from
(seed, output position), so requests that give no seed get ``--random-seed``
(``default_seed``, through ``core/validation.py``). What cannot be made batch-invariant is
refused when the config is built (``config_checks.check_deterministic``).
"""

from __future__ import annotations

from typing import Any

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.interfaces_capabilities import BatchInvariant


def default_seed(config: EngineConfig) -> int | None:
    """The seed of requests that give none: --random-seed in deterministic mode, else None
    (their noise comes from the engine's generator, which depends on the batch)."""
    return config.random_seed if config.enable_deterministic_inference else None


def make_batch_invariant(part: Any, what: str, config: EngineConfig) -> None:
    """Switch ``part`` (the attention backend or the model, named ``what`` in the error) to
    its batch-invariant mode when the config asks for it; refuse one that has none."""
    if not config.enable_deterministic_inference:
        return
    if not isinstance(part, BatchInvariant):
        raise ConfigError(
            f"--enable-deterministic-inference: {what} has no batch-invariant mode "
            "(docs/deterministic.md lists the backends and models that do)"
        )
    part.set_batch_invariant()
