"""A tiny byte-level BPE tokenizer and each grammar backend built over it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import SPECIAL_TOKENS, make_tokenizer_json

from radixserve.core.interfaces import GrammarBackend
from radixserve.core.plugins import default_host
from radixserve.core.tokenizer import Tokenizer

BACKENDS = ["xgrammar", "outlines", "llguidance"]
STOP = SPECIAL_TOKENS.index("<|endoftext|>")


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    root: Path = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tokenizer_json(root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return Tokenizer(root)


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest, tiny_tokenizer: Tokenizer) -> GrammarBackend:
    """Each grammar backend over the tiny tokenizer, built through its registered factory (a
    missing package fails here: the dev extra installs all three)."""
    factory = default_host().registries["grammar"].get(request.param).factory
    built: GrammarBackend = factory(tiny_tokenizer, tiny_tokenizer.vocab_size, [STOP])
    built.name = request.param  # type: ignore[attr-defined]
    return built
