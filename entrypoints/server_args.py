"""Command-line flags of the server (SGLang spellings): server flags plus one flag per
EngineConfig field, built from the field's type and its ``metadata["help"]``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any

from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.config_checks import (
    DISAGGREGATION_MODES,
    DTYPES,
    LOG_LEVELS,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
)
from radixserve.core.request import POOLING_METHODS
from radixserve.entrypoints.admission import Limits
from radixserve.entrypoints.ipc import EngineReady
from radixserve.entrypoints.reasoning import REASONING_PARSERS
from radixserve.entrypoints.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Keys may come from the environment (or a file) instead of the command line, where `ps` shows
# them; a flag wins over the file, the file over the variable.
API_KEY_ENV = "RADIXSERVE_API_KEY"
ADMIN_API_KEY_ENV = "RADIXSERVE_ADMIN_API_KEY"
_CHOICES = {"schedule_policy": SCHEDULE_POLICIES, "dtype": DTYPES, "log_level": LOG_LEVELS}
_CHOICES["embedding_pooling"] = POOLING_METHODS
_CHOICES["disaggregation_mode"] = DISAGGREGATION_MODES
_CHOICES["quantization"] = QUANTIZATIONS
_FLAG_NAMES = {"plugins": "--plugin"}  # a repeatable flag reads better in the singular
_ALIASES = {"model_path": ("--model",), "tp_size": ("--tensor-parallel-size",)}


_LIMITS = {f.name: f.default for f in dataclasses.fields(Limits)}


def _opt(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


def _limit(name: str, help: str) -> Any:
    # The admission limits' defaults live in one place: admission.Limits.
    return _opt(_LIMITS[name], help)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerArgs:
    """Settings of the HTTP server process; the engine's live in ``engine``. Each field is a
    flag (``add_dataclass_flags``), its docstring-like ``help`` the flag's help."""

    engine: EngineConfig
    host: str = _opt("127.0.0.1", "Address to listen on")
    port: int = _opt(30000, "Port to listen on")
    api_key: str | None = _opt(
        None,
        "Require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on every route "
        f"but /health and /metrics (also from ${API_KEY_ENV} or --api-key-file, which keep it "
        "out of `ps`)",
    )
    api_key_file: str | None = _opt(None, "Read --api-key from this file (its first line)")
    admin_api_key: str | None = _opt(
        None,
        "SGLang's admin key: the admin routes (/flush_cache, /abort_request, "
        "/update_weights_from_disk, /start_profile, /stop_profile) need 'Authorization: Bearer "
        "KEY' with it, from any address; without it they answer only loopback clients (also "
        f"from ${ADMIN_API_KEY_ENV} or --admin-api-key-file)",
    )
    admin_api_key_file: str | None = _opt(
        None, "Read --admin-api-key from this file (its first line)"
    )
    profile_dir: str | None = _opt(
        None,
        "/start_profile writes traces only under this directory (default: "
        "$RADIXSERVE_TORCH_PROFILER_DIR, else $SGLANG_TORCH_PROFILER_DIR, else /tmp)",
    )
    chat_template: str | None = _opt(None, "Chat template: a Jinja file or template text")
    enable_metrics: bool = _opt(
        False,
        "Serve Prometheus /metrics under SGLang's names (sglang:*, docs/metrics.md); without it "
        "/metrics answers 404, as in SGLang",
    )
    is_embedding: bool = _opt(
        False,
        "SGLang's flag for embedding models: /get_model_info reports is_generation false. "
        "/v1/embeddings and /encode are served with or without it (from the causal model's "
        "final hidden states), and so is generation",
    )
    embedding_pooling: str = _opt(
        "last",
        "How /v1/embeddings and /encode pool the final hidden states: 'last' (the last "
        "token's, SGLang's pooling for causal models) or 'mean' (over every prompt token); "
        "the result is L2-normalised",
    )
    strict_model_name: bool = _opt(
        False,
        "OpenAI routes answer 404 for a 'model' other than the served name, 'default' or the "
        "model's path; default: any name is accepted, as SGLang does",
    )
    tool_call_parser: str | None = _opt(
        None,
        f"How tool calls are read from the model's output: {', '.join(sorted(TOOL_PARSERS))} "
        f"(default: {DEFAULT_TOOL_PARSER})",
    )
    reasoning_parser: str | None = _opt(
        None,
        "Split <think> blocks into reasoning_content: "
        f"{', '.join(sorted(REASONING_PARSERS))} (default: none, the text stays in content)",
    )
    incremental_streaming_output: bool = _opt(
        False,
        "Native /generate streams send only what is new in each event (text, output_ids, "
        "output logprobs), as SGLang's flag of that name; default: cumulative",
    )
    max_body_bytes: int = _opt(32 << 20, "Largest request body accepted")
    max_header_bytes: int = _opt(
        64 << 10, "Largest request head (request line + headers) accepted; larger ones are refused"
    )
    max_queued_requests: int = _limit(
        "max_queued_requests",
        "Requests that may wait beyond --max-running-requests; more get 503 with Retry-After",
    )
    request_timeout: float | None = _limit(
        "request_timeout",
        "Seconds a request may run before it is aborted (finish_reason abort); default: no limit",
    )
    max_n: int = _limit("max_n", "Largest n (choices per prompt)")
    max_stop_strings: int = _limit(
        "max_stop_strings", "Most stop strings (and most stop_token_ids) per request"
    )
    max_stop_length: int = _limit("max_stop_length", "Longest stop string, in characters")
    max_top_logprobs: int = _limit(
        "max_top_logprobs",
        "Most top logprobs per token (native top_logprobs_num; OpenAI caps its own at 20)",
    )
    request_read_timeout: float = _opt(
        30.0,
        "Slowloris guard: seconds a client gets to send a request's head (from connecting, or "
        "from the previous response on a keep-alive connection), and again its body; a slower "
        "client gets 408 and the connection is closed",
    )
    shutdown_timeout: float = _opt(
        30.0, "On SIGTERM: seconds in-flight requests get to finish before they are aborted"
    )

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
            max_batch_chars=self.max_body_bytes,
        )

    def to_json(self) -> dict[str, Any]:
        """Every setting, for /get_server_info (the API key is never shown)."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "engine"
        }
        out["api_key"] = "***" if self.api_key else None
        out["admin_api_key"] = "***" if self.admin_api_key else None
        out.update(dataclasses.asdict(self.engine))
        out["plugins"] = list(self.engine.plugins)
        out["plugin_allow"] = list(self.engine.plugin_allow)
        return out


def build_parser(prog: str = "radixserve serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a model over HTTP (OpenAI + native).")
    add_dataclass_flags(p, ServerArgs, skip=("engine",))
    add_dataclass_flags(p, EngineConfig)
    return p


def add_dataclass_flags(
    parser: Any, cls: type, skip: Sequence[str] = (), suppress: bool = False
) -> None:
    """One ``--flag`` per field of the config dataclass ``cls`` (the one flag generator of the
    server and the CLI): help from ``metadata["help"]``, type from the annotation (``X | None``
    is X; a bool is a switch, ``--no-`` form too when it defaults to True; a tuple is a
    repeatable flag). With ``suppress`` a flag not given is absent from the namespace, so the
    dataclass's own default applies (``dataclass_settings`` reads what was given)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flags = [_FLAG_NAMES.get(f.name, "--" + f.name.replace("_", "-"))]
        flags += _ALIASES.get(f.name, ())
        help_text = f.metadata.get("help", "")
        base = _base_type(f.name, hints[f.name])
        default = argparse.SUPPRESS if suppress else f.default
        kw: dict[str, Any] = {"dest": f.name}
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif base is tuple:
            kw.update(action="append", metavar=f.metadata.get("metavar", "KIND=NAME"))
            if f.metadata.get("nargs"):  # --flag A B ... (several after one flag, as SGLang)
                kw.update(action="extend", nargs=f.metadata["nargs"])
            default = argparse.SUPPRESS if suppress else None
        else:
            kw["type"] = base
            if f.name in _CHOICES:  # listed, not enforced here: EngineConfig checks the value
                help_text += f" (one of: {', '.join(_CHOICES[f.name])})"
            if f.default is not None and f.default is not dataclasses.MISSING:
                help_text += f" (default: {f.default})"
        if default is not dataclasses.MISSING:
            kw["default"] = default
        parser.add_argument(*flags, help=help_text, **kw)


def dataclass_settings(
    args: argparse.Namespace, cls: type, skip: Sequence[str] = ()
) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (flags added with ``suppress``)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if f.name not in skip and hasattr(args, f.name)
    }


def _base_type(name: str, hint: Any) -> Any:
    """int | None -> int; tuple[str, ...] -> tuple; bool, int, float and str as themselves."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    base = typing.get_origin(hint) or hint
    if base not in (bool, int, float, str, tuple):
        raise TypeError(f"{name} has type {hint!r}, which has no command-line form")
    return base


def parse_server_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse flags; a bad value exits with a one-line argparse error naming the flag."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    values = vars(ns)
    engine_values = {f.name: values.pop(f.name) for f in dataclasses.fields(EngineConfig)}
    engine_values["plugins"] = tuple(engine_values["plugins"] or ())
    engine_values["plugin_allow"] = tuple(engine_values["plugin_allow"] or ())
    for name in ("lora_paths", "lora_target_modules"):
        engine_values[name] = tuple(engine_values[name] or ())
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
    if not 0 <= values["port"] <= 65535:  # else bind() fails only after the model loaded
        parser.error(f"--port must be in [0, 65535], got {values['port']}")
    if values["embedding_pooling"] not in POOLING_METHODS:
        parser.error(
            f"--embedding-pooling must be one of {', '.join(POOLING_METHODS)}, "
            f"got '{values['embedding_pooling']}'"
        )
    for name, known in (
        ("tool_call_parser", TOOL_PARSERS),
        ("reasoning_parser", REASONING_PARSERS),
    ):
        if values[name] is not None and values[name] not in known:
            flag = "--" + name.replace("_", "-")
            parser.error(
                f"{flag} '{values[name]}' is unknown; available: {', '.join(sorted(known))}"
            )
    for key, env in (("api_key", API_KEY_ENV), ("admin_api_key", ADMIN_API_KEY_ENV)):
        try:
            values[key] = _resolve_key(values[key], values[key + "_file"], env)
        except ValueError as e:
            parser.error(str(e))
    return ServerArgs(engine=engine, **values)


def _resolve_key(flag: str | None, path: str | None, env: str) -> str | None:
    """A key from its flag, else its file's first line, else the environment variable ``env``;
    ValueError naming the source for an unreadable file or an empty key."""
    if flag is None and path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                flag = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the key file {path!r}: {e}") from None
        source = f"the key file {path!r}"
    elif flag is None:
        flag = os.environ.get(env)
        source = f"${env}"
    else:
        source = "the key flag"
    if flag is not None and not flag.strip():
        raise ValueError(f"{source} holds an empty key; set a non-empty one or leave it unset")
    return flag
