"""Model-path resolution: the default model and GGUF files become cached HF-layout directories."""

from __future__ import annotations

from pathlib import Path

from radixserve.core.hookspecs import hookimpl

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@hookimpl
def resolve_model_dir(model_path: str | None) -> str | None:
    from radixserve.plugins.models.gguf_loader import (
        convert_gguf_to_hf_dir,
        default_model_gguf_path,
    )

    if model_path is None:
        return str(convert_gguf_to_hf_dir(default_model_gguf_path(), progress=True))
    if str(model_path).endswith(".gguf") and Path(model_path).is_file():
        return str(convert_gguf_to_hf_dir(model_path, progress=True))
    return None
