"""Command-line flags of the server (SGLang spellings): server flags plus one flag per
EngineConfig field, built from the field's type and its ``metadata["help"]``."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any

from radixserve.core.config import (
    DTYPES,
    LOG_LEVELS,
    SCHEDULE_POLICIES,
    ConfigError,
    EngineConfig,
)
from radixserve.core.ipc import EngineReady
from radixserve.entrypoints.admission import Limits

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
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
    incremental_streaming_output: bool = False
    max_body_bytes: int = 32 << 20
    max_header_bytes: int = 64 << 10
    max_queued_requests: int = 1024
    request_timeout: float | None = None
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_top_logprobs: int = 100
    request_read_timeout: float = 30.0
    shutdown_timeout: float = 30.0

    @property
    def model_name(self) -> str:
        """The model's public name: --served-model-name, the HF id of the default model, or
        the path given."""
        if self.engine.served_model_name:
            return self.engine.served_model_name
        return self.engine.model_path or DEFAULT_MODEL_NAME

    def limits(self, engine: EngineReady) -> Limits:
        """The admission limits the TokenizerManager enforces (``engine``: what the started
        engine resolved, e.g. max_running_requests from its platform's defaults)."""
        return Limits(
            max_queued_requests=self.max_queued_requests,
            max_running_requests=engine.max_running_requests,
            request_timeout=self.request_timeout,
            max_n=self.max_n,
            max_stop_strings=self.max_stop_strings,
            max_stop_length=self.max_stop_length,
            max_top_logprobs=self.max_top_logprobs,
        )

    def to_json(self) -> dict[str, Any]:
        """Every setting, for /get_server_info (the API key is never shown)."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine"
        }
        out["api_key"] = "***" if self.api_key else None
        out.update(dataclasses.asdict(self.engine))
        out["plugins"] = list(self.engine.plugins)
        out["plugin_allow"] = list(self.engine.plugin_allow)
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
        "--incremental-streaming-output",
        action="store_true",
        help="Native /generate streams send only what is new in each event (text, output_ids, "
        "output logprobs), as SGLang's flag of that name; default: cumulative",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=32 << 20, help="Largest request body accepted"
    )
    _add_limit_flags(p)
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        _add_engine_flag(p, f, hints[f.name])
    return p


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 << 10,
        help="Largest request head (request line + headers) accepted; larger ones are refused",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="Requests that may wait beyond --max-running-requests; more get 503 with Retry-After",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="Seconds a request may run before it is aborted (finish_reason abort); "
        "default: no limit",
    )
    p.add_argument("--max-n", type=int, default=16, help="Largest n (choices per prompt)")
    p.add_argument(
        "--max-stop-strings",
        type=int,
        default=16,
        help="Most stop strings (and most stop_token_ids) per request",
    )
    p.add_argument(
        "--max-stop-length", type=int, default=256, help="Longest stop string, in characters"
    )
    p.add_argument(
        "--max-top-logprobs",
        type=int,
        default=100,
        help="Most top logprobs per token (native top_logprobs_num; OpenAI caps its own at 20)",
    )
    p.add_argument(
        "--request-read-timeout",
        type=float,
        default=30.0,
        help="Slowloris guard: seconds a client gets to send a request's head (from connecting, "
        "or from the previous response on a keep-alive connection), and again its body; a "
        "slower client gets 408 and the connection is closed",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="On SIGTERM: seconds in-flight requests get to finish before they are aborted",
    )


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
        kw.update(action="append", default=None, metavar=f.metadata.get("metavar", "KIND=NAME"))
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
    engine_values["plugin_allow"] = tuple(engine_values["plugin_allow"] or ())
    if engine_values["model_path"] == DEFAULT_MODEL_NAME:
        engine_values["model_path"] = None  # the hub id of the default model: use the bundled copy
    try:
        engine = EngineConfig(**engine_values)
    except ConfigError as e:
        parser.error(str(e))
    for name in (
        "max_header_bytes", "max_queued_requests", "max_n", "max_stop_strings", "max_top_logprobs"
    ):  # fmt: skip
        if values[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {values[name]}")
    for name in ("request_timeout", "shutdown_timeout", "max_stop_length", "request_read_timeout"):
        if values[name] is not None and not values[name] > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {values[name]}")
    return ServerArgs(engine=engine, **values)
