"""A llama.cpp GGUF file's vocabulary (``tokenizer.ggml.*``) as an HF ``tokenizers`` tokenizer
that encodes like llama.cpp: byte-level BPE (``gpt2``: GPT-2, Llama 3 and Qwen2 splitting) or
sentencepiece BPE (``llama``: merges from the token scores, byte fallback), control and
user-defined tokens added whole, BOS/EOS added where the file asks. ``gguf_loader.py`` writes it
as the converted directory's tokenizer.json.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from radixserve.core.tokenizer import byte_level_alphabet

logger = logging.getLogger(__name__)

# tokenizer.ggml.pre values that split text like GPT-2 (ByteLevel's built-in regex). llama.cpp's
# "smollm" adds a per-digit split, a no-op for SmolLM's vocabulary (it has no multi-digit tokens).
_GPT2_SPLIT_PRES = {None, "default", "gpt2", "smollm"}
_LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/2.5/3's pre-tokenizer: Llama 3's split with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Sentencepiece files list no merges: a split pair merges with its merged token's score."""
    ids = {token: i for i, token in enumerate(tokens)}
    candidates: list[tuple[float, str, str]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token))]
        pairs = [(a, b) for a, b in pairs if a in ids and b in ids]
        pairs.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        candidates.extend((score, a, b) for a, b in pairs)
    # Best score first; the sort is stable, so ties keep vocabulary order.
    candidates.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)
    return [(a, b) for _, a, b in candidates]


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, set[str] | None]:
    alphabet = byte_level_alphabet()
    letters = set(alphabet.values())
    # Added tokens may be stored raw; the BPE vocabulary must spell everything in the alphabet.
    vocab = {
        t if set(t) <= letters else "".join(alphabet[b] for b in t.encode()): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    if bad := [m for m in merges if len(m) != 2][:3]:
        raise ValueError(f"tokenizer.ggml.merges entries {bad} are not 'left right' pairs")
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    if pre in _LLAMA3_PRES or pre == "qwen2":
        regex = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        if pre not in _GPT2_SPLIT_PRES:
            logger.warning("tokenizer.ggml.pre %r is unknown; splitting text like GPT-2", pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the alphabet is a llama.cpp mislabel; adding it would
    # create a second, out-of-vocabulary id, so only alphabet-spelled ones become added tokens.
    return tok, letters


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]) -> tuple[Tokenizer, None]:
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    model = BPE(
        {t: i for i, t in enumerate(tokens)},
        _merges_from_scores(tokens, scores),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,  # sentencepiece spells unknown characters as <0xNN> byte tokens
    )
    tok = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    scheme = "first" if prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # drop the space the pre-tokenizer prepended
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok, None


def adds_token(meta: dict[str, Any], which: str) -> bool:
    # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
    default = which == "bos" and meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get(f"tokenizer.ggml.add_{which}_token", default))


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    kind, tokens = meta.get("tokenizer.ggml.model"), list(meta.get("tokenizer.ggml.tokens") or [])
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders or not tokens:
        raise NotImplementedError(
            f"tokenizer.ggml.model {kind!r} (with {len(tokens)} tokens) is not supported; only "
            "'gpt2' (byte-level BPE) and 'llama' (sentencepiece BPE) vocabularies can be converted"
        )
    tok, letters = builders[kind](meta, tokens)
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    kept = [
        (t, ty) for t, ty in zip(tokens, types, strict=True) if letters is None or set(t) <= letters
    ]
    # Control tokens must match whole before BPE, or "<|im_start|>" gets cut into pieces.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in kept if ty == _CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in kept if ty == _USER_DEFINED]
    )
    # Encode like llama.cpp: add BOS/EOS when the file asks for them.
    ids = {w: meta.get(f"tokenizer.ggml.{w}_token_id") for w in ("bos", "eos")}
    ends = {w: tokens[i] for w, i in ids.items() if i is not None and adds_token(meta, w)}
    if ends:

        def template(seq: str, type_id: int) -> list[str]:
            return [f"{t}:{type_id}" for t in (ends.get("bos"), f"${seq}", ends.get("eos")) if t]

        tok.post_processor = processors.TemplateProcessing(
            single=template("A", 0),
            pair=template("A", 0) + template("B", 1),
            special_tokens=[(t, ids[w]) for w, t in ends.items()],
        )
    return tok
