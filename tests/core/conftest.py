"""Fixtures of the core's engine-free tests."""

from __future__ import annotations

import pytest
from tiny_models import make_tokenizer_json

from radixserve.core.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny Llama's tokenizer alone (no weights: the tests that take it run no model)."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    make_tokenizer_json(folder / "tokenizer.json")
    return Tokenizer(folder)
