"""Loading a checkpoint's HF tensors into a decoder skeleton model (``decoder.py``): each goes
where the model's ``weight_target`` puts it (rows of a fused projection, one expert of a stacked
tensor) under this pipeline stage's names, an FP8 checkpoint's through
``fp8_loading.dequantizing``; a tensor the model lacks, a shape that differs or a parameter left
unfilled stops loading with its name.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch

#: where one HF tensor goes: (our parameter name, expert index or None, row offset or None)
Target = tuple[str, int | None, int | None]


def load_decoder_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    from radixserve.plugins.models import fp8_loading

    if fp8_loading.checkpoint_scheme(model.config.raw) is not None:  # FP8 codes and their scales
        weights = fp8_loading.dequantizing(
            model, weights, next(model.parameters()).dtype, partial(checkpoint_target, model)
        )
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}  # parameter -> elements written
    seen: set[Target] = set()
    for hf_name, tensor in weights:
        name = model.stage_name(hf_name.removeprefix("model."))
        target = None if name is None else model.weight_target(name)
        if target is None:
            continue
        pname, expert, offset = target
        if pname not in params:
            raise ValueError(f"unexpected weight '{hf_name}' for {model.config.architecture}")
        dst = params[pname].data
        if expert is not None:
            dst = dst[expert]
        if offset is not None:
            dst = dst[offset : offset + tensor.shape[0]]
        if dst.shape != tensor.shape:
            raise ValueError(
                f"weight '{hf_name}' has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        with torch.no_grad():
            dst.copy_(tensor)
        if target not in seen:
            seen.add(target)
            filled[pname] = filled.get(pname, 0) + dst.numel()
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
    if missing:
        raise ValueError(f"checkpoint lacks weights: {', '.join(sorted(missing)[:5])} ...")


def checkpoint_target(model: Any, hf_name: str) -> Target | None:
    name = model.stage_name(hf_name.removeprefix("model."))
    return None if name is None else model.weight_target(name)
