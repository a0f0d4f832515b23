"""Read-only routes about the server: model and server info, load, health (SGLang's names)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

import radixserve
from radixserve.core.request import SamplingParams
from radixserve.entrypoints.gc_timer import GcTimer
from radixserve.entrypoints.http_errors import error_response
from radixserve.entrypoints.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixserve.entrypoints.metrics import ServerMetrics
from radixserve.entrypoints.server_args import ServerArgs
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

HEALTH_TIMEOUT_S = 20.0
GET_POST = ["GET", "POST"]


def add_info_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs, gc: GcTimer) -> None:
    name = args.model_name

    @app.api_route("/get_model_info", methods=GET_POST)
    @app.api_route("/model_info", methods=GET_POST)
    async def model_info() -> Any:
        return {
            "model_path": name,
            "tokenizer_path": name,
            "is_generation": not args.is_embedding,
            "served_model_name": name,
            "context_length": tm.info.max_context,
            "vocab_size": tm.info.vocab_size,
        }

    @app.api_route("/get_server_info", methods=GET_POST)
    @app.api_route("/server_info", methods=GET_POST)
    async def server_info() -> Any:
        return await _server_info(tm, args, gc)

    @app.get("/get_load")
    async def get_load() -> Any:
        """SGLang's worker load, one entry per data-parallel rank (here one), which
        sglang-router's power_of_two policy reads. Waiting: every live request not running
        (queued, compiling its grammar, or on a decode waiting for its KV); tokens: the KV in
        use plus the prompts of requests that have no output yet."""
        state = await tm.engine_state()
        live = [r for r in tm.reqs.values() if not r.finished]
        num_reqs = max(len(live), state.num_running + state.num_waiting)
        kv = state.kv
        queued = sum(len(r.prompt_ids) for r in live if not r.output_ids)
        return [
            {
                "dp_rank": 0,
                "num_reqs": num_reqs,
                "num_waiting_reqs": num_reqs - state.num_running,
                "num_tokens": kv["in_use"] + kv["locked"] + queued,
            }
        ]

    @app.get("/health")
    async def health() -> Any:
        if tm.client.check_alive() is not None:
            return error_response(503, f"the engine is not running: {tm.dead}")
        return {"status": "ok"}

    @app.api_route("/health_generate", methods=GET_POST)
    async def health_generate() -> Any:
        if tm.client.check_alive() is not None:
            return error_response(503, f"the engine is not running: {tm.dead}")
        ids = tm.encode("hi")[:4] or [0]
        req = tm.submit(ids, SamplingParams(max_new_tokens=1, temperature=0.0), asyncio.Event())
        try:
            await asyncio.wait_for(tm.wait_finished([req]), HEALTH_TIMEOUT_S)
        except TimeoutError:
            tm.abort(req.rid)
            return error_response(503, f"no token generated within {HEALTH_TIMEOUT_S:.0f} s")
        if req.failed:
            return error_response(503, f"generation failed: {req.finish}")
        return {"status": "ok"}


async def _server_info(tm: TokenizerManager, args: ServerArgs, gc: GcTimer) -> dict[str, Any]:
    state = await tm.engine_state()
    info = tm.info
    name = args.model_name
    return {
        **args.to_json(),
        # resolved (the flags are None for the default model): sglang-router registers the
        # worker under served_model_name, else model_path, else as "unknown"
        "served_model_name": name,
        "model_path": args.engine.model_path or info.model_dir,
        "version": radixserve.__version__,
        "model_name": name,
        "model_dir": info.model_dir,
        "context_length": info.max_context,
        "max_total_num_tokens": info.kv_size,
        # the resolved values (the flags above are None where a default applied)
        **{k: v["value"] for k, v in info.settings.items()},
        "engine_settings": info.settings,
        "active_plugins": info.plugins,
        "num_running_reqs": state.num_running,
        "num_waiting_reqs": state.num_waiting,
        "kv": state.kv,
        "cache_hit_rate": state.cache_hit_rate,
        # --enable-hierarchical-cache: tokens hit and moved per tier (None: off)
        "hicache": state.hicache,
        # a vision-language model: images encoded, encoder steps, encoder-cache hits (None: off)
        "multimodal": state.multimodal,
        "num_retractions": state.retractions,
        "num_preemptions": state.preemptions,  # retractions for a higher priority
        "priorities": state.priorities,  # per priority: admitted, queue_seconds, preempted
        "sessions": state.sessions,  # open sessions, pinned tokens, pin limit, demoted pins
        "num_steps": state.steps,
        # steps by kind (decode-only, mixed, prefill-only): count, decodes, prefill tokens,
        # wall seconds; where a server's step time goes
        "steps_by_kind": state.steps_by_kind,
        # garbage collections per generation (count, seconds) in each server process
        "gc": {"engine": state.gc, "http": gc.to_json()},
        # EngineCore.spec_stats(), live: settings and accept statistics (None: off)
        "speculative": state.speculative,
        # where SGLang's own scripts read the accept length (bench_serving, tests)
        "internal_states": [
            {"avg_spec_accept_length": state.speculative["avg_accept_length"]}
            if state.speculative
            else {}
        ],
        "num_live_requests": len(tm.reqs),
        "draining": tm.draining,
    }


def add_metrics_route(app: FastAPI, tm: TokenizerManager, metrics: ServerMetrics | None) -> None:
    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:  # SGLang serves no /metrics without the flag either
            return error_response(404, "metrics are off; start the server with --enable-metrics")
        state = await tm.engine_state() if tm.dead is None else None
        return Response(metrics.render(state), media_type=METRICS_CONTENT_TYPE)
