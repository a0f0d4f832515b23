"""What the decoder skeleton (``decoder.py``) reads from a model's config.json beyond
``ModelConfig``: required fields named in the error, settings it does not implement refused at
build time, and each layer's sliding window as transformers derives it.
"""

from __future__ import annotations

from typing import Any

from radixserve.core.config import ConfigError


def required(raw: dict[str, Any], key: str) -> Any:
    """``raw[key]``; a ``ConfigError`` naming the field where config.json lacks it."""
    value = raw.get(key)
    if value is None:
        raise ConfigError(f"config.json lacks required field '{key}'")
    return value


def check_supported(raw: dict[str, Any]) -> None:
    """Stop at build time, naming the field, on config settings the skeleton does not
    implement (rather than at weight loading or the first step)."""
    if raw.get("mlp_bias"):
        raise ConfigError(
            "config.json sets mlp_bias=true (biases on the MLP), which is not supported"
        )


def layer_window(raw: dict[str, Any], layer_id: int) -> int:
    """The sliding window of one layer, 0 for full attention, as transformers' Qwen2/Qwen3
    configs derive it: ``sliding_window`` counts only with ``use_sliding_window`` (where the
    config has that field); the layers ``layer_types`` (the per-layer list) marks slide, or, when
    the config has no ``layer_types``, those from ``max_window_layers`` (default 28) on."""
    window = raw.get("sliding_window")
    if not window or not raw.get("use_sliding_window", True):
        return 0
    types = raw.get("layer_types")
    if not types:
        if not raw.get("use_sliding_window"):
            return 0
        return int(window) if layer_id >= int(raw.get("max_window_layers", 28)) else 0
    return int(window) if types[layer_id] == "sliding_attention" else 0
