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
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, tuple[int, ...]]] = [
        {"model.embed_tokens.weight": (c["vocab_size"], c["hidden_size"]),
         "model.norm.weight": (c["hidden_size"],)}
    ]  # fmt: skip
    if not c["tie_word_embeddings"]:
        shards[0]["lm_head.weight"] = (c["vocab_size"], c["hidden_size"])
    shards += [_layer_shapes(c, i) for i in range(c["num_hidden_layers"])]
    weight_map, total = {}, 0
    for n, shard in enumerate(shards):
        tensors = {}
        for name, dims in shard.items():
            if len(dims) == 1:
                t = torch.ones(dims, dtype=torch.bfloat16)
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


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))
