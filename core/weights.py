"""Reading weights of an HF-layout model directory (``*.safetensors``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from radixserve.core.checkpoint import safetensors_files
from radixserve.core.interfaces import KeepsWeightCopies

__all__ = ["count_parameters", "iter_weights", "reload_in_place", "safetensors_files"]


def iter_weights(model_dir: str | Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor, converted to ``dtype``, one at a time. FP8
    tensors and quantization scales (``*_scale``, ``*_scale_inv``) pass as stored: the model
    dequantizes or keeps them (plugins/models/fp8_loading.py)."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = f.get_tensor(name)
                keep = t.dtype in _FP8 or name.endswith(("_scale", "_scale_inv"))
                yield name, t if keep else t.to(dtype)


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def count_parameters(model_dir: str | Path) -> int:
    """Parameter count from the safetensors headers, without loading tensors."""
    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                total += math.prod(f.get_slice(name).get_shape())
    return total


def reload_in_place(model: torch.nn.Module, load: Callable[[], None]) -> None:
    """Run ``load()`` (which copies new weights into ``model``'s parameters); if it raises, put
    the old weights back before re-raising, so a bad checkpoint leaves the model serving as
    before. NOTE: the old weights wait on the host (not the device, which is full of KV pool)
    while loading; tensors are copied in place so CUDA graphs stay valid."""
    backup = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    try:
        load()
    except BaseException:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(backup[name])
        raise


def weights_reloaded(model: torch.nn.Module) -> None:
    """Tell the modules that keep copies of their weights (e.g. repacked for a kernel by the
    hardware platform) that the weights changed: each ``weights_reloaded()`` rebuilds them."""
    for module in model.modules():
        if isinstance(module, KeepsWeightCopies):
            module.weights_reloaded()
