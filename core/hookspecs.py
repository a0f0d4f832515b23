"""Every pluggy hookspec of radixserve, and nothing else.

A plugin is a module (or object) with functions marked ``@radixserve.hookimpl`` whose names
match the specs below; it is found through the entry-point group ``radixserve``. Registration
hooks receive a ``register`` callback; the host checks names, duplicates and availability.
Hooks only gain arguments over time, never lose or rename them.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT_NAME = "radixserve"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_hardware_platforms(register: Any) -> None:
    """Register hardware platforms (``HardwarePlatform`` factories).

    Call ``register(name, factory, available=..., description=...)`` once per platform.
    ``factory()`` builds the platform; ``available()`` returns None when usable or a one-line
    reason when not (no GPU, missing package). Called once per process at start-up.
    """


@hookspec
def register_attention_backends(register: Any) -> None:
    """Register attention backends (``AttentionBackend`` factories).

    ``factory(kv_pool, model_config, device)`` builds the backend. Called once per process.
    """


@hookspec
def register_models(register: Any) -> None:
    """Register model architectures, named as in HF ``config.json`` ``architectures``.

    ``factory(model_config, attention, dtype, device)`` returns a ``CausalLM``. With more than
    one tensor-parallel rank it also gets ``group=`` (``core.parallel.TensorParallel``), the
    group to build this rank's share of the model for. Called once per process.
    """


@hookspec
def register_grammar_backends(register: Any) -> None:
    """Register grammar backends (``GrammarBackend`` factories).

    ``factory(tokenizer, vocab_size, stop_token_ids)`` builds the backend: the engine's
    ``Tokenizer``, the model's logits width and its end tokens. Called once per process; the
    factory itself runs on first use, on the grammar compile thread.
    """


@hookspec
def register_speculative_algorithms(register: Any) -> None:
    """Register speculative-decoding algorithms (``SpeculativeAlgorithm`` factories)."""


@hookspec
def register_kv_connectors(register: Any) -> None:
    """Register KV-transfer connectors (``KVConnector`` factories, called with no arguments)
    for prefill/decode disaggregation; the engine process builds one only with
    ``--disaggregation-mode prefill|decode``."""


@hookspec
def register_hicache_storage_backends(register: Any) -> None:
    """Register HiCache storage backends (``core.hicache_storage.HiCacheStorage`` factories,
    called with the ``--hicache-storage-backend-extra-config`` dict) for the third tier of
    ``--enable-hierarchical-cache``; ``none`` is the default (no third tier)."""


@hookspec(firstresult=True)
def select_hardware_platform(available: list[str]) -> str | None:
    """Choose the hardware platform among the available names; first non-None answer wins.

    Without an answer the host takes the highest-priority available platform.
    """


@hookspec
def engine_started(info: dict[str, Any]) -> None:
    """Called once in the engine process after the model and KV pool are ready.

    ``info`` holds the model path, the chosen plugins and the KV capacity in tokens.
    """


@hookspec
def step_finished(stats: dict[str, Any]) -> None:
    """Called once per scheduler step (never per token) with that step's counters.

    Keys: ``num_decode``, ``num_prefill_tokens``, ``num_running``, ``num_waiting``,
    ``step_time_s``. Keep implementations cheap: this is on the hot path.
    """


@hookspec(firstresult=True)
def resolve_model_dir(model_path: str | None) -> str | None:
    """Turn a user's model path into an HF-layout directory (config.json, safetensors,
    tokenizer.json), converting it if needed (e.g. a .gguf file). ``None`` asks for the default
    model. Return None to leave the path to other plugins. Called once at start-up."""
