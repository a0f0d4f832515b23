"""LoRA on the decoders' projections (core/lora.py's ``AdapterWeights``).

Each wrapped projection (the fused ``qkv_proj`` and ``gate_up_proj``, ``o_proj``, ``down_proj``)
gets a forward hook adding, per token, ``scaling_s * (x @ A_s^T) @ B_s^T`` of its token's slot
``s`` for every sub-projection it fuses (q, k and v each write their own columns). Where a
PEFT name lands (module, column offset) comes from the model's own ``weight_target``, so the
fused layouts are the model's knowledge, not this file's. Slot 0 is the base model: its tokens
get nothing added and no weights are stored for it (the pools index ``slot - 1``).

Backends: ``torch`` loops over the few adapters of a step (one gather, two small matmuls and a
scatter-add per adapter and projection; rows of one adapter together); ``triton`` runs
plugins/models/lora_triton.py's per-row kernels, which read each token's slot from a device
buffer (data, not shape: a CUDA graph captures them once for every mix of adapters).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.core.config_checks import ConfigError
from radixserve.core.lora import LORA_MODULES, LoRAAdapter

_BLOCK = {p: ("self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp")
          for p in LORA_MODULES}  # fmt: skip


@dataclass(slots=True)
class _Sub:
    hf_name: str  # "layers.N.self_attn.q_proj.weight": the key of LoRAAdapter.weights
    offset: int  # first output column in the fused module
    size: int
    a: torch.Tensor  # [slots, R, in]
    b: torch.Tensor  # [slots, size, R]


@dataclass(slots=True)
class _Wrapped:
    module: nn.Module
    subs: list[_Sub]


def wrapped_projections(
    model: Any, targets: tuple[str, ...]
) -> dict[str, list[tuple[str, int, int]]]:
    """Module name -> its targeted sub-projections (HF name, column offset, columns)."""
    if not hasattr(model, "weight_target") or not hasattr(model, "layers"):
        raise ConfigError(f"model {type(model).__name__} does not support LoRA adapters")
    modules = dict(model.named_modules())
    out: dict[str, list[tuple[str, int, int]]] = {}
    for i in range(len(model.layers)):
        found: dict[str, list[tuple[int, str, str]]] = {}
        for proj in LORA_MODULES:
            hf = f"layers.{i}.{_BLOCK[proj]}.{proj}.weight"
            target = model.weight_target(hf)
            if target is None or target[1] is not None:
                raise ConfigError(f"model {type(model).__name__}: '{hf}' cannot take a LoRA")
            name = target[0].removesuffix(".weight")
            found.setdefault(name, []).append((target[2] or 0, proj, hf))
        for name, subs in found.items():
            width = modules[name].weight.shape[0]
            subs.sort()
            ends = [o for o, _, _ in subs[1:]] + [width]
            chosen = [
                (hf, off, end - off)
                for (off, proj, hf), end in zip(subs, ends, strict=True)
                if proj in targets
            ]
            if chosen:
                out[name] = chosen
    return out


class LoRALayers:
    """The slots' device weights and the hooks that apply them."""

    def __init__(
        self, model: Any, targets: tuple[str, ...], slots: int, max_rank: int,
        backend: str, max_tokens: int,
    ) -> None:  # fmt: skip
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.rank, self.backend = max_rank, backend
        self.scale = torch.zeros(slots, dtype=torch.float32, device=self.device)
        self.wrapped: list[_Wrapped] = []
        modules = dict(model.named_modules())
        for name, subs in wrapped_projections(model, targets).items():
            module = modules[name]
            width = module.weight.shape[1]
            parts = [
                _Sub(hf, off, size,
                     torch.zeros(slots, max_rank, width, dtype=self.dtype, device=self.device),
                     torch.zeros(slots, size, max_rank, dtype=self.dtype, device=self.device))
                for hf, off, size in subs
            ]  # fmt: skip
            w = _Wrapped(module, parts)
            module.register_forward_hook(self._hook(w))
            self.wrapped.append(w)
        # the torch backend's step: (pool index, rows or None for all rows, rank) per adapter
        self.segments: list[tuple[int, torch.Tensor | None, int]] = []
        self.ranks = [0] * slots
        # the Triton backend's slot per token, a buffer a CUDA graph reads at replay
        self.token_slots = torch.zeros(max_tokens, dtype=torch.int32, device=self.device)
        self.step_slots = self.token_slots[:0]
        for layer in model.layers:  # the one-row GEMV reads weights without the hooks
            if hasattr(layer, "gemv_cfg"):
                layer.gemv_cfg = None

    # -- AdapterWeights ----------------------------------------------------------------------

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        i, r = slot - 1, adapter.rank
        for w in self.wrapped:
            for sub in w.subs:
                sub.a[i].zero_()
                sub.b[i].zero_()
                pair = adapter.weights.get(sub.hf_name)
                if pair is None:
                    continue
                a, b = pair
                if a.shape != (r, sub.a.shape[2]) or b.shape != (sub.size, r):
                    raise ConfigError(
                        f"LoRA adapter '{adapter.name}': {sub.hf_name} has A {tuple(a.shape)} "
                        f"and B {tuple(b.shape)}; this model needs A ({r}, {sub.a.shape[2]}) "
                        f"and B ({sub.size}, {r})"
                    )
                sub.a[i, :r].copy_(a)
                sub.b[i, :, :r].copy_(b)
        self.scale[i] = adapter.scaling
        self.ranks[i] = r

    def set_step(self, token_slots: torch.Tensor) -> None:
        t = token_slots.shape[0]
        if self.backend == "triton":
            if t <= self.token_slots.shape[0]:
                self.token_slots.zero_()  # padded rows of a graph's batch: the base model
                self.token_slots[:t].copy_(token_slots, non_blocking=True)
                self.step_slots = self.token_slots[:t]
            else:  # larger than any captured graph: a buffer of its own
                self.step_slots = token_slots.to(self.device, torch.int32)
            return
        self.segments = []
        for s in torch.unique(token_slots).tolist():
            if s == 0:
                continue
            mask = token_slots == s
            rows = None if bool(mask.all()) else mask.nonzero().squeeze(1).to(self.device)
            self.segments.append((s - 1, rows, self.ranks[s - 1]))

    # -- the hooks ---------------------------------------------------------------------------

    def _hook(self, w: _Wrapped) -> Any:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], y: Any) -> Any:
            if not isinstance(y, torch.Tensor):
                return y
            x = inputs[0]
            if self.backend == "triton":
                from radixserve.plugins.models import lora_triton

                # NOTE: sliced by shape from the static buffer, so a CUDA graph captured with
                # any batch reads the slots set_step writes before each replay.
                t = x.shape[0]
                buf = self.token_slots
                slots = buf[:t] if t <= buf.shape[0] else self.step_slots
                for sub in w.subs:
                    lora_triton.add_lora(y, x, sub.a, sub.b, self.scale, slots, sub.offset)
                return y
            for i, rows, r in self.segments:
                xs = x if rows is None else x.index_select(0, rows)
                for sub in w.subs:
                    d = (xs @ sub.a[i, :r].T) @ sub.b[i, :, :r].T * self.scale[i]
                    cols = y[:, sub.offset : sub.offset + sub.size]
                    if rows is None:
                        cols += d.to(y.dtype)
                    else:
                        cols.index_add_(0, rows, d.to(y.dtype))
            return y

        return hook


def attach_lora(model: Any, config: Any, device: str) -> LoRALayers:
    """Wrap ``model``'s projections for ``config``'s adapters (before any graph is
    captured): the device side of the slot pool."""
    backend = config.lora_backend or ("triton" if torch.device(device).type == "cuda" else "torch")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--lora-backend triton needs a CUDA device; use torch")
    if backend == "torch" and on_cuda and not config.disable_cuda_graph:
        # its per-step loop over adapters is host code: a graph would replay none of it
        raise ConfigError("--lora-backend torch on CUDA needs --disable-cuda-graph; use triton")
    max_tokens = max(config.chunked_prefill_size or 0, config.cuda_graph_max_bs or 0, 8192)
    return LoRALayers(
        model, tuple(config.lora_target_modules), config.max_loras_per_batch,
        config.max_lora_rank, backend, max_tokens,
    )  # fmt: skip
