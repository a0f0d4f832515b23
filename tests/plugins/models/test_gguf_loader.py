"""GGUF -> HF conversion, checked against transformers' own GGUF loader on the real SmolLM2 file."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from radixserve.core.config import ModelConfig
from radixserve.plugins.models import gguf_loader
from radixserve.plugins.models.blocks import rope_inv_freq
from radixserve.plugins.models.gguf_loader import (
    COMPLETE_MARKER,
    convert_gguf_to_hf_dir,
    default_model_gguf_path,
)

SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "multiple   spaces\tand\ttabs\n\nnewlines\r\n",
    "Numbers: 12345, 3.14159, -42, 1e-5, 2024-01-01",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'print(f"{x!r:>10}") # comment',
    "Ünïcödé: café, naïve, Straße, façade",
    "中文测试，你好世界！",
    "日本語のテキストです。",
    "Emoji: 🙂🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "Русский текст и ελληνικά",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after special<|endoftext|>",
    "don't won't I'm you're they've we'll she'd",
    "URL: https://example.com/path?q=1&r=2#frag",
    'JSON {"key": [1, 2, 3], "nested": {"a": null}}',
    "a",
    "",
    "    indented code block\n\t\ttabbed",
]


@pytest.fixture(scope="module")
def gguf_file() -> pathlib.Path:
    return default_model_gguf_path()


@pytest.fixture(scope="module")
def converted(gguf_file: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return convert_gguf_to_hf_dir(gguf_file, tmp_path_factory.mktemp("conv") / "smollm2")


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file: pathlib.Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def reference_model(gguf_file: pathlib.Path) -> Any:
    # transformers refuses to read a model from a GGUF file without accelerate.
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


def test_config_describes_smollm2(converted: pathlib.Path) -> None:
    assert (converted / COMPLETE_MARKER).is_file()
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    tok_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False
    assert tok_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_config["chat_template"]
    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_tokenizer_matches_transformers(converted: pathlib.Path, reference_tokenizer: Any) -> None:
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert ours.get_vocab_size() == 49152
    for text in SAMPLES:
        expected = reference_tokenizer.encode(text, add_special_tokens=True)
        got = ours.encode(text).ids
        assert got == expected, text
        assert ours.decode(got, skip_special_tokens=False) == reference_tokenizer.decode(expected)
        assert ours.decode(got, skip_special_tokens=False) == text
    # Special tokens stay whole instead of being cut into "<", "|", ...
    assert ours.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1


def test_weights_match_transformers(converted: pathlib.Path, reference_model: Any) -> None:
    expected = reference_model.state_dict()
    with safe_open(str(converted / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        # lm_head is tied to the embeddings, so it must not be stored.
        assert names == set(expected) - {"lm_head.weight"}
        for name in sorted(names):
            ours = f.get_tensor(name)
            assert ours.dtype == torch.float32, name
            assert ours.shape == expected[name].shape, name
            assert torch.allclose(ours, expected[name], atol=1e-6, rtol=0), name
    assert any(".q_proj." in n for n in names) and any(".k_proj." in n for n in names)


def test_converted_dir_loads_and_generates_like_gguf(
    converted: pathlib.Path, reference_model: Any, reference_tokenizer: Any
) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(converted).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    for text in [prompt, *SAMPLES]:
        assert tokenizer.encode(text) == reference_tokenizer.encode(text), text
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=8, do_sample=False)
        reference = reference_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert ours.tolist() == reference.tolist()
    # Independent of transformers' GGUF code: mis-ordered q/k rows would produce gibberish.
    assert "Paris" in tokenizer.decode(ours[0, ids.shape[1] :])


def _llamacpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row permutation, written out independently."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _write_tiny_gguf(
    path: pathlib.Path,
    arch: str = "llama",
    tokenizer: str = "llama",
    rope_freqs: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Write a 1-layer llama with a sentencepiece vocabulary and an untied lm_head, all float32
    (and ``rope_freqs``: a Llama-3.x file's RoPE frequency factors, as llama.cpp writes them);
    return the HF-layout tensors it was made from."""
    rng = np.random.default_rng(0)
    words = ["hello", "world", "the", "thing", "low", "lower", "newest", "wide"]
    learned: list[str] = []
    for word in ("\u2581" + w for w in words):
        for n in range(2, len(word) + 1):
            learned += [
                word[i : i + n] for i in range(len(word) - n + 1) if word[i : i + n] not in learned
            ]
    learned.sort(key=len)
    chars = sorted({c for w in words for c in "\u2581" + w})
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]  # sentencepiece's byte fallback
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, "<tool>", *chars, *learned]
    types = [2, 3, 3] + [6] * 256 + [4] + [1] * (len(chars) + len(learned))
    scores = [0.0] * (260 + len(chars)) + list(-np.arange(len(learned)) - rng.random(len(learned)))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    # head_dim 8: with head_dim 4 llama.cpp's row permutation would be its own inverse.
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    shapes = {
        "token_embd": ("model.embed_tokens", (len(tokens), 16)),
        "blk.0.attn_q": ("model.layers.0.self_attn.q_proj", (16, 16)),
        "blk.0.attn_k": ("model.layers.0.self_attn.k_proj", (8, 16)),
        "blk.0.attn_v": ("model.layers.0.self_attn.v_proj", (8, 16)),
        "blk.0.attn_output": ("model.layers.0.self_attn.o_proj", (16, 16)),
        "blk.0.ffn_gate": ("model.layers.0.mlp.gate_proj", (32, 16)),
        "blk.0.ffn_up": ("model.layers.0.mlp.up_proj", (32, 16)),
        "blk.0.ffn_down": ("model.layers.0.mlp.down_proj", (16, 32)),
        "blk.0.attn_norm": ("model.layers.0.input_layernorm", (16,)),
        "blk.0.ffn_norm": ("model.layers.0.post_attention_layernorm", (16,)),
        "output_norm": ("model.norm", (16,)),
        "output": ("lm_head", (len(tokens), 16)),
    }
    hf = {}
    for gguf_name, (hf_name, shape) in shapes.items():
        weight = rng.standard_normal(shape).astype(np.float32)
        hf[hf_name + ".weight"] = weight
        if gguf_name.endswith(("attn_q", "attn_k")):
            weight = _llamacpp_permute(weight, 2 if gguf_name.endswith("q") else 1)
        writer.add_tensor(gguf_name + ".weight", np.ascontiguousarray(weight))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_sentencepiece_model_roundtrips(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(src)
    out = convert_gguf_to_hf_dir(src, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["num_attention_heads"] == 2 and config["num_key_value_heads"] == 1
    assert config["head_dim"] == 8
    # Exact round trip, q/k included: checks the un-permutation against llama.cpp's permutation.
    ours = load_file(out / "model.safetensors")
    assert ours.keys() == expected.keys()
    for name, weight in expected.items():
        np.testing.assert_array_equal(ours[name], weight, err_msg=name)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    # The expected pieces are written out (not only compared with transformers' GGUF converter,
    # whose output for leading spaces and newlines has changed between the transformers
    # versions the dev extra admits; the version pinned there produces exactly these).
    for text, pieces in TINY_SENTENCEPIECE_CASES.items():
        ids = tokenizer.encode(text).ids
        assert [tokenizer.id_to_token(i) for i in ids] == ["<s>", *pieces], text
        decoded = text.replace("<s>", "").replace("</s>", "").removeprefix(" ")
        assert tokenizer.decode(ids) == decoded, text
    if transformers.__version__ != PINNED_TRANSFORMERS:
        return  # older converters differ (one added no BOS): the pieces above are the claim
    reference = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    for text in TINY_SENTENCEPIECE_CASES:
        ids = tokenizer.encode(text).ids
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True), text


#: the version the dev extra pins (pyproject.toml), whose GGUF converter these cases match
PINNED_TRANSFORMERS = "5.25.0"

#: text -> its pieces after the BOS (add_bos_token from the file), by the tiny vocabulary of
#: _write_tiny_gguf: a dummy-prefix "\u2581", byte fallback for what the vocabulary lacks, the
#: user-defined <tool> and the control tokens matched as text.
TINY_SENTENCEPIECE_CASES = {
    "hello world": ["\u2581hello", "\u2581world"],
    "the thing": ["\u2581the", "\u2581thing"],
    " leading": ["\u2581l", "e", "<0x61>", "d", "ing"],
    "lower newest widest": ["\u2581lower", "\u2581newest", "\u2581wid", "est"],
    "h\u00e9llo \u4e2d": [
        "\u2581h", "<0xC3>", "<0xA9>", "llo", "\u2581", "<0xE4>", "<0xB8>", "<0xAD>"
    ],
    "<s>hello</s>": ["<s>", "hello", "</s>"],
    "a  b": ["\u2581", "<0x61>", "\u2581", "\u2581", "<0x62>"],
    "\n": ["\u2581", "<0x0A>"],
    "<tool>the": ["<tool>", "the"],
    "hello<tool> world": ["\u2581hello", "<tool>", "\u2581world"],
    "": [],
}  # fmt: skip


def test_llama3_rope_frequency_factors_are_kept(tmp_path: pathlib.Path) -> None:
    """llama.cpp writes a Llama-3.x model's RoPE scaling as a rope_freqs tensor of per-frequency
    factors and no rope.scaling.type: the converted model's frequencies are the scaled ones
    (they were the unscaled ones: every output of a Llama-3.1 GGUF was off)."""
    _write_tiny_gguf(tmp_path / "plain.gguf")
    plain_dir = convert_gguf_to_hf_dir(tmp_path / "plain.gguf", tmp_path / "plain")
    raw = json.loads((plain_dir / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    plain = rope_inv_freq(ModelConfig.from_dict(raw))
    want = rope_inv_freq(ModelConfig.from_dict({**raw, "rope_scaling": scaling}))
    assert not torch.allclose(plain, want)  # head_dim 8, wavelengths 6 to 6,283: some scaled
    src = tmp_path / "llama3.gguf"
    expected = _write_tiny_gguf(src, rope_freqs=(plain.double() / want.double()).numpy())
    out = convert_gguf_to_hf_dir(src, tmp_path / "out")
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_dir(out)), want, rtol=1e-6, atol=0)
    assert load_file(out / "model.safetensors").keys() == expected.keys()  # not a weight


def test_rejects_what_it_cannot_convert(tmp_path: pathlib.Path) -> None:
    _write_tiny_gguf(tmp_path / "bert.gguf", tokenizer="bert")
    with pytest.raises(NotImplementedError, match="'bert'"):
        convert_gguf_to_hf_dir(tmp_path / "bert.gguf", tmp_path / "out")
    _write_tiny_gguf(tmp_path / "phi3.gguf", arch="phi3")
    with pytest.raises(ValueError, match="'phi3'; GGUF files of 'llama', 'qwen2'"):
        convert_gguf_to_hf_dir(tmp_path / "phi3.gguf", tmp_path / "out")
    # a known family whose file lacks that family's tensors (qwen2: q/k/v biases)
    _write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    with pytest.raises(ValueError, match="lacks the tensors for.*self_attn.k_proj.bias"):
        convert_gguf_to_hf_dir(tmp_path / "qwen.gguf", tmp_path / "out")
    # Failed conversions leave nothing behind, not even their temporary directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert.gguf", "phi3.gguf", "qwen.gguf"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stray.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_gguf_to_hf_dir(tmp_path / "bert.gguf", tmp_path / "out")


def test_cache_reuses_complete_conversion(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tiny file: caching does not depend on the model, and re-converting SmolLM2 costs seconds.
    src = tmp_path / "src" / "tiny.gguf"
    src.parent.mkdir()
    _write_tiny_gguf(src)
    cache = tmp_path / "cache"
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(cache))
    first = convert_gguf_to_hf_dir(src)
    assert first.parent == cache and first.name.startswith("tiny-")
    assert (first / COMPLETE_MARKER).is_file()
    assert list(cache.iterdir()) == [first]  # no temporary directory left behind
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_reading(*args: Any) -> None:
        raise AssertionError("a cached conversion was read from the GGUF file again")

    with monkeypatch.context() as patch:  # a cache hit never opens the GGUF file
        patch.setattr(gguf_loader, "GGUFReader", no_reading)
        assert convert_gguf_to_hf_dir(src) == first
    assert weights.stat().st_mtime_ns == mtime
    # Another file (different size and mtime) gets its own directory.
    other = tmp_path / "src" / "other.gguf"
    other.write_bytes(src.read_bytes() + b"\0" * 32)
    assert convert_gguf_to_hf_dir(other).parent == cache
    assert len(list(cache.iterdir())) == 2
