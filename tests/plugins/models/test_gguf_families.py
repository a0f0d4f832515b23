"""GGUF files of the families beyond Llama (qwen2, qwen3, qwen3moe, gemma2, Mixtral as 'llama'
with experts) convert to HF directories that give the same model as the safetensors they came
from.

Each case: a tiny random model saved by transformers (safetensors), written to a GGUF file the
way llama.cpp's converter lays it out (names from the ``gguf`` package's own ``TensorNameMap``,
experts stacked, Llama's q/k rows permuted, Gemma's norms stored as 1 + w, float32), converted
back; the converted tensors equal the originals and our model plugin loaded from the converted
directory gives transformers' logits on the original one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tiny_models import make_tiny_model_dir
from tokenizers import Tokenizer

from radixserve.core.config import EngineConfig
from radixserve.core.model_runner import ModelRunner
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, SamplingParams
from radixserve.core.step_plan import StepPlan
from radixserve.plugins.models.gguf_loader import convert_gguf_to_hf_dir

#: name -> (GGUF architecture, transformers model_type, architecture, config overrides)
CASES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "qwen2": ("qwen2", "qwen2", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", "qwen3", "Qwen3ForCausalLM", {}),
    "qwen3moe": (
        "qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM",
        {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
         "norm_topk_prob": True},
    ),
    "gemma2": (
        "gemma2", "gemma2", "Gemma2ForCausalLM",
        # GGUF stores no query_pre_attn_scalar: llama.cpp uses head_dim (16)
        {"sliding_window": 8, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 4.0,
         "final_logit_softcapping": 30.0, "tie_word_embeddings": True},
    ),
    "mixtral": (
        "llama", "mixtral", "MixtralForCausalLM",
        {"num_local_experts": 5, "num_experts_per_tok": 2, "intermediate_size": 64},
    ),
}  # fmt: skip
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$"
)
#: Mixtral's per-expert leaves under the names TensorNameMap knows for stacked experts
_STACKED_LEAF = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for the 'llama' architecture."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _gguf_tensors(hf: dict[str, np.ndarray], arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The HF tensors under GGUF names, transformed as llama.cpp's converter does."""
    model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.TensorNameMap(model_arch, cfg["num_hidden_layers"])
    stacks: dict[str, dict[int, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for name, weight in hf.items():
        if m := _EXPERT.match(name):  # stacked later, in expert order
            leaf = _STACKED_LEAF.get(m.group(3), m.group(3))
            stacks.setdefault(f"{m.group(1)}.{leaf}", {})[int(m.group(2))] = weight
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base.replace("block_sparse_moe", "mlp"))
        assert gguf_name is not None, name
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = cfg["num_attention_heads" if gguf_name.endswith("q") else "num_key_value_heads"]
            weight = _permute(weight, heads)
        if arch == "gemma2" and gguf_name.endswith("norm"):
            weight = weight + np.float32(1.0)
        out[f"{gguf_name}.{suffix}"] = weight
    for base, experts in stacks.items():
        gguf_name = names.get_name(base.replace("block_sparse_moe", "mlp"))
        assert gguf_name is not None, base
        out[f"{gguf_name}.weight"] = np.stack([experts[e] for e in sorted(experts)])
    return out


def _write_gguf(path: Path, model_dir: Path, arch: str) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    hf = load_file(model_dir / "model.safetensors")
    if cfg.get("tie_word_embeddings"):
        hf.pop("lm_head.weight", None)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    w.add_rope_freq_base(float(rope))
    if experts := cfg.get("num_experts") or cfg.get("num_local_experts"):
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    _add_tokenizer(w, model_dir, "qwen2" if arch.startswith("qwen") else "gpt2")
    for name, weight in _gguf_tensors(hf, arch, cfg).items():
        w.add_tensor(name, np.ascontiguousarray(weight, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_tokenizer(w: gguf.GGUFWriter, model_dir: Path, pre: str) -> None:
    """The tiny byte-level BPE as a 'gpt2' GGUF vocabulary."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    w.add_eos_token_id(0)


def _logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """Our model plugin's logits for a prefill of ``ids`` (every row), on the CPU like the
    transformers reference: on a GPU machine the default platform would be CUDA, whose kernels
    (cuBLAS, attention) round differently from the CPU's, past this test's 1e-4."""
    config = EngineConfig(
        max_total_tokens=256, dtype="float32",
        plugins=("hardware=cpu", "attention=torch_native"),
    )  # fmt: skip
    runner = ModelRunner(model_dir, config, default_host())
    req = Req("a", ids, SamplingParams())
    req.req_pool_idx = runner.req_to_token.alloc()
    runner.req_to_token.write(req.req_pool_idx, 0, runner.allocator.alloc(len(ids)))
    fb, _ = runner.build_batch(StepPlan([req], [len(ids)], 0))
    fb.logits_indices = torch.arange(len(ids))
    runner.attention.prepare(fb)
    return runner.model.forward(fb).cpu()


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_family_converts_to_the_same_model(tmp_path: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM

    arch, model_type, architecture, overrides = CASES[name]
    original = make_tiny_model_dir(tmp_path / "hf", model_type, architecture, **overrides)
    _write_gguf(tmp_path / f"{name}.gguf", original, arch)
    converted = convert_gguf_to_hf_dir(tmp_path / f"{name}.gguf", tmp_path / "converted")

    want_cfg = json.loads((original / "config.json").read_text())
    got_cfg = json.loads((converted / "config.json").read_text())
    assert got_cfg["architectures"] == [architecture]
    for key, value in overrides.items():
        assert got_cfg[key] == value, key
    want = load_file(original / "model.safetensors")
    if want_cfg.get("tie_word_embeddings"):
        want.pop("lm_head.weight", None)
    got = load_file(converted / "model.safetensors")
    assert got.keys() == want.keys()
    for key, weight in want.items():  # Gemma's norms went through 1 + w - 1 in float32
        np.testing.assert_allclose(got[key], weight, rtol=0, atol=1e-6, err_msg=key)

    ids = torch.randint(3, 300, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_logits(converted, ids), ref, atol=1e-4, rtol=0)


def test_qwen2_pre_tokenizer_splits_digits_one_by_one(tmp_path: Path) -> None:
    """llama.cpp's 'qwen2' pre-tokenizer: numbers split into single digits before BPE (GPT-2's
    split keeps them together, so the vocabulary's digit merges apply)."""
    arch, model_type, architecture, overrides = CASES["qwen3"]
    original = make_tiny_model_dir(tmp_path / "hf", model_type, architecture, **overrides)
    _write_gguf(tmp_path / "q.gguf", original, arch)
    converted = convert_gguf_to_hf_dir(tmp_path / "q.gguf", tmp_path / "converted")
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    gpt2 = Tokenizer.from_file(str(original / "tokenizer.json"))
    assert len(gpt2.encode("0123456789").ids) < 10
    assert [ours.id_to_token(i) for i in ours.encode("x 0123456789").ids][-10:] == list(
        "0123456789"
    )
    assert ours.encode("hello world").ids == gpt2.encode("hello world").ids
