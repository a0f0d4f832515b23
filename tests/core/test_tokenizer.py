"""core/tokenizer.py alone, on a tiny byte-level BPE tokenizer (one added special token, a BOS
post-processor): reading the model directory, encoding (lone surrogates), special tokens, chat
templates' selection and message checks, the byte-level alphabet and incremental
detokenization (text held back inside a UTF-8 character, flushed at the end)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tiny_models import make_tokenizer_json
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from radixserve.core.config import ConfigError
from radixserve.core.request import InvalidRequest
from radixserve.core.tokenizer import (
    CHAT_ROLES,
    IncrementalDetokenizer,
    Tokenizer,
    byte_level_alphabet,
)

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if tools %}<tools {{ tools | length }}>{% endif %}"
    "{% if documents %}<docs {{ documents | length }}>{% endif %}{{ suffix }}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_json(path / "tokenizer.json")
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(["<|extra|>"])  # an added token: counted in vocab_size
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tok.save(str(path / "tokenizer.json"))
    return path


def with_config(folder: Path, tmp_path: Path, config: dict[str, Any] | None) -> Path:
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture(scope="module")
def tok(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("cfg")
    config = {"chat_template": TEMPLATE, "bos_token": {"content": "<|im_start|>"},
              "eos_token": "<|im_end|>", "unk_token": None}  # fmt: skip
    return Tokenizer(with_config(folder, path, config))


def test_the_model_directory(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        Tokenizer(tmp_path)
    assert str(err.value) == f"model directory '{tmp_path}' has no tokenizer.json"
    bare = Tokenizer(str(with_config(folder, tmp_path, None)))  # a str path, no config file
    assert (bare.config, bare.templates, bare.chat_template, bare.template_for([{}])) == (
        {}, None, None, None,
    )  # fmt: skip
    assert (bare.special_tokens, bare.bos_token, bare.eos_token) == ({}, None, None)
    assert bare.eos_token_ids() == ()
    assert bare.vocab_size == 363 == bare.backend.get_vocab_size(with_added_tokens=False) + 1
    assert isinstance(bare.backend, HFTokenizer)
    own = Tokenizer(tmp_path, chat_template="{{ 'x' }}")  # a --chat-template overrides
    assert own.chat_template == "{{ 'x' }}" and own.apply_chat_template([{"role": "user"}]) == "x"


def test_special_tokens(tok: Tokenizer, folder: Path, tmp_path: Path) -> None:
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.eos_token_ids() == (2,) and tok.token_to_id("<|im_end|>") == 2
    assert tok.id_to_token(2) == "<|im_end|>" and tok.token_to_id("<|nope|>") is None
    other = Tokenizer(with_config(folder, tmp_path, {"eos_token": "<|nope|>"}))
    assert other.eos_token == "<|nope|>" and other.eos_token_ids() == ()


def test_encoding_and_decoding(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.encode("Hello world") == [0, *ids]  # the post-processor's BOS
    assert tok.encode_batch(["Hello world", "fox"]) == [[0, *ids], tok.encode("fox")]
    assert tok.encode_batch(["Hello world"], add_special_tokens=False) == [ids]
    assert tok.decode([0, *ids]) == "Hello world"
    assert tok.decode([0, *ids], skip_special_tokens=False) == "<|endoftext|>Hello world"
    message = "the text contains a lone surrogate (invalid Unicode); send valid UTF-8"
    for call in (lambda: tok.encode("a\ud800"), lambda: tok.encode_batch(["ok", "a\udfff"])):
        with pytest.raises(InvalidRequest) as err:
            call()
        assert str(err.value) == message
    with pytest.raises(TypeError):
        tok.encode(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tok.encode_batch(["ok", 5])  # type: ignore[list-item]


def test_chat_templates(tok: Tokenizer, folder: Path, tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok.chat_template == TEMPLATE
    assert tok.apply_chat_template(chat) == "<|im_start|>[system]s[user]u[assistant]"
    assert tok.apply_chat_template(chat, add_generation_prompt=False, suffix="!",
                                   tools=[{"a": 1}], documents=[{}, {}]) == (
        "<|im_start|>[system]s[user]u<tools 1><docs 2>!"
    )  # fmt: skip
    expected = tok.encode("<|im_start|>[system]s[user]u[assistant]", add_special_tokens=False)
    assert tok.encode_chat(chat) == expected and expected[0] == 1  # the template's BOS only
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    several = Tokenizer(with_config(folder, tmp_path, {"chat_template": named}))
    assert several.templates == {"default": "D", "tool_use": "T"}
    assert (several.chat_template, several.template_for([{}])) == ("D", "T")
    assert several.apply_chat_template(chat, tools=[{}]) == "T"
    no_default = Tokenizer(tmp_path, chat_template=None)
    no_default.templates = {"tool_use": "T", "other": "O"}
    assert no_default.chat_template is None and no_default.template_for([{}]) == "T"
    with pytest.raises(InvalidRequest) as err:
        no_default.apply_chat_template(chat)
    assert str(err.value) == (
        "chat template failed on these messages: the model has several chat templates and "
        "none is named 'default'; available: other, tool_use"
    )
    broken = Tokenizer(tmp_path, chat_template="{{ raise_exception('no ' + messages[0].role) }}")
    with pytest.raises(InvalidRequest) as err:
        broken.apply_chat_template(chat)
    assert str(err.value) == "chat template failed on these messages: no system"


def test_messages_are_checked(tok: Tokenizer, folder: Path, tmp_path: Path) -> None:
    bare = Tokenizer(with_config(folder, tmp_path, {}))
    with pytest.raises(InvalidRequest) as err:
        bare.apply_chat_template([{"role": "user", "content": "u"}])
    assert str(err.value) == "this model has no chat template; pass --chat-template"
    for messages, message in [
        ([], "messages must be a non-empty list"),
        ({"role": "user"}, "messages must be a non-empty list"),
        ([{"role": "user"}, "hi"], "messages[1] must be an object"),
        ([{"role": "bot"}], "messages[0].role must be one of system, user, assistant, tool, "
                            "developer, got 'bot'"),
        ([{"role": "user"}, {}], "messages[1].role must be one of system, user, assistant, "
                                 "tool, developer, got None"),
    ]:  # fmt: skip
        with pytest.raises(InvalidRequest) as err:
            tok.apply_chat_template(messages)  # type: ignore[arg-type]
        assert str(err.value) == message
    for role in CHAT_ROLES:
        assert tok.apply_chat_template(
            [{"role": role, "content": "c"}], add_generation_prompt=False
        ) == (f"<|im_start|>[{role}]c")


def test_the_byte_level_alphabet() -> None:
    table = byte_level_alphabet()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert (table[ord(" ")], table[ord("\n")], table[0], table[0x20]) == ("Ġ", "Ċ", "Ā", "Ġ")
    assert (table[0x21], table[0x7E], table[0x7F], table[0xA0]) == ("!", "~", "ġ", "ł")
    assert (table[0xA1], table[0xAC], table[0xAD], table[0xAE], table[0xFF]) == (
        "¡", "¬", "Ń", "®", "ÿ",
    )  # fmt: skip
    assert byte_level_alphabet() is table


def test_incremental_detokenization(tok: Tokenizer) -> None:
    prompt = tok.encode("The quick brown fox jumps over", add_special_tokens=False)
    assert len(prompt) > 5
    det = IncrementalDetokenizer(tok, prompt)
    assert det.ids == prompt[-5:] and (det.prefix_offset, det.read_offset) == (0, 5)
    assert det.CONTEXT_TOKENS == 5 and det.text == "" and det.skip_special_tokens
    out = tok.encode(" lazy é€", add_special_tokens=False)  # é: 2 byte tokens, €: 3
    assert [det.add(i) for i in out] == [" lazy", " ", "", "é", "", "", "€"]
    assert det.text == " lazy é€" and (det.prefix_offset, det.read_offset) == (9, 12)
    assert det.flush() == "" and det.text == " lazy é€"
    assert det.add(2) == "" and det.text == " lazy é€"  # a special token, skipped
    assert det.flush() == "" and det.text == " lazy é€"  # held back, and nothing to show


def test_the_prompt_gives_the_first_token_its_leading_space(tmp_path: Path) -> None:
    """A sentencepiece-style decoder drops the space of a text's first word: the prompt's
    last tokens, decoded before the output, keep it."""
    words = HFTokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, "<unk>"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    words.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path)
    assert tok.encode("Hello world") == [0, 1] and tok.decode([1]) == "world"
    assert IncrementalDetokenizer(tok, [0]).add(1) == " world"
    assert IncrementalDetokenizer(tok, []).add(1) == "world"


def test_a_flush_emits_what_is_held_back(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, [])
    assert (det.ids, det.read_offset) == ([], 0)
    euro = tok.encode("€", add_special_tokens=False)
    assert det.add(tok.encode("a", add_special_tokens=False)[0]) == "a"
    assert (det.prefix_offset, det.read_offset) == (0, 1)
    assert [det.add(i) for i in euro[:2]] == ["", ""]
    assert det.flush() == "\ufffd" and det.text == "a\ufffd"
    assert (det.prefix_offset, det.read_offset) == (3, 3) and det.flush() == ""
    keep = IncrementalDetokenizer(tok, [0], skip_special_tokens=False)
    assert keep.add(2) == "<|im_end|>" and keep.text == "<|im_end|>"
    assert keep.add(euro[0]) == "" and keep.flush() == "\ufffd"
