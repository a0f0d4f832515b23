"""POST /update_weights_from_disk: SGLang's in-place weight reload.

A checkpoint directory is checked first, here, pausing nothing (core/checkpoint.py: its config
fits the running model, its weight files' headers read): a bad one is a 400 at once. Then the
engine stops admitting requests, lets the running ones finish on the old weights, loads the new
checkpoint into the model, flushes the prefix cache (its KV came from the old weights) and
admits again; requests that arrived meanwhile wait and then run on the new weights. A bad path
or a checkpoint of another shape leaves the old weights serving and answers ``success: false``
(status 400, as SGLang) with the reason.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from radixserve.core.checkpoint import check_checkpoint
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.request import InvalidRequest
from radixserve.entrypoints.openai_protocol import STRICT
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

# What this server reads: HF-layout safetensors (or what a resolve_model_dir plugin converts).
LOAD_FORMATS = (None, "auto", "safetensors")


class UpdateWeightsRequest(BaseModel):
    model_config = STRICT
    model_path: str
    load_format: str | None = None
    # abort the running and waiting requests first instead of letting them finish
    abort_all_requests: bool = False


def add_weight_routes(app: FastAPI, tm: TokenizerManager) -> None:
    running = ModelConfig.from_dir(tm.info.model_dir)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsRequest, raw: Request) -> Any:
        # not printable: NUL, control characters and lone surrogates, which no path holds
        if not body.model_path.strip() or not body.model_path.isprintable():
            raise InvalidRequest("model_path must be a printable path naming a model directory")
        if body.load_format not in LOAD_FORMATS:
            raise InvalidRequest(
                f"load_format {body.load_format!r:.100} is not supported; use 'auto' or "
                "'safetensors'"
            )
        try:
            local = _local_path(body.model_path)  # else a name resolve_model_dir plugins resolve
        except OSError as e:  # e.g. a name too long for the file system
            raise InvalidRequest(f"model_path cannot be a path here: {e.strerror or e}") from None
        if local:
            try:  # off the event loop: it reads files
                await asyncio.to_thread(check_checkpoint, body.model_path, running)
            except ConfigError as e:
                content = {"success": False, "message": f"weights not loaded: {e}"}
                return JSONResponse({**content, "num_paused_requests": 0}, status_code=400)
        if body.abort_all_requests:
            tm.abort_all("aborted for a weight update")
        reply = await tm.update_weights(body.model_path)
        content = {
            "success": reply.success,
            "message": reply.message,
            "num_paused_requests": reply.num_paused_requests,
        }
        return JSONResponse(content, status_code=200 if reply.success else 400)


def _local_path(model_path: str) -> bool:
    """Whether ``model_path`` names a local checkpoint directory (or a missing one, or a file
    that cannot be one): a directory, a path spelled as one (absolute, ./, ../) that does not
    exist, or an existing file other than a .gguf. A .gguf file or a hub name is left to the
    engine's resolve_model_dir plugins."""
    path = Path(model_path)
    if path.is_dir():
        return True
    if path.exists():
        return path.suffix != ".gguf"
    return model_path.startswith(("/", "./", "../"))
