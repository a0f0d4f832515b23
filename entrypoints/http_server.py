"""The FastAPI app: OpenAI routes, the native /generate, and the admin routes SGLang's
clients call (model/server info, health, cache flush, abort, tokenize, metrics, profiling).

Every route except /health and /metrics needs the API key when one is set (GuardMiddleware).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

import radixserve
from radixserve.core.config import ModelConfig
from radixserve.core.request import InvalidRequest, SamplingParams
from radixserve.entrypoints.bootstrap import refused_rooms
from radixserve.entrypoints.gc_timer import freeze_if_asked, process_gc_timer
from radixserve.entrypoints.http_errors import (
    ApiError,
    GuardMiddleware,
    error_body,
    error_response,
    install_error_handlers,
    is_client_error,
)
from radixserve.entrypoints.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from radixserve.entrypoints.metrics import ServerMetrics
from radixserve.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from radixserve.entrypoints.profiling import start_profile, stop_profile
from radixserve.entrypoints.server_args import ServerArgs
from radixserve.entrypoints.serving_chat import ChatServing
from radixserve.entrypoints.serving_completions import CompletionServing
from radixserve.entrypoints.serving_embedding import EmbeddingServing, add_embedding_routes
from radixserve.entrypoints.serving_native import NativeServing
from radixserve.entrypoints.serving_score import ScoreServing, add_score_routes
from radixserve.entrypoints.serving_weights import add_weight_routes
from radixserve.entrypoints.streaming import json_response
from radixserve.entrypoints.tokenizer_manager import TokenizerManager

HEALTH_TIMEOUT_S = 20.0
GET_POST = ["GET", "POST"]
MAX_JSON_DEPTH = 256  # deeper request bodies are refused (no real request nests past ~5)
# /tokenize's fields that shape a chat's rendering, as on /v1/chat/completions
CHAT_RENDER_FIELDS = (
    "messages", "tools", "tool_choice", "documents", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message",
)  # fmt: skip


async def read_json(request: Request) -> Any:
    """The body as JSON; an empty body is ``{}``. Invalid JSON is a 400."""
    checked = getattr(request.state, "checked_json", None)
    if checked is not None:  # refuse_deep_json decoded it already (one decode per body)
        return checked[0]
    data = await request.body()
    if not data.strip():
        return {}
    try:
        return _decode_shallow(data)
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def _decode_shallow(data: bytes) -> Any:
    """``data`` decoded; a 400 where it nests deeper than MAX_JSON_DEPTH (msgspec.DecodeError
    where it is not JSON)."""
    try:
        body = msgspec.json.decode(data)
        too_deep = _depth_exceeds(body, MAX_JSON_DEPTH)
    except RecursionError:  # msgspec stops at the interpreter's recursion limit
        too_deep = True
    if too_deep:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return body


def _depth_exceeds(value: Any, limit: int) -> bool:
    # msgspec decodes any depth; the handlers walk bodies recursively, so refuse deep ones here.
    stack = [(value, 1)] if isinstance(value, (list, dict)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return False


async def refuse_deep_json(request: Request) -> None:
    """Every route's body gets read_json's depth limit, those FastAPI parses into a model
    included: pydantic takes any depth in free-form fields (tool parameters, template
    arguments), which the handlers then walk recursively. A body that is not JSON is left to
    the route's own parser, which names what is wrong with it."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    data = await request.body()
    try:
        body = _decode_shallow(data) if data.strip() else {}
    except msgspec.DecodeError:
        return
    # read_json hands the route this value, not a second decode of the same bytes
    request.state.checked_json = (body,)


async def read_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; any other JSON value is a 400."""
    body = await read_json(request)
    if not isinstance(body, dict):
        kind = "null" if body is None else type(body).__name__
        raise ApiError(400, f"the request body must be a JSON object, got {kind}")
    return body


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
    )
    install_error_handlers(app)
    gc_timer = process_gc_timer()  # counts from here: /server_info's gc.http
    freeze_if_asked()
    name = args.model_name
    aliases = [a for a in (args.engine.model_path, tm.info.model_dir) if a]
    strict = args.strict_model_name
    chat = ChatServing(
        tm,
        name,
        aliases,
        strict,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    completions = CompletionServing(tm, name, aliases, strict)
    native = NativeServing(tm, incremental=args.incremental_streaming_output)
    hidden_size = ModelConfig.from_dir(tm.info.model_dir).hidden_size
    embedding = EmbeddingServing(tm, name, aliases, strict, args.embedding_pooling, hidden_size)
    add_embedding_routes(app, embedding, read_json)
    add_score_routes(app, ScoreServing(tm, name, aliases, strict))
    add_weight_routes(app, tm)

    # -- OpenAI --------------------------------------------------------------------------------

    async def refusing_rooms(call: Awaitable[Any], body: Any) -> Any:
        """A refused call tells the other side of its rooms (PD routers) at once."""
        try:
            return await call
        except Exception as e:
            tm.refuse_rooms(refused_rooms(body), str(e), is_client_error(e))
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await refusing_rooms(chat.create(body, raw), body)

    @app.post("/v1/completions")
    async def text_completions(body: CompletionRequest, raw: Request) -> Any:
        return await refusing_rooms(completions.create(body, raw), body)

    @app.get("/v1/models")
    async def models() -> Any:
        card = ModelCard(id=name, root=name, max_model_len=tm.info.max_context)
        return json_response(ModelList(data=[card]))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Any:
        # the served name and its aliases; SGLang and OpenAI answer 404 for any other id
        if model not in chat.accepted:
            body = error_body(404, f"The model '{model}' does not exist", "model")
            body["error"].update(type="invalid_request_error", code="model_not_found")
            return json_response(body, 404)
        return json_response(ModelCard(id=model, root=name, max_model_len=tm.info.max_context))

    # -- native ------------------------------------------------------------------------------

    @app.api_route("/generate", methods=GET_POST)
    async def generate(raw: Request) -> Any:
        return await native.generate(await read_json(raw), raw)

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
        state = await tm.engine_state()
        info = tm.info
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
            "num_retractions": state.retractions,
            "num_steps": state.steps,
            # steps by kind (decode-only, mixed, prefill-only): count, decodes, prefill tokens,
            # wall seconds; where a server's step time goes
            "steps_by_kind": state.steps_by_kind,
            # garbage collections per generation (count, seconds) in each server process
            "gc": {"engine": state.gc, "http": gc_timer.to_json()},
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

    @app.api_route("/flush_cache", methods=GET_POST)
    async def flush_cache() -> Any:
        if not await tm.flush_cache():
            return error_response(400, "cache not flushed: requests are running; retry when idle")
        return {"success": True, "message": "cache flushed"}

    @app.post("/abort_request")
    async def abort_request(raw: Request) -> Any:
        body = await read_object(raw)
        abort_all = body.get("abort_all")
        if abort_all is not None and not isinstance(abort_all, bool):
            raise InvalidRequest(f"abort_all must be true or false, got {abort_all!r:.200}")
        if abort_all:
            tm.abort_all()
        elif isinstance(body.get("rid"), str):
            tm.abort(body["rid"])
        else:
            raise InvalidRequest("send {'rid': <request id>} or {'abort_all': true}")
        return {"success": True}

    # SGLang registers both the /v1/ and the bare paths (TokenizeRequest, DetokenizeRequest).
    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Any:
        body = await read_object(raw)
        prompt = body.get("prompt", body.get("text"))
        special = body.get("add_special_tokens", True) is not False
        if body.get("messages") is not None:
            if prompt is not None:
                raise InvalidRequest("send exactly one of 'prompt' or 'messages'")
            tokens: Any = chat_prompt_ids(body)
            count: Any = len(tokens)
        elif isinstance(prompt, str):
            tokens = tm.encode(prompt, special)
            count = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [tm.encode(p, special) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise InvalidRequest(
                "prompt must be a string or a list of strings (or send 'messages', a chat)"
            )
        return {"tokens": tokens, "count": count, "max_model_len": tm.info.max_context}

    def chat_prompt_ids(body: dict[str, Any]) -> list[int]:
        """/tokenize's ``messages``: the ids a chat completion with these messages (and tools,
        documents, chat_template_kwargs, add_generation_prompt, continue_final_message)
        prompts with, from the chat route's own rendering."""
        fields = {k: body[k] for k in CHAT_RENDER_FIELDS if body.get(k) is not None}
        try:
            request = ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:  # 400 naming the field, as on /v1/chat/completions
            raise RequestValidationError(e.errors()) from None
        return chat.prompt_ids(request)

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Any:
        body = await read_object(raw)
        tokens = body.get("tokens")
        skip = body.get("skip_special_tokens", True) is not False
        if isinstance(tokens, list) and tokens and isinstance(tokens[0], list):  # a batch
            batch = [_token_ids(t, f"tokens[{i}]") for i, t in enumerate(tokens)]
            return {"text": [tm.tokenizer.decode(t, skip_special_tokens=skip) for t in batch]}
        ids = _token_ids(tokens, "tokens", batch_ok=True)
        return {"text": tm.tokenizer.decode(ids, skip_special_tokens=skip)}

    def _token_ids(value: Any, field: str, batch_ok: bool = False) -> list[int]:
        vocab = tm.info.vocab_size
        shape = "a list of token ids or a list of such lists" if batch_ok else "a list of token ids"
        if not isinstance(value, list):
            raise InvalidRequest(f"{field} must be {shape}", param=field)
        for j, t in enumerate(value):
            if not isinstance(t, int) or isinstance(t, bool):
                raise InvalidRequest(
                    f"{field} must be {shape}; {field}[{j}] is {t!r:.100}", param=field
                )
            if not 0 <= t < vocab:
                raise InvalidRequest(
                    f"{field}[{j}] = {t} is outside the vocabulary [0, {vocab})", param=field
                )
        return value

    @app.api_route("/start_profile", methods=GET_POST)
    async def start_profile_route(raw: Request) -> Any:
        return await start_profile(tm, await read_object(raw))

    @app.api_route("/stop_profile", methods=GET_POST)
    async def stop_profile_route() -> Any:
        return await stop_profile(tm)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if metrics is None:  # SGLang serves no /metrics without the flag either
            return error_response(404, "metrics are off; start the server with --enable-metrics")
        state = await tm.engine_state() if tm.dead is None else None
        return Response(metrics.render(state), media_type=METRICS_CONTENT_TYPE)

    return app
