"""Tuned kernel tiles per GPU: JSON tables a sweep on that GPU writes, keyed by the device's
name and a row count; a kernel takes the entry at the nearest tuned count and falls back to
its own untuned choice on a GPU (or shape) the table does not name."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


@cache
def read(path: Path) -> dict[str, Any]:
    """The whole table at ``path`` ({} when there is none), read once per process."""
    return json.loads(path.read_text()) if path.is_file() else {}


@cache
def entries(path: Path, *keys: str) -> dict[int, Any]:
    """The table's {row count: entry} under ``keys`` (the device name first), {} if absent;
    built once per process (kernels ask at every eager launch; do not mutate it)."""
    node: Any = read(path)
    for key in keys:
        node = node.get(key, {})
    return {int(count): entry for count, entry in node.items()}


def nearest(table: dict[int, T], count: int) -> T:
    """The entry at the smallest tuned count at or above ``count``, else at the largest."""
    above = [c for c in table if c >= count]
    return table[min(above) if above else max(table)]


def device_name(device: torch.device) -> str | None:
    """The name tables key tiles by ("NVIDIA H200"), None off a GPU (the interpreter)."""
    if device.type != "cuda":
        return None
    return _gpu_name(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)
