"""The ``radixserve`` command: ``serve``, ``plugins`` and ``generate``.

Module-level imports stay light: ``radixserve --help`` and ``radixserve plugins`` never import
the engine (registries hold lazy factories), and ``generate`` imports it only when it runs.
User errors (a bad plugin, setting or request) print one ``error: ...`` line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import pluggy

from radixserve import __version__
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.interfaces import PLUGIN_KINDS
from radixserve.core.multimodal import accepts_images
from radixserve.core.plugins import (
    PluginError,
    PluginHost,
    default_host,
    parse_plugin_selections,
)
from radixserve.core.request import InvalidRequest, SamplingParams
from radixserve.entrypoints.server_args import add_dataclass_flags, dataclass_settings

#: Errors that are the user's (or a plugin author's) to fix: one line, no traceback.
USER_ERRORS = (
    PluginError,
    pluggy.PluginValidationError,  # a hook implementation matching no hookspec
    ConfigError,
    InvalidRequest,
    FileNotFoundError,
)
EXIT_USAGE = 2
LAUNCH_SERVER_MODULE = "radixserve.entrypoints.launch_server"
_TABLE_COLUMNS = ("KIND", "NAME", "STATUS", "PLUGIN", "REASON/DESCRIPTION")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``radixserve`` command line; returns the process exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args[:1] == ["serve"]:
            # The server owns its flags (and its --help): hand it everything after `serve`.
            return _serve(args[1:])
        namespace = build_parser().parse_args(args)
        return namespace.run(namespace)
    except USER_ERRORS as e:
        return fail(str(e))


def console_main() -> None:
    """The ``radixserve`` executable: ``main``, then the process ends without the interpreter's
    teardown (a stopped server would spend seconds in it; entrypoints/process_exit.py)."""
    from radixserve.entrypoints.process_exit import run_then_exit

    run_then_exit(main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve", description="radixserve: LLM serving with a radix-tree KV prefix cache"
    )
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser(
        "serve",
        add_help=False,
        help="start the HTTP server (OpenAI and native API); `radixserve serve --help` for flags",
    )
    _add_plugins_command(commands)
    _add_generate_command(commands)
    return parser


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print ``error: message`` as one line on stderr; return ``code``."""
    one_line = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"error: {one_line}", file=sys.stderr)
    return code


# -- serve -------------------------------------------------------------------------------------


def _serve(argv: list[str]) -> int:
    try:
        launch_server = importlib.import_module(LAUNCH_SERVER_MODULE)
    except ModuleNotFoundError as e:
        if e.name != LAUNCH_SERVER_MODULE:
            raise
        return fail(f"`radixserve serve` needs {LAUNCH_SERVER_MODULE}, which is not installed")
    return launch_server.main(argv) or 0


# -- plugins -----------------------------------------------------------------------------------


def _add_plugins_command(commands: Any) -> None:
    cmd = commands.add_parser(
        "plugins",
        help="list every plugin kind, implementation, status and reason",
        description="List the implementations registered for each plugin kind "
        f"({', '.join(PLUGIN_KINDS)}), whether each is available, and why not.",
    )
    cmd.add_argument("--json", action="store_true", help="print JSON grouped by kind")
    cmd.set_defaults(run=_run_plugins)


def _run_plugins(args: argparse.Namespace) -> int:
    listing = plugin_listing(default_host())
    if args.json:
        print(json.dumps(listing, indent=2))
    else:
        print(format_table(_table_rows(listing)))
    return 0


def plugin_listing(host: PluginHost) -> dict[str, list[dict[str, Any]]]:
    """{kind: [{name, status, plugin, reason, description, priority}]} for every kind; model
    families add ``images``: whether they accept images (docs/vision.md)."""
    listing: dict[str, list[dict[str, Any]]] = {}
    for kind in PLUGIN_KINDS:
        listing[kind] = []
        for reg in host.registries[kind].entries():
            reason = reg.unavailable_reason()
            listing[kind].append(
                {
                    "name": reg.name,
                    "status": "available" if reason is None else "unavailable",
                    "plugin": reg.plugin,
                    "reason": reason,
                    "description": reg.description,
                    "priority": reg.priority,
                }
            )
            if kind == "model":
                listing[kind][-1]["images"] = accepts_images(reg.factory)
    return listing


def _table_rows(listing: dict[str, list[dict[str, Any]]]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for kind, entries in listing.items():
        if not entries:
            rows.append((kind, "-", "-", "-", "no implementation registered"))
        for e in entries:
            note = e["reason"] if e["reason"] is not None else e["description"]
            if e.get("images"):
                note += " [images in]"
            rows.append((kind, e["name"], e["status"], e["plugin"], note))
    return rows


def format_table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...] = _TABLE_COLUMNS) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return "\n".join(lines)


# -- generate ----------------------------------------------------------------------------------

# EngineConfig fields that `generate` spells itself (positional-like or repeatable).
_GENERATE_OWN_FIELDS = ("model_path", "plugins")


def _add_generate_command(commands: Any) -> None:
    defaults = SamplingParams()
    helps = EngineConfig.field_help()
    cmd = commands.add_parser(
        "generate",
        help="generate one completion offline (no server) and print its text",
        description="Load the model in this process, complete one prompt and print the text.",
    )
    cmd.add_argument("--model-path", default=None, help=helps["model_path"])
    cmd.add_argument("--prompt", required=True, help="the prompt text")
    cmd.add_argument(
        "--max-new-tokens",
        type=int,
        default=defaults.max_new_tokens,
        help="most tokens to generate (default: %(default)s)",
    )
    cmd.add_argument(
        "--temperature",
        type=float,
        default=defaults.temperature,
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )
    cmd.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    cmd.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    cmd.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="KIND=NAME",
        help=f"{helps['plugins']}; kinds: {', '.join(PLUGIN_KINDS)}; see `radixserve plugins`",
    )
    cmd.add_argument(
        "--json", action="store_true", help="print the whole result (text, output_ids, meta_info)"
    )
    add_engine_config_args(cmd.add_argument_group("engine settings"), _GENERATE_OWN_FIELDS)
    cmd.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    settings = engine_settings(args, _GENERATE_OWN_FIELDS)
    # Check the settings and --plugin spelling before paying for torch and the model.
    config = EngineConfig(plugins=tuple(args.plugin), **settings)
    parse_plugin_selections(config.plugins)
    configure_logging(config.log_level)
    from radixserve.entrypoints.engine import Engine  # deferred: imports torch and the model

    sampling = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
    }
    engine = Engine(args.model_path, plugins=tuple(args.plugin), **settings)
    try:
        result = engine.generate(args.prompt, sampling)
    finally:
        engine.shutdown()
    reason = result["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort":
        return fail(f"the request was aborted: {reason.get('message')}", code=1)
    print(json.dumps(result) if args.json else result["text"])
    return 0


def configure_logging(level_name: str) -> None:
    level = logging.getLevelName(level_name.upper())
    if not isinstance(level, int):
        raise ConfigError(f"unknown log level '{level_name}'; choose debug, info, warning, error")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


# -- EngineConfig fields as flags ----------------------------------------------------------------


def add_engine_config_args(parser: Any, skip: Sequence[str] = ()) -> None:
    """One ``--flag`` per EngineConfig field, from the server's own flag generator; a flag not
    given stays out of the namespace, so EngineConfig's defaults stay the single source."""
    add_dataclass_flags(parser, EngineConfig, skip=skip, suppress=True)


def engine_settings(args: argparse.Namespace, skip: Sequence[str] = ()) -> dict[str, Any]:
    """The EngineConfig fields the user gave on the command line, as keyword arguments."""
    return dataclass_settings(args, EngineConfig, skip)


if __name__ == "__main__":
    sys.exit(main())
