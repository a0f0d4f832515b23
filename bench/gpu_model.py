"""Random-weight Llama directories of real shapes (HF layout), written on the machine that
benchmarks them: config.json, sharded safetensors with an index, and a word-level tokenizer
that covers the whole vocabulary. Throughput does not depend on weight values with EOS ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
    ),
    "smollm2": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True,
    ),
    # bench/hicache.py on a 2-core CPU: heavy enough that recomputing a prefix costs more than
    # copying its KV back, light enough to run the multi-turn workload in minutes
    "cpu-small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=8192, max_position_embeddings=8192,
        rope_theta=10000.0, tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
}  # fmt: skip


def _layer_shapes(c: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    h, inter = c["hidden_size"], c["intermediate_size"]
    d = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    p = f"model.layers.{i}."
    return {
        p + "self_attn.q_proj.weight": (h, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, h),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }


def write_random_llama(out: Path, shape: str, device: str, seed: int = 0) -> int:
    """Write the model directory; return its weight bytes (bfloat16)."""
    c = {**SHAPES[shape], "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "bfloat16", "hidden_act": "silu", **c}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(out, c["vocab_size"])
    shards: list[dict[str, tuple[int, ...]]] = [
        {"model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"]),
         "model.norm.weight": (c["hidden_size"],)}
    ]  # fmt: skip
    if not c["tie_word_embeddings"]:
        shards[0]["lm_head.weight"] = (c["vocab_size"], c["hidden_size"])
    shards += [_layer_shapes(c, i) for i in range(c["num_hidden_layers"])]
    return _write_shards(out, shards, device, seed)


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))


_QWEN_7B_TEXT = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    mrope=[16, 24, 24],
)
_TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=4096, rope_theta=10000.0, mrope=[2, 3, 3])  # fmt: skip

#: Qwen2.5-VL-7B's and Qwen2-VL-7B's shapes (language model and vision tower); "tiny-*" for a
#: CPU smoke test. ``family``: qwen2_5_vl (RMSNorm, gated SiLU MLP, 112-pixel windows with
#: full attention at ``fullatt_block_indexes``) or qwen2_vl (LayerNorm, quick-GELU MLP)
VL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-7b": dict(
        family="qwen2_5_vl", text=_QWEN_7B_TEXT,
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                    patch_size=14, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
    ),
    "qwen2-vl-7b": dict(
        family="qwen2_vl", text=_QWEN_7B_TEXT,
        vision=dict(depth=32, embed_dim=1280, num_heads=16, mlp_ratio=4, patch_size=14),
    ),
    "tiny-qwen2.5-vl": dict(
        family="qwen2_5_vl", text=_TINY_TEXT,
        vision=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                    window_size=112, fullatt_block_indexes=[1]),
    ),
    "tiny-qwen2-vl": dict(
        family="qwen2_vl", text=_TINY_TEXT,
        vision=dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, patch_size=14),
    ),
}  # fmt: skip
_VL_ARCH = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
            "qwen2_vl": "Qwen2VLForConditionalGeneration"}  # fmt: skip


def write_random_qwen2_vl(out: Path, shape: str, device: str, seed: int = 0) -> int:
    """A Qwen2-VL or Qwen2.5-VL directory of ``shape`` (VL_SHAPES) with random weights, a
    word-level tokenizer and Qwen2-VL's image processor settings (patch 14, merge 2: a 448x448
    image is 256 tokens); the image token is the vocabulary's last id. Returns its weight bytes
    (bfloat16)."""
    family = VL_SHAPES[shape]["family"]
    t, v = VL_SHAPES[shape]["text"], VL_SHAPES[shape]["vision"]
    h, vocab = t["hidden_size"], t["vocab_size"]
    text = {k: t[k] for k in t if k != "mrope"} | {
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": t["rope_theta"],
                            "mrope_section": t["mrope"]},
    }  # fmt: skip
    vision = {**v, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    if family == "qwen2_5_vl":
        vision |= {"out_hidden_size": h, "hidden_act": "silu"}
    else:
        vision |= {"hidden_size": h, "hidden_act": "quick_gelu"}
    config = {"architectures": [_VL_ARCH[family]], "model_type": family,
              "torch_dtype": "bfloat16", "text_config": text, "vision_config": vision,
              "image_token_id": vocab - 1, "video_token_id": vocab - 2,
              "vision_start_token_id": vocab - 3, "vision_end_token_id": vocab - 4,
              "tie_word_embeddings": False}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": v["patch_size"],
        "merge_size": 2, "temporal_patch_size": 2, "do_resize": True, "do_rescale": True,
        "do_normalize": True, "do_convert_rgb": True, "resample": 3,
        "rescale_factor": 1 / 255, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    }))  # fmt: skip
    _write_tokenizer(out, vocab)
    c = {**t, "tie_word_embeddings": False}
    shards: list[dict[str, tuple[int, ...]]] = [
        {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,),
         "lm_head.weight": (vocab, h)}
    ]  # fmt: skip
    for i in range(t["num_hidden_layers"]):
        layer = _layer_shapes(c, i)
        d = h // t["num_attention_heads"]
        p, kv = f"model.layers.{i}.self_attn.", t["num_key_value_heads"] * d
        layer |= {p + "q_proj.bias": (h,), p + "k_proj.bias": (kv,), p + "v_proj.bias": (kv,)}
        shards.append(layer)
    shards.append(_vision_shapes(v, h, family))
    return _write_shards(out, shards, device, seed)


def _vision_shapes(v: dict[str, Any], hidden: int, family: str) -> dict[str, tuple[int, ...]]:
    qwen25 = family == "qwen2_5_vl"
    e, p = (v["hidden_size"] if qwen25 else v["embed_dim"]), v["patch_size"]
    merged = e * 4
    out: dict[str, tuple[int, ...]] = {"visual.patch_embed.proj.weight": (e, 3, 2, p, p)}
    for i in range(v["depth"]):
        b = f"visual.blocks.{i}."
        out |= {b + "norm1.weight": (e,), b + "norm2.weight": (e,),
                b + "attn.qkv.weight": (3 * e, e), b + "attn.qkv.bias": (3 * e,),
                b + "attn.proj.weight": (e, e), b + "attn.proj.bias": (e,)}  # fmt: skip
        if qwen25:  # RMSNorms, a gated MLP
            m = v["intermediate_size"]
            out |= {b + "mlp.gate_proj.weight": (m, e), b + "mlp.gate_proj.bias": (m,),
                    b + "mlp.up_proj.weight": (m, e), b + "mlp.up_proj.bias": (m,),
                    b + "mlp.down_proj.weight": (e, m), b + "mlp.down_proj.bias": (e,)}  # fmt: skip
        else:  # LayerNorms, a two-layer MLP
            m = e * v["mlp_ratio"]
            out |= {b + "norm1.bias": (e,), b + "norm2.bias": (e,),
                    b + "mlp.fc1.weight": (m, e), b + "mlp.fc1.bias": (m,),
                    b + "mlp.fc2.weight": (e, m), b + "mlp.fc2.bias": (e,)}  # fmt: skip
    out |= {"visual.merger.ln_q.weight": (e,),
            "visual.merger.mlp.0.weight": (merged, merged), "visual.merger.mlp.0.bias": (merged,),
            "visual.merger.mlp.2.weight": (hidden, merged),
            "visual.merger.mlp.2.bias": (hidden,)}  # fmt: skip
    if not qwen25:
        out["visual.merger.ln_q.bias"] = (e,)
    return out


def _write_shards(out: Path, shards: list[dict[str, tuple[int, ...]]], device: str,
                  seed: int) -> int:  # fmt: skip
    """Random bfloat16 tensors (1-D: ones for norm weights, zeros for biases), one
    safetensors file per shard, and the index. Returns the bytes written."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map, total = {}, 0
    for n, shard in enumerate(shards):
        tensors = {}
        for name, dims in shard.items():
            if len(dims) == 1:
                fill = torch.zeros if name.endswith("bias") else torch.ones
                t = fill(dims, dtype=torch.bfloat16)
            else:
                t = torch.randn(dims, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
            tensors[name] = t.cpu()
            total += t.numel() * 2
        fname = f"model-{n:05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return total
