"""Builders of tiny random-weight models in HF layout, for fast CPU tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n",
    "Hello world! How are you today? I am fine, thank you.",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ' \" ",
]


def make_tokenizer_json(path: Path, vocab_size: int = 384) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))


def make_tiny_llama_dir(
    out: Path, architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides: Any
) -> Path:
    """Write config.json, model.safetensors (HF naming, random weights) and tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer_json(out / "tokenizer.json")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    settings: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float()
    with torch.no_grad():  # larger weights give peaked, tie-free distributions
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    _save(model, out, architecture)
    return out


def randomize_weights(model: Any) -> None:
    """Weights far from transformers' init (which leaves norms at one and biases at zero, where
    a wrong use of them would not show): matrices ~ N(0, 0.2), vectors shifted by N(0, 0.1)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.1)


#: a small GQA shape with odd head counts (6 query heads over 3 KV heads, head_dim 16)
TINY_FAMILY_SETTINGS: dict[str, Any] = dict(
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=0,
)


def make_tiny_model_dir(
    out: Path, model_type: str, architecture: str, seed: int = 0, **overrides: Any
) -> Path:
    """``make_tiny_llama_dir`` for any transformers architecture: ``model_type`` names the
    transformers config (``AutoConfig.for_model``), ``architecture`` the class written to
    config.json; ``overrides`` change ``TINY_FAMILY_SETTINGS``. Matrices are drawn like the
    Llama's (std 0.2) and every 1-D parameter (norm weights, biases) gets noise of std 0.1, so
    biases and norm weights are exercised too."""
    import torch
    import transformers
    from transformers import AutoConfig

    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer_json(out / "tokenizer.json")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    settings: dict[str, Any] = dict(TINY_FAMILY_SETTINGS, vocab_size=vocab)
    settings.update(overrides)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **settings)
    model = getattr(transformers, architecture)(config).float()
    randomize_weights(model)
    _save(model, out, architecture)
    return out


def _save(model: Any, out: Path, architecture: str) -> None:
    model.save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [architecture]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"})
    )
