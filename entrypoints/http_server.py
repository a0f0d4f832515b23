"""The FastAPI app, assembled from its route groups: OpenAI (routes_openai), the Anthropic
Messages and OpenAI Responses APIs (routes_agents), SGLang's native /generate and tokenizing
(routes_native), embeddings and scores, read-only server info and health (routes_info), and
the admin routes that change the server's state (routes_admin).

GuardMiddleware checks the API keys in front of every route: /health and /metrics are public,
admin routes need --admin-api-key or a loopback client, the rest need --api-key when one is set.
"""

from __future__ import annotations

from fastapi import Depends, FastAPI

import radixserve
from radixserve.core.config import ModelConfig
from radixserve.entrypoints.gc_timer import freeze_if_asked, process_gc_timer
from radixserve.entrypoints.http_errors import GuardMiddleware, install_error_handlers
from radixserve.entrypoints.http_json import read_json, refuse_deep_json
from radixserve.entrypoints.metrics import ServerMetrics
from radixserve.entrypoints.profiling import ProfileDir
from radixserve.entrypoints.routes_admin import ADMIN_PATHS, add_admin_routes
from radixserve.entrypoints.routes_agents import add_agent_routes
from radixserve.entrypoints.routes_info import add_info_routes, add_metrics_route
from radixserve.entrypoints.routes_native import add_native_routes
from radixserve.entrypoints.routes_openai import add_openai_routes
from radixserve.entrypoints.routes_sessions import add_session_routes
from radixserve.entrypoints.server_args import ServerArgs
from radixserve.entrypoints.serving_chat import ChatServing
from radixserve.entrypoints.serving_completions import CompletionServing
from radixserve.entrypoints.serving_embedding import EmbeddingServing, add_embedding_routes
from radixserve.entrypoints.serving_native import NativeServing
from radixserve.entrypoints.serving_score import ScoreServing, add_score_routes
from radixserve.entrypoints.tokenizer_manager import TokenizerManager


def create_app(
    tm: TokenizerManager, args: ServerArgs, metrics: ServerMetrics | None = None
) -> FastAPI:
    app = FastAPI(
        title="radixserve", version=radixserve.__version__, docs_url=None, redoc_url=None,
        dependencies=[Depends(refuse_deep_json)],
    )  # fmt: skip
    app.add_middleware(
        GuardMiddleware,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_header_bytes=args.max_header_bytes,
        admin_key=args.admin_api_key,
        admin_paths=ADMIN_PATHS,
    )
    install_error_handlers(app)
    gc_timer = process_gc_timer()  # counts from here: /server_info's gc.http
    freeze_if_asked()
    name, strict = args.model_name, args.strict_model_name
    aliases = [a for a in (args.engine.model_path, tm.info.model_dir) if a]
    chat = ChatServing(
        tm,
        name,
        aliases,
        strict,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    add_openai_routes(app, tm, chat, CompletionServing(tm, name, aliases, strict))
    add_agent_routes(app, chat)
    native = NativeServing(tm, incremental=args.incremental_streaming_output)
    add_native_routes(app, tm, native, chat)
    add_session_routes(app, tm)
    hidden_size = ModelConfig.from_dir(tm.info.model_dir).hidden_size
    embedding = EmbeddingServing(tm, name, aliases, strict, args.embedding_pooling, hidden_size)
    add_embedding_routes(app, embedding, read_json)
    add_score_routes(app, ScoreServing(tm, name, aliases, strict))
    add_info_routes(app, tm, args, gc_timer)
    add_metrics_route(app, tm, metrics)
    add_admin_routes(app, tm, ProfileDir.configured(args.profile_dir))
    return app
