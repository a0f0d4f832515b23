"""Start the server: spawn the engine process, wait until it is ready, then serve HTTP with
uvicorn until interrupted, and stop the engine on the way out.

``radixserve serve ...`` and ``python -m radixserve.launch_server ...`` both call ``main``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn

from radixserve.core.config import ConfigError
from radixserve.core.tokenizer import Tokenizer
from radixserve.entrypoints.engine_client import EngineClient, EngineDied
from radixserve.entrypoints.http_protocol import guarded_h11
from radixserve.entrypoints.http_server import create_app
from radixserve.entrypoints.ipc import EngineReady
from radixserve.entrypoints.media import policy_of
from radixserve.entrypoints.metrics import ServerMetrics
from radixserve.entrypoints.routes_admin import admin_access
from radixserve.entrypoints.server_args import ServerArgs, parse_server_args
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

ABORT_GRACE_S = 3.0  # after --shutdown-timeout, for aborted responses to end
DEATH_GRACE_S = 2.0  # after the engine died, /health answers 503 this long before the exit


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
    if args.engine.node_rank > 0:  # another node's ranks: they follow node 0's server
        from radixserve.entrypoints import multinode

        try:
            return multinode.follow(dataclasses.asdict(args.engine))
        except (KeyboardInterrupt, SystemExit):
            return 1
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
    engine = dataclasses.asdict(args.engine)
    # the KV bootstrap server (a PD prefill) listens where the HTTP server does, unless told
    engine["disaggregation_bootstrap_host"] = engine["disaggregation_bootstrap_host"] or args.host
    try:
        client.start_process(engine)
        try:
            info = await client.wait_ready()
        except EngineDied as e:
            print(f"radixserve: the engine failed to start: {e}", file=sys.stderr)
            return 1
        tokenizer = Tokenizer(info.model_dir, chat_template=chat_template)
        metrics = ServerMetrics(args.model_name) if args.enable_metrics else None
        tm = TokenizerManager(client, info, tokenizer, metrics, args.limits(info))
        tm.images.policy = policy_of(args.engine)
        app = create_app(tm, args, metrics)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.engine.log_level,
            access_log=args.engine.log_level in ("debug", "info"),
            # Past --shutdown-timeout in-flight requests are aborted; this grace lets their
            # responses end with finish_reason abort before uvicorn cancels what is left.
            timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S,
            timeout_keep_alive=30,
            http=guarded_h11(args.request_read_timeout),  # the slowloris guard
            h11_max_incomplete_event_size=args.max_header_bytes,
        )
        server = DrainingServer(config, tm, args.shutdown_timeout)
        loop = asyncio.get_running_loop()

        def on_engine_death(reason: str) -> None:
            # Keep answering 503 on /health for a moment, so probes see why, then exit non-zero.
            print(f"radixserve: the engine died ({reason}); shutting down", file=sys.stderr)
            loop.call_later(DEATH_GRACE_S, setattr, server, "should_exit", True)

        tm.on_engine_death = on_engine_death
        client.start_receiving()
        announce = asyncio.get_running_loop().create_task(_announce(server, args, info))
        await server.serve()
        announce.cancel()
        return 1 if client.dead is not None or not server.started else 0
    finally:
        client.shutdown()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful shutdown in two stages: on SIGTERM it stops listening
    and refuses new requests (503), lets in-flight ones run for ``drain_s``, then aborts the
    rest."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, drain_s: float) -> None:
        super().__init__(config)
        self.tm = tm
        self.drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.tm.draining = True
        abort = asyncio.get_running_loop().call_later(self.drain_s, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    def _abort_in_flight(self) -> None:
        message = f"the server shut down: --shutdown-timeout={self.drain_s:g}s passed"
        self.tm.abort_all(message)
        print(f"radixserve: {message}; aborted {len(self.tm.reqs)} in-flight requests", flush=True)


#: What an SGLang server prints once it serves (tests/entrypoints/test_ready_line.py).
SGLANG_READY_LINE = "The server is fired up and ready to roll!"


async def _announce(server: uvicorn.Server, args: ServerArgs, info: EngineReady) -> None:
    while not server.started:  # uvicorn has no "bound" callback; this runs once, at start-up
        await asyncio.sleep(0.05)
    plugins = " ".join(f"{k}={v}" for k, v in info.plugins.items())
    print(
        f"radixserve: model {args.model_name} | plugins {plugins} | "
        f"KV pool {info.kv_size} tokens | context {info.max_context} | {info.numerics}",
        flush=True,
    )
    settings = ", ".join(f"{k}={v['value']} ({v['from']})" for k, v in info.settings.items())
    print(f"radixserve: settings {settings}", flush=True)
    print(f"radixserve: {admin_access(args.admin_api_key)}", flush=True)
    print(f"radixserve ready at http://{args.host}:{args.port}", flush=True)
    # SGLang's ready line, word for word: scripts written for SGLang servers wait for it.
    print(SGLANG_READY_LINE, flush=True)


if __name__ == "__main__":
    sys.exit(main())
