"""Start the server: spawn the engine process, wait until it is ready, then serve HTTP with
uvicorn until interrupted, and stop the engine on the way out.

``radixserve serve ...`` and ``python -m radixserve.launch_server ...`` both call ``main``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn

from radixserve.core.config import ConfigError
from radixserve.core.ipc import EngineReady
from radixserve.core.tokenizer import Tokenizer
from radixserve.entrypoints.engine_client import EngineClient, EngineDied
from radixserve.entrypoints.http_server import create_app
from radixserve.entrypoints.metrics import ServerMetrics
from radixserve.entrypoints.server_args import ServerArgs, parse_server_args
from radixserve.entrypoints.tokenizer_manager import TokenizerManager


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server; returns the process exit code."""
    args = parse_server_args(argv)
    level = args.engine.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        chat_template = _read_chat_template(args.chat_template)
    except ConfigError as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    # SIGTERM ends the server like Ctrl-C does: uvicorn drains, then the engine is stopped.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        return asyncio.run(serve(args, chat_template))
    except KeyboardInterrupt:
        return 0


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(f"--chat-template '{value}' is neither a file nor Jinja template text")


async def serve(args: ServerArgs, chat_template: str | None = None) -> int:
    client = EngineClient()
    try:
        client.start_process(dataclasses.asdict(args.engine))
        try:
            info = await client.wait_ready()
        except EngineDied as e:
            print(f"radixserve: the engine failed to start: {e}", file=sys.stderr)
            return 1
        tokenizer = Tokenizer(info.model_dir, chat_template=chat_template)
        metrics = ServerMetrics(args.model_name) if args.enable_metrics else None
        tm = TokenizerManager(client, info, tokenizer, metrics)
        app = create_app(tm, args, metrics)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.engine.log_level,
            access_log=args.engine.log_level in ("debug", "info"),
            timeout_graceful_shutdown=5,
            timeout_keep_alive=30,
        )
        server = uvicorn.Server(config)

        def on_engine_death(reason: str) -> None:
            print(f"radixserve: the engine died ({reason}); shutting down", file=sys.stderr)
            server.should_exit = True

        tm.on_engine_death = on_engine_death
        client.start_receiving()
        announce = asyncio.get_running_loop().create_task(_announce(server, args, info))
        await server.serve()
        announce.cancel()
        return 1 if client.dead is not None or not server.started else 0
    finally:
        client.shutdown()


async def _announce(server: uvicorn.Server, args: ServerArgs, info: EngineReady) -> None:
    while not server.started:  # uvicorn has no "bound" callback; this runs once, at start-up
        await asyncio.sleep(0.05)
    plugins = " ".join(f"{k}={v}" for k, v in info.plugins.items())
    print(
        f"radixserve: model {args.model_name} | plugins {plugins} | "
        f"KV pool {info.kv_size} tokens | context {info.max_context}",
        flush=True,
    )
    print(f"radixserve ready at http://{args.host}:{args.port}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
