"""Messages between the server process and the engine process (msgspec structs, msgpack).

Two one-way ZMQ IPC channels: the server PUSHes ``EngineInbound`` messages to the engine and
PULLs ``EngineOutbound`` messages back. Every message is a tagged struct; nothing is pickled.

Per step the engine sends one ``StepOutput`` for the requests that changed: their new token
ids and text, column by column, and ``ReqExtras`` only for those that have more (logprobs, a
finish, a changed count); never the whole request. Each request gets exactly one output with
``finish`` set, after which the engine forgets it.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from radixserve.core.disaggregation import Bootstrap
from radixserve.core.multimodal import MultimodalInputs
from radixserve.core.request import FinishReason, SamplingParams
from radixserve.core.sessions import SessionParams

# -- server -> engine ------------------------------------------------------------------------


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True):
    """Queue a request; the prompt is already tokenized and the params validated."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    extra_key: str | None = None
    lora_name: str | None = None  # a loaded LoRA adapter (None: the base model)
    logprob_start_len: int = -1  # >= 0: also score prompt tokens from this position
    # prefill-only requests (max_new_tokens 0; core/pooling.py): an embedding pooled "last"
    # or "mean", or the logprobs of these tokens after the prompt
    pooling: str | None = None
    label_token_ids: list[int] | None = None
    # prefill/decode disaggregation: the room and the prefill's bootstrap server
    bootstrap: Bootstrap | None = None
    priority: int = 0  # core/priority.py
    session: SessionParams | None = None  # core/sessions.py
    mm: MultimodalInputs | None = None  # the prompt's images (core/multimodal.py)


class AbortRequest(msgspec.Struct, tag="abort"):
    """Abort ``rid`` in any state; unknown or finished rids are ignored. ``message`` becomes the
    abort's finish reason message (why it was aborted)."""

    rid: str
    message: str = "aborted by the client"


class CancelRoomRequest(msgspec.Struct, tag="cancel_room"):
    """Prefill/decode disaggregation: the server refused a request that carried this
    ``bootstrap_room``. A prefill's bootstrap server tells the decode waiting for it; a decode
    tells the prefill at ``host``:``port`` (the request's bootstrap address)."""

    room: int
    message: str
    host: str = ""
    port: int = 0
    # the call's fault (a 4xx): the decode answers 400 too; else (a 5xx: overloaded, ...) 500
    client_error: bool = True


class FlushCacheRequest(msgspec.Struct, tag="flush_cache"):
    call_id: int
    storage: bool = False  # clear the hierarchical cache's storage tier instead


class StateRequest(msgspec.Struct, tag="state"):
    call_id: int


class UpdateWeightsRequest(msgspec.Struct, tag="update_weights", kw_only=True):
    """Load the weights of ``model_path`` in place: admission pauses, running requests finish,
    the weights load, the prefix cache is flushed, admission resumes; then the reply."""

    call_id: int
    model_path: str


class LoadLoraRequest(msgspec.Struct, tag="load_lora"):
    """Load the PEFT adapter at ``lora_path`` as ``lora_name`` (between steps)."""

    call_id: int
    lora_name: str
    lora_path: str


class UnloadLoraRequest(msgspec.Struct, tag="unload_lora"):
    """Forget ``lora_name``: new requests may not name it; running ones finish with it."""

    call_id: int
    lora_name: str


class OpenSessionRequest(msgspec.Struct, tag="open_session", kw_only=True):
    """Open a session (core/sessions.py); the reply is a SessionReply."""

    call_id: int
    capacity: int | None = None
    session_id: str | None = None
    ttl: float | None = None


class CloseSessionRequest(msgspec.Struct, tag="close_session", kw_only=True):
    call_id: int
    session_id: str


class ShutdownRequest(msgspec.Struct, tag="shutdown"):
    pass


PROFILE_ACTIVITIES = ("CPU", "GPU")  # what ProfileRequest.activities may name


class ProfileRequest(msgspec.Struct, tag="profile", kw_only=True):
    """Start or stop torch.profiler in the engine (entrypoints/profiler.py); the server has checked
    the fields. ``num_steps``: stop by itself after that many engine steps."""

    call_id: int
    action: str  # "start" | "stop"
    output_dir: str = ""
    file_name: str = ""
    activities: list[str] = []  # of PROFILE_ACTIVITIES
    num_steps: int | None = None
    record_shapes: bool = False
    with_stack: bool = False


EngineInbound = Union[  # noqa: UP007 - msgspec needs a runtime union object
    GenerateRequest,
    AbortRequest,
    FlushCacheRequest,
    StateRequest,
    ShutdownRequest,
    ProfileRequest,
    UpdateWeightsRequest,
    CancelRoomRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
    OpenSessionRequest,
    CloseSessionRequest,
]

# -- engine -> server ------------------------------------------------------------------------


class ReqExtras(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one request's step output holds besides its new tokens and text: the rare parts
    (a stop string that cut text already sent, logprobs, the finish) and counts that changed
    since its previous output. A field left at its default is absent from the wire."""

    # >= 0: the cumulative text becomes text[:text_start] + the step's text delta (a matched
    # stop string cut text already sent); -1: the delta is appended
    text_start: int = -1
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[float, int]]] | None = None
    # prompt-token logprobs, sent once with the finish
    input_logprobs: list[float] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    # cumulative counts, sent when they change (-1: unchanged): prompt tokens matched in the
    # cache; speculation's verify steps with a draft and the draft tokens accepted over them
    cached_tokens: int = -1
    # tokens a session put before the client's prompt (core/sessions.py); with cached_tokens
    # and the finish
    context_tokens: int = 0
    spec_verify_ct: int = -1
    spec_accepted_tokens: int = -1
    spec_draft_tokens: int = -1  # with the finish: draft tokens verified for it
    # prefill-only results, with the finish
    embedding: list[float] | None = None
    label_logprobs: list[float] | None = None
    finish: FinishReason | None = None
    # 400: the engine refused the request (it never ran); 500: the engine failed.
    error_status: int = 0


class StepOutput(msgspec.Struct, tag="step", kw_only=True, omit_defaults=True):
    """One step's output, column by column (a few flat arrays encode and decode many times
    faster than a struct per request, and a step of a full batch has hundreds): request
    ``rids[i]`` gained ``num_tokens[i]`` tokens, the next ones of ``token_ids`` (which holds
    every request's new tokens in ``rids`` order), and the text ``text_deltas[i]``;
    ``extras[i]``, where present, holds the rest."""

    rids: list[str] = []
    num_tokens: list[int] = []
    token_ids: list[int] = []
    text_deltas: list[str] = []
    extras: dict[int, ReqExtras] = {}


class EngineReady(msgspec.Struct, tag="ready", kw_only=True):
    """Sent once after the model and KV pool are built."""

    model_dir: str
    max_context: int
    kv_size: int
    vocab_size: int
    eos_token_ids: list[int]
    plugins: dict[str, str]
    max_running_requests: int
    # {setting: {"value": ..., "from": "flag" | "<platform> default" | "default" | why lowered}}
    settings: dict[str, dict[str, Any]] = {}
    # EngineCore.spec_stats() at start (its settings, zero counts); None: speculation is off
    speculative: dict[str, Any] | None = None
    disaggregation_mode: str = "null"  # "prefill" or "decode": bootstrap fields are honoured
    lora_adapters: dict[str, str] | None = None  # LoRA adapters loaded (name -> path); None: off
    # the numerics it runs: weights, KV cache, decode steps (the start-up banner names them)
    numerics: str = ""


class EngineFailed(msgspec.Struct, tag="failed"):
    """The engine could not start, or its loop failed; it exits after sending this."""

    message: str


class FlushCacheReply(msgspec.Struct, tag="flush_cache_reply"):
    call_id: int
    ok: bool


class SessionReply(msgspec.Struct, tag="session_reply", kw_only=True):
    """``ok`` False: refused, ``message`` says why (the server answers 400)."""

    call_id: int
    ok: bool
    session_id: str = ""
    message: str = ""


class UpdateWeightsReply(msgspec.Struct, tag="update_weights_reply", kw_only=True):
    call_id: int
    success: bool
    message: str
    num_paused_requests: int  # requests held back (waiting) while the weights loaded


class LoraReply(msgspec.Struct, tag="lora_reply", kw_only=True):
    """A LoRA load or unload: ``success`` False with the reason in ``error_message``;
    ``loaded_adapters``: name -> path after the call (SGLang's reply fields)."""

    call_id: int
    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = {}


class EngineState(msgspec.Struct, tag="state_reply", kw_only=True):
    call_id: int
    num_running: int
    num_waiting: int
    kv: dict[str, int]  # size, free, evictable, locked, in_use (scheduler.kv_accounting())
    cache_hit_rate: float
    retractions: int
    steps: int
    # EngineCore.spec_stats() now: settings and accept statistics; None when speculation is off
    speculative: dict[str, Any] | None = None
    # output tokens per second over the last few seconds of steps (entrypoints/gen_rate.py)
    gen_throughput: float = 0.0
    num_grammar_queue: int = 0  # requests waiting for their grammar to compile
    # steps so far by kind (decode, mixed, prefill): StepKindStats.to_json() of each
    steps_by_kind: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    # the engine process's garbage collections: per generation, count and seconds (GcTimer)
    gc: dict[str, list[Any]] = msgspec.field(default_factory=dict)
    # core/priority.py: per priority value, PriorityStats.to_json(); preemptions in all
    priorities: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    preemptions: int = 0
    # core/sessions.py: SessionTable.describe()
    sessions: dict[str, int] = msgspec.field(default_factory=dict)
    # the hierarchical cache's counts per tier (HiCacheStats + host pool); None when it is off
    hicache: dict[str, int] | None = None
    # images in (core/multimodal_strategy.py): images encoded, encoder steps and cache hits;
    # None for a text-only model
    multimodal: dict[str, int] | None = None


class ProfileReply(msgspec.Struct, tag="profile_reply", kw_only=True):
    """``ok`` False: refused (``message`` says why, the server answers 400). ``trace_path``:
    where the trace is (stop) or will be (start) written."""

    call_id: int
    ok: bool
    message: str
    trace_path: str = ""


EngineOutbound = Union[  # noqa: UP007 - msgspec needs a runtime union object
    StepOutput,
    EngineReady,
    EngineFailed,
    FlushCacheReply,
    EngineState,
    ProfileReply,
    UpdateWeightsReply,
    LoraReply,
    SessionReply,
]

_encoder = msgspec.msgpack.Encoder()
_inbound = msgspec.msgpack.Decoder(EngineInbound)
_outbound = msgspec.msgpack.Decoder(EngineOutbound)


class EncodeError(ValueError):
    """A message that cannot be encoded: an integer outside [-2**63, 2**64), text with lone
    surrogates, a value of a type msgpack cannot hold."""


def encode(message: msgspec.Struct) -> bytes:
    try:
        return _encoder.encode(message)
    except (OverflowError, ValueError, TypeError) as e:  # UnicodeEncodeError is a ValueError
        raise EncodeError(f"cannot encode a {type(message).__name__} message: {e}") from None


def decode_inbound(data: bytes) -> EngineInbound:
    return _inbound.decode(data)


def decode_outbound(data: bytes) -> EngineOutbound:
    return _outbound.decode(data)
