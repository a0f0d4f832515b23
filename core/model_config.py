"""The model's shape: what the core needs of a checkpoint's ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.core.config_checks import ConfigError


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the core needs of a model's ``config.json``; the raw dict travels along."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    raw: dict[str, Any]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"model directory '{model_dir}' has no config.json")
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise ConfigError(f"{path} is not a valid JSON file: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        text = raw.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in raw:
            # a vision-language checkpoint (transformers 5): the language model's shape is in
            # text_config; the top level (architectures, token ids, vision_config) wins
            raw = {**text, **raw}
        archs = raw.get("architectures") or []
        if not archs:
            raise ConfigError("config.json names no 'architectures'")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            vocab = int(raw["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"config.json lacks required field {e}") from e
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=archs[0],
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            max_context=int(raw.get("max_position_embeddings") or 2048),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            raw=raw,
        )
