"""GGUF -> HF conversion, checked against transformers' own GGUF loader on the real SmolLM2 file."""

from __future__ import annotations

import json
import pathlib
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# transformers refuses to load a model from a GGUF file without accelerate.
pytest.importorskip("accelerate")

from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from radixserve.plugins.models.gguf_loader import (  # noqa: E402
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
    "JSON {\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
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
def reference_tokenizer(gguf_file: pathlib.Path):  # type: ignore[no-untyped-def]
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def reference_model(gguf_file: pathlib.Path):  # type: ignore[no-untyped-def]
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


def test_tokenizer_matches_transformers(converted: pathlib.Path, reference_tokenizer) -> None:  # type: ignore[no-untyped-def]
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


def test_weights_match_transformers(converted: pathlib.Path, reference_model) -> None:  # type: ignore[no-untyped-def]
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
    converted: pathlib.Path, reference_model, reference_tokenizer  # type: ignore[no-untyped-def]
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
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == reference_tokenizer.encode(prompt)
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=8, do_sample=False)
        reference = reference_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert ours.tolist() == reference.tolist()
    # Independent of transformers' GGUF code: mis-ordered q/k rows would produce gibberish.
    assert "Paris" in tokenizer.decode(ours[0, ids.shape[1] :])


def test_cache_reuses_complete_conversion(
    gguf_file: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    first = convert_gguf_to_hf_dir(gguf_file)
    assert first.parent == tmp_path and first.name.startswith(gguf_file.stem + "-")
    assert (first / COMPLETE_MARKER).is_file()
    # Nothing but the published directory is left behind (no temp dirs).
    assert list(tmp_path.iterdir()) == [first]
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    second = convert_gguf_to_hf_dir(gguf_file)
    assert second == first
    assert time.perf_counter() - start < 2.0
    assert weights.stat().st_mtime_ns == mtime
