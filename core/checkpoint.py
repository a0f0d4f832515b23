"""Checking an HF-layout checkpoint without loading it (and without torch): which safetensors
files it has, whether their headers read, and whether its config.json fits a running model.

A weight reload runs these checks before it pauses admission (the HTTP process, off its event
loop) and again when it loads (the engine), so a bad path never holds up running requests.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from radixserve.core.config import ConfigError, ModelConfig

#: config.json fields that do not shape the built model (a reload may change them): every other
#: field, and "architectures" through ``architecture``, must equal the running model's, since
#: loading weights does not rebuild what the config fixed (RoPE tables, norms, soft-capping,
#: sliding windows, activations, the stop tokens, ...). Keys starting with "_" are free too.
RELOAD_FREE_FIELDS = frozenset({
    "architectures", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "bos_token_id", "pad_token_id", "initializer_range", "attention_dropout",
    "output_attentions", "output_hidden_states", "return_dict", "auto_map",
})  # fmt: skip
SHAPE_FIELDS = (
    "architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "vocab_size",
)  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
# Tensors whose shape follows from the config alone, by the end of their HF names: the rest
# depend on the model family's layout and are checked when they load.
_SHAPES = {
    "embed_tokens.weight": lambda c: [c.vocab_size, c.hidden_size],
    "lm_head.weight": lambda c: [c.vocab_size, c.hidden_size],
    "model.norm.weight": lambda c: [c.hidden_size],
    "input_layernorm.weight": lambda c: [c.hidden_size],
    "post_attention_layernorm.weight": lambda c: [c.hidden_size],
}


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files, as transformers picks them: the shards listed in
    ``model.safetensors.index.json`` when there is one, else ``model.safetensors`` when present,
    else every ``*.safetensors`` (a directory may also hold other files, e.g. Mistral's
    ``consolidated.safetensors`` in native names beside the HF shards)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise ConfigError(f"'{index}' is not a safetensors index (no weight_map): {e}") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()
        ):
            raise ConfigError(f"'{index}' is not a safetensors index (weight_map: name -> file)")
        files = [root / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ConfigError(f"'{index}' lists weight files that are missing: {', '.join(absent)}")
        return files
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model directory '{model_dir}' has no *.safetensors weights")
    return files


def check_reload_config(new: ModelConfig, old: ModelConfig, model_dir: str | Path) -> None:
    """ConfigError naming the first field where ``new`` (``model_dir``'s) would not load into
    a model built from ``old``."""
    for name in SHAPE_FIELDS:
        if getattr(new, name) != getattr(old, name):
            raise ConfigError(
                f"'{model_dir}' has {name}={getattr(new, name)!r}; the running model has "
                f"{getattr(old, name)!r} (only weights of the same shape can be loaded)"
            )
    # Every other field may have shaped the model when it was built (RoPE tables, norms,
    # whether the LM head is the embedding, ...): loading weights does not rebuild it
    fixed = sorted(
        name
        for name in new.raw.keys() | old.raw.keys()
        if name not in RELOAD_FREE_FIELDS and not name.startswith("_")
    )
    for name in fixed:
        if new.raw.get(name) != old.raw.get(name):
            raise ConfigError(
                f"'{model_dir}' has {name}={new.raw.get(name)!r}; the running model was "
                f"built with {old.raw.get(name)!r} (restart the server to load this model)"
            )


def check_checkpoint(model_dir: str | Path, running: ModelConfig) -> None:
    """ConfigError unless ``model_dir`` is a checkpoint that can load into ``running``'s model:
    a config.json of the same shape, and weight files whose headers read and whose tensors lie
    within the file. Reads only config.json and the files' headers."""
    try:
        _check_checkpoint(model_dir, running)
    except ConfigError:
        raise
    except (OSError, ValueError, TypeError, AttributeError, KeyError, RecursionError) as e:
        # a file broken in a way no check above names: still the checkpoint's fault (a 400)
        why = f"{type(e).__name__}: {e}"
        raise ConfigError(f"'{model_dir}' is not a readable checkpoint ({why:.300})") from None


def _check_checkpoint(model_dir: str | Path, running: ModelConfig) -> None:
    if not Path(model_dir).is_dir():
        raise ConfigError(f"'{model_dir}' is not a model directory")
    check_reload_config(ModelConfig.from_dir(model_dir), running, model_dir)
    for path in safetensors_files(model_dir):
        for name, shape in _read_header(path).items():
            expected = next((f(running) for end, f in _SHAPES.items() if name.endswith(end)), None)
            if expected is not None and shape != expected:
                raise ConfigError(f"'{path}': {name} has shape {shape}; this model's is {expected}")


def _read_header(path: Path) -> dict[str, list[int]]:
    """The shapes of the tensors in the safetensors file ``path``, from its header alone;
    ConfigError where the file cannot be read or its header is broken or points past it."""
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\xff"))
            if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
                raise ConfigError(f"'{path}' is not a safetensors file (bad header length)")
            header = json.loads(f.read(length))
    except ConfigError:
        raise  # a ValueError: not wrapped as an unreadable header below
    except OSError as e:
        raise ConfigError(f"cannot read '{path}': {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"'{path}' has no readable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"'{path}' has no readable safetensors header")
    data, shapes = size - 8 - length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise ConfigError(f"'{path}': tensor {name!r:.100} has no valid data_offsets")
        if offsets[1] > data:
            raise ConfigError(f"'{path}' is truncated: tensor {name!r:.100} ends past the file")
        shapes[name] = entry.get("shape")
    return shapes
