"""The settings a hardware platform may choose for its device, the core's values for them, and
the resolved values with where each came from (EngineConfig.with_platform_defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Settings a hardware platform may choose for its device (HardwarePlatform.engine_defaults),
#: and what they are where neither the user nor the platform sets them.
CORE_DEFAULTS: dict[str, Any] = {
    "max_running_requests": 64,
    "mem_fraction_static": 0.2,
    "chunked_prefill_size": 1024,
    "cuda_graph_max_bs": 256,
    "prefill_shrink_after_decodes": 0,
    "prefill_gather_steps": 0,
    "speculative_disable_batch_size": 32,
}


@dataclass(frozen=True, slots=True)
class PlatformSettings:
    """The resolved values of CORE_DEFAULTS' settings, and where each came from ("flag",
    "<platform> default", "default", or a note of why it was lowered)."""

    max_running_requests: int
    mem_fraction_static: float
    chunked_prefill_size: int
    cuda_graph_max_bs: int
    prefill_shrink_after_decodes: int
    prefill_gather_steps: int
    speculative_disable_batch_size: int
    origins: dict[str, str]

    def describe(self) -> dict[str, dict[str, Any]]:
        """{setting: {"value": ..., "from": ...}} for the ready banner and /server_info."""
        return {
            name: {"value": getattr(self, name), "from": self.origins[name]}
            for name in CORE_DEFAULTS
        }
