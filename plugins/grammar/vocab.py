"""A tokenizer's vocabulary as grammar backends need it: token strings by id, special tokens,
and each token's raw bytes. Shared by the grammar plugins; imports no grammar library."""

from __future__ import annotations

import json
from typing import Any

from radixserve.core.tokenizer import Tokenizer, byte_level_alphabet


def encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Token strings as the tokenizer stores them ("Ġhello"), by id; "" for ids it lacks."""
    vocab = [""] * vocab_size
    for token, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            vocab[token_id] = token
    return vocab


def special_token_ids(tokenizer: Tokenizer) -> set[int]:
    """Added tokens marked special (<|im_start|>, ...): never part of constrained text."""
    return {
        int(t["id"]) for t in _tokenizer_json(tokenizer).get("added_tokens", []) if t.get("special")
    }


def vocab_type(tokenizer: Tokenizer) -> str:
    """How token strings encode bytes: "byte_level" (GPT-2 "Ġ"), "byte_fallback"
    (SentencePiece "<0x0A>", "▁") or "raw"."""
    decoders = _decoders(_tokenizer_json(tokenizer).get("decoder"))
    types = {d.get("type") for d in decoders}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types:
        return "byte_fallback"
    return "raw"


def token_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes | None]:
    """Each token's raw bytes, by id; None for special tokens and ids the tokenizer lacks."""
    kind = vocab_type(tokenizer)
    specials = special_token_ids(tokenizer)
    out: list[bytes | None] = []
    for token_id, token in enumerate(encoded_vocab(tokenizer, vocab_size)):
        if not token or token_id in specials:
            out.append(None)
        elif kind == "byte_level":
            out.append(bytes(_BYTE_DECODER.get(c, 0) for c in token))
        elif kind == "byte_fallback" and len(token) == 6 and token.startswith("<0x"):
            out.append(bytes([int(token[3:5], 16)]))
        else:
            out.append(token.replace("\u2581", " ").encode())
    return out


def _decoders(decoder: Any) -> list[dict[str, Any]]:
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        return [d for d in decoder.get("decoders", []) if isinstance(d, dict)]
    return [decoder]


def _tokenizer_json(tokenizer: Tokenizer) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(tokenizer.backend.to_str())
    return data


_BYTE_DECODER = {c: b for b, c in byte_level_alphabet().items()}
