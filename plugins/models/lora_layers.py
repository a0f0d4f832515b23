"""LoRA on the decoders' projections (core/lora.py's ``AdapterWeights``).

Each wrapped projection (the fused ``qkv_proj`` and ``gate_up_proj``, ``o_proj``, ``down_proj``)
gets a forward hook adding, per token, ``scaling_s * (x @ A_s^T) @ B_s^T`` of its token's slot
``s`` for every sub-projection it fuses (q, k and v each write their own columns). Where a
PEFT name lands (module, column offset) comes from the model's own ``weight_target``, so the
fused layouts are the model's knowledge, not this file's. Slot 0 is the base model: its tokens
get nothing added and no weights are stored for it (the pools index ``slot - 1``).

Backends: ``torch``, for a step of a few rows per adapter (decode), pads them per slot once in
``set_step`` and then costs a gather, two batched products over the slots and a scatter-add per
wrapped module, whatever the number of adapters; longer steps (prefill) loop over their
adapters (a gather, two small matmuls and a scatter-add each); ``triton`` runs
plugins/models/lora_triton.py's segmented kernels, one launch pair per wrapped module (its
sub-projections' A stacked along the rank, their B along the columns), over the step's rows
sorted by slot once in ``set_step``; the slots and that order are device buffers (data, not
shape: a CUDA graph captures the kernels once for every mix of adapters).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple

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
    a: torch.Tensor  # [slots, R, in]: a view of its module's stacked A
    b: torch.Tensor  # [slots, size, R]: a view of its module's stacked B


class _Padded(NamedTuple):
    """A torch-backend step's LoRA rows padded to ``length`` per slot: a [slots, length] grid."""

    length: int
    rank: int  # the highest rank of the step's adapters (the pool's tail past it is zeros)
    gather: torch.Tensor  # [slots * length] the row at each grid cell (padding: row 0)
    rows: torch.Tensor  # the LoRA rows, by slot
    cells: torch.Tensor  # their cells in the grid


@dataclass(slots=True)
class _Wrapped:
    module: nn.Module
    subs: list[_Sub]
    a: torch.Tensor  # [slots, len(subs) * R, in]: sub j's A at rows j*R..
    b: torch.Tensor  # [slots, sum of the sizes, R]: the subs' B one after another
    cols: tuple[tuple[int, int, int], ...]  # per sub: first column of b, columns, of the output


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
            w = self._stacked(module, subs, slots, max_rank)
            module.register_forward_hook(self._hook(w))
            self.wrapped.append(w)
        # the torch backend's step: (pool index, rows or None for all rows, rank) per adapter
        self.segments: list[tuple[int, torch.Tensor | None, int]] = []
        self.padded: _Padded | None = None  # instead of segments: one batched product
        self.ranks = [0] * slots
        # the Triton backend's slot per token and the tokens sorted by slot: buffers a CUDA
        # graph reads at replay; rows from ``filled`` on are the base model's, in place
        self.token_slots = torch.zeros(max_tokens, dtype=torch.int32, device=self.device)
        self.token_order = torch.arange(max_tokens, dtype=torch.int32, device=self.device)
        self.filled = 0
        self.step_slots, self.step_order = self.token_slots[:0], self.token_order[:0]
        for layer in model.layers:  # the one-row GEMV reads weights without the hooks
            if hasattr(layer, "gemv_cfg"):
                layer.gemv_cfg = None

    def _stacked(
        self, module: nn.Module, subs: list[tuple[str, int, int]], slots: int, rank: int
    ) -> _Wrapped:
        width = module.weight.shape[1]
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        a = torch.zeros(slots, len(subs) * rank, width, **kw)
        b = torch.zeros(slots, sum(size for _, _, size in subs), rank, **kw)
        parts, cols, col = [], [], 0
        for j, (hf, off, size) in enumerate(subs):
            sub_a, sub_b = a[:, j * rank : (j + 1) * rank], b[:, col : col + size]
            parts.append(_Sub(hf, off, size, sub_a, sub_b))
            cols.append((col, size, off))
            col += size
        return _Wrapped(module, parts, a, b, tuple(cols))

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
        if self.backend == "triton":
            self._set_triton_step(token_slots)
            return
        self.segments, self.padded = [], None
        slots = token_slots.cpu()
        counts = torch.bincount(slots, minlength=len(self.ranks) + 1)[1:]
        length = int(counts.max())
        active = counts.nonzero().squeeze(1).tolist()
        # padded: fewer ops, which is what a decode step's time is on the CPU; past a few
        # dozen rows an adapter the products dominate and the loop pads nothing
        if len(active) > 1 and length <= 32:
            self.padded = self._pad(slots, counts, length, max(self.ranks[i] for i in active))
            return
        for s in torch.unique(token_slots).tolist():
            if s == 0:
                continue
            mask = token_slots == s
            rows = None if bool(mask.all()) else mask.nonzero().squeeze(1).to(self.device)
            self.segments.append((s - 1, rows, self.ranks[s - 1]))

    def _pad(self, slots: torch.Tensor, counts: torch.Tensor, length: int, rank: int) -> _Padded:
        n = int(counts.sum())
        rows = torch.argsort(slots, stable=True)[slots.shape[0] - n :]  # slot 0's rows first
        slot = slots[rows] - 1
        first = torch.cumsum(counts, 0) - counts  # each slot's first row among ``rows``
        cells = slot * length + torch.arange(n) - first[slot]
        gather = torch.zeros(len(self.ranks) * length, dtype=torch.int64)
        gather[cells] = rows
        dev = self.device
        return _Padded(length, rank, gather.to(dev), rows.to(dev), cells.to(dev))

    def _set_triton_step(self, token_slots: torch.Tensor) -> None:
        t = token_slots.shape[0]
        slots = token_slots.to(torch.int32)
        order = torch.argsort(slots, stable=True).to(torch.int32)  # on the slots' own device
        if t > self.token_slots.shape[0]:  # larger than any captured graph: buffers of its own
            self.step_slots, self.step_order = slots.to(self.device), order.to(self.device)
            return
        end = max(t, self.filled)
        if end > t:  # the last step's rows past this one's: back to the base model, in place
            slots = torch.cat([slots, slots.new_zeros(end - t)])
            order = torch.cat([order, torch.arange(t, end, dtype=torch.int32, device=order.device)])
        self.token_slots[:end].copy_(slots, non_blocking=True)
        self.token_order[:end].copy_(order, non_blocking=True)
        self.filled = t
        self.step_slots, self.step_order = self.token_slots[:t], self.token_order[:t]

    # -- the hooks ---------------------------------------------------------------------------

    def _hook(self, w: _Wrapped) -> Any:
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], y: Any) -> Any:
            if not isinstance(y, torch.Tensor):
                return y
            x = inputs[0]
            if self.backend == "triton":
                from radixserve.plugins.models import lora_triton

                # NOTE: sliced by shape from the static buffers, so a CUDA graph captured with
                # any batch reads the slots and order set_step writes before each replay (a
                # graph's padded rows are past ``filled``: slot 0, in place).
                t = x.shape[0]
                if t <= self.token_slots.shape[0]:
                    slots, order = self.token_slots[:t], self.token_order[:t]
                else:
                    slots, order = self.step_slots, self.step_order
                lora_triton.add_lora(y, x, w.a, w.b, self.scale, slots, order, w.cols)
                return y
            if self.padded is not None:
                self._add_padded(w, x, y, self.padded)
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

    def _add_padded(self, w: _Wrapped, x: torch.Tensor, y: torch.Tensor, p: _Padded) -> None:
        """Every slot at once: [slots, length] rows times the stacked A, then each sub's B."""
        slots, r, subs = w.a.shape[0], p.rank, len(w.subs)
        a = w.a
        if r < self.rank:  # the ranks past the step's highest are zeros: skip them
            a = a.view(slots, subs, self.rank, -1)[:, :, :r].reshape(slots, subs * r, -1)
        h = torch.bmm(x.index_select(0, p.gather).view(slots, p.length, -1), a.transpose(1, 2))
        h *= self.scale.view(slots, 1, 1)
        for j, sub in enumerate(w.subs):
            # NOTE: einsum, not bmm: a sub's B is a slice of the stacked B, whose batch stride
            # sends bmm to a slow strided path on the CPU (3x at SmolLM2's gate/up)
            d = torch.einsum("slr,snr->sln", h[:, :, j * r : (j + 1) * r], sub.b[:, :, :r])
            d = d.view(slots * p.length, sub.size).index_select(0, p.cells)
            y[:, sub.offset : sub.offset + sub.size].index_add_(0, p.rows, d.to(y.dtype))


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
