"""POST /load_lora_adapter and /unload_lora_adapter: SGLang's run-time LoRA routes (admin).

``{"lora_name": ..., "lora_path": ...}`` loads a PEFT adapter directory between engine steps;
``{"lora_name": ...}`` unloads one (requests already running with it finish with it; new ones
naming it get a 400). Both answer ``{"success", "error_message", "loaded_adapters"}``, 400 when
``success`` is false (docs/lora.md).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from radixserve.core.request import InvalidRequest
from radixserve.entrypoints import ipc
from radixserve.entrypoints.openai_protocol import STRICT
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

LORA_PATHS = frozenset({"/load_lora_adapter", "/unload_lora_adapter"})


class LoadLoraRequest(BaseModel):
    model_config = STRICT
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's field; every loaded adapter stays until unloaded here


class UnloadLoraRequest(BaseModel):
    model_config = STRICT
    lora_name: str


def _answer(reply: ipc.LoraReply) -> JSONResponse:
    content = {
        "success": reply.success,
        "error_message": reply.error_message,
        "loaded_adapters": reply.loaded_adapters,
    }
    return JSONResponse(content, status_code=200 if reply.success else 400)


def _check_name(name: str) -> str:
    name = name.strip()
    if not name or not name.isprintable() or ":" in name:
        raise InvalidRequest("lora_name must be a printable name without ':'")
    return name


def add_lora_routes(app: FastAPI, tm: TokenizerManager) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest) -> Any:
        name = _check_name(body.lora_name)
        if not body.lora_path.strip() or not body.lora_path.isprintable():
            raise InvalidRequest("lora_path must be a printable path of a PEFT adapter directory")
        return _answer(
            await tm.lora_call(lambda call_id: ipc.LoadLoraRequest(call_id, name, body.lora_path))
        )

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest) -> Any:
        name = _check_name(body.lora_name)
        return _answer(await tm.lora_call(lambda call_id: ipc.UnloadLoraRequest(call_id, name)))
