"""Plugins for in-process Engine tests, registered with ``PluginHost(extra_plugins=[...])``:
a model whose steps the test lets through one at a time, and a CPU platform that accounts
memory the way a GPU does. Both keep their state on the plugin object, so tests do not share it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.plugins.hardware.cpu import CpuPlatform
from radixserve.plugins.models.llama import LlamaForCausalLM

HANG_GUARD_S = 120.0  # only stops a hung test


class SteppedLlama(LlamaForCausalLM):
    """The built-in Llama whose every forward first takes a permit from ``steps``."""

    steps: threading.Semaphore

    def forward(self, batch: Any) -> Any:
        if not self.steps.acquire(timeout=HANG_GUARD_S):
            raise TimeoutError("the test let no model step through")
        return super().forward(batch)


class Stepper:
    """Registers model ``SteppedLlama``: the engine runs a step only when the test calls
    ``allow()``, so what a streaming caller sees between two steps is fixed, however fast the
    machine."""

    def __init__(self) -> None:
        self.steps = threading.Semaphore(0)

    def allow(self, steps: int = 1) -> None:
        self.steps.release(steps)

    def drain(self) -> None:
        """Take back the permits no step used."""
        while self.steps.acquire(blocking=False):
            pass

    @hookimpl
    def register_models(self, register: Any) -> None:
        def build(config: Any, attention: Any, dtype: torch.dtype, device: str) -> SteppedLlama:
            model = SteppedLlama(config, attention, dtype, device)
            model.steps = self.steps
            return model

        register("SteppedLlama", build, description="test: one step per permit")


class DeviceMemory:
    """Registers hardware ``metered_cpu``: the CPU with ``capacity`` bytes of "device memory"
    accounted like CUDA's. KV buffers count as used while any reference keeps them alive, and
    once freed they stay cached (not free) until the platform's ``empty_cache``; the KV pool is
    sized from what is free now, as the CUDA platform sizes it from ``mem_get_info``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live = 0
        self.cached = 0
        self._lock = threading.Lock()

    def _free_later(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes
            self.cached += nbytes

    def track(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            with self._lock:
                self.live += nbytes
            weakref.finalize(t, self._free_later, nbytes)

    @hookimpl
    def register_hardware_platforms(self, register: Any) -> None:
        memory = self

        class MeteredCpuPlatform(CpuPlatform):
            name = "metered_cpu"

            def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
                total = memory.capacity
                free = total - memory.live - memory.cached
                budget = int(total * mem_fraction) - weight_bytes
                headroom = free - weight_bytes - int(total * (1 - mem_fraction))
                return max(min(budget, headroom), 0)

            def step_executor(self, model: Any, attention: Any, kv_pool: Any, *args: Any) -> Any:
                memory.track([*kv_pool.k, *kv_pool.v])
                return super().step_executor(model, attention, kv_pool, *args)

            def empty_cache(self) -> None:
                with memory._lock:
                    memory.cached = 0

        register("metered_cpu", MeteredCpuPlatform, description="test: metered CPU", priority=-1)
