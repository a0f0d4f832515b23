"""Command-line flags of the server (SGLang spellings): server flags plus one flag per
EngineConfig field, built from the field's type and its ``metadata["help"]``."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any

from radixserve.core.config import DTYPES, SCHEDULE_POLICIES, ConfigError, EngineConfig

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOG_LEVELS = ("debug", "info", "warning", "error")
_CHOICES = {"schedule_policy": SCHEDULE_POLICIES, "dtype": DTYPES, "log_level": LOG_LEVELS}
_FLAG_NAMES = {"plugins": "--plugin"}  # a repeatable flag reads better in the singular
_ALIASES = {"model_path": ("--model",)}


@dataclasses.dataclass(frozen=True, slots=True)
class ServerArgs:
    """Settings of the HTTP server process; the engine's live in ``engine``."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    chat_template: str | None = None
    enable_metrics: bool = False
    max_body_bytes: int = 32 << 20

    @property
    def model_name(self) -> str:
        """The model's public name: --served-model-name, the HF id of the default model, or
        the path given."""
        if self.engine.served_model_name:
            return self.engine.served_model_name
        return self.engine.model_path or DEFAULT_MODEL_NAME

    def to_json(self) -> dict[str, Any]:
        """Every setting, for /get_server_info (the API key is never shown)."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine"
        }
        out["api_key"] = "***" if self.api_key else None
        out.update(dataclasses.asdict(self.engine))
        out["plugins"] = list(self.engine.plugins)
        return out


def build_parser(prog: str = "radixserve serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP (OpenAI + native).")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on")
    p.add_argument("--port", type=int, default=30000, help="Port to listen on")
    p.add_argument("--api-key", default=None, help="Require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--chat-template", default=None, help="Chat template: a Jinja file or template text"
    )
    p.add_argument("--enable-metrics", action="store_true", help="Serve Prometheus /metrics")
    p.add_argument(
        "--max-body-bytes", type=int, default=32 << 20, help="Largest request body accepted"
    )
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        _add_engine_flag(p, f, hints[f.name])
    return p


def _add_engine_flag(p: argparse.ArgumentParser, f: dataclasses.Field[Any], hint: Any) -> None:
    flags = [_FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-")), *_ALIASES.get(f.name, ())]
    help_text = f.metadata.get("help", "")
    kw: dict[str, Any] = {"dest": f.name, "help": help_text}
    if f.default is not dataclasses.MISSING:
        kw["default"] = f.default
    base = _base_type(hint)
    if base is bool:
        kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
    elif base is tuple:
        kw.update(action="append", default=None, metavar="KIND=NAME")
    else:
        kw["type"] = base
        if f.name in _CHOICES:
            kw["choices"] = _CHOICES[f.name]
    p.add_argument(*flags, **kw)


def _base_type(hint: Any) -> Any:
    """int | None -> int; tuple[str, ...] -> tuple."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return typing.get_origin(hint) or hint


def parse_server_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse flags; a bad value exits with a one-line argparse error naming the flag."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = vars(ns)
    engine_values = {f.name: values.pop(f.name) for f in dataclasses.fields(EngineConfig)}
    engine_values["plugins"] = tuple(engine_values["plugins"] or ())
    if engine_values["model_path"] == DEFAULT_MODEL_NAME:
        engine_values["model_path"] = None  # the hub id of the default model: use the bundled copy
    try:
        engine = EngineConfig(**engine_values)
    except ConfigError as e:
        parser.error(str(e))
    return ServerArgs(engine=engine, **values)
