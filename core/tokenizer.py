"""Tokenization, chat templates (rendered as transformers does) and incremental detokenization."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from radixserve.core import chat_template as templating
from radixserve.core.config import ConfigError
from radixserve.core.request import InvalidRequest

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class Tokenizer:
    """A model's tokenizer (``tokenizer.json``) and chat template (``tokenizer_config.json``)."""

    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"model directory '{model_dir}' has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.templates = _named_templates(chat_template or self.config.get("chat_template"))
        self.special_tokens = {
            name: text
            for name in templating.SPECIAL_TOKEN_NAMES
            if (text := _token_text(self.config.get(name))) is not None
        }
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The default template's source (the ``tool_use`` one is picked when tools are given)."""
        return self.template_for(None)

    def template_for(self, tools: list[dict[str, Any]] | None) -> str | None:
        """The template source rendered for a request with these ``tools``, if any."""
        if self.templates is None:
            return None
        try:
            return templating.select_template(self.templates, tools=tools)
        except TemplateError:
            return None

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (grammar plugins read its vocabulary)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            if isinstance(text, str) and not _is_valid_unicode(text):
                # JSON may escape a lone surrogate ("\ud800"); such text has no UTF-8 form.
                raise InvalidRequest(
                    "the text contains a lone surrogate (invalid Unicode); send valid UTF-8"
                ) from None
            raise

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text. The tokenizer releases the GIL for a batch (not for one
        ``encode``), so another thread, e.g. a server's event loop, runs meanwhile."""
        try:
            batch = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        except TypeError:
            for text in texts:
                self.encode(text, add_special_tokens)  # raises naming the lone surrogate
            raise
        return [e.ids for e in batch]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def eos_token_ids(self) -> tuple[int, ...]:
        """The id of the tokenizer's own EOS token, if it names one the vocabulary has."""
        token_id = None if self.eos_token is None else self.token_to_id(self.eos_token)
        return () if token_id is None else (token_id,)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` as ``transformers``' ``apply_chat_template(..., tokenize=False)``
        would with the same arguments; InvalidRequest on a bad message or a failing template."""
        if not self.templates:
            raise InvalidRequest("this model has no chat template; pass --chat-template")
        _check_messages(messages)
        try:
            source = templating.select_template(self.templates, tools=tools)
            return templating.render(
                source,
                messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                special_tokens=self.special_tokens,
                **extra,
            )
        except TemplateError as e:
            raise InvalidRequest(f"chat template failed on these messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        # The template already holds any BOS it wants, so no special tokens are added here.
        return self.encode(self.apply_chat_template(messages, **extra), add_special_tokens=False)


@cache
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: how byte-level BPE vocabularies
    (GPT-2, Llama 3, SmolLM2, Qwen2) spell bytes, e.g. space as "Ġ"."""
    table = {b: chr(b) for b in [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(0x100 + n)
    return table


def _named_templates(value: Any) -> str | dict[str, str] | None:
    # tokenizer_config.json may hold several templates as [{"name": ..., "template": ...}].
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value}
    return value


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object")
        if m.get("role") not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}"
            )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Each token costs one call into the tokenizer's own streaming decoder (``DecodeStream``,
    about 2 µs), which holds back text that ends in an incomplete UTF-8 sequence until a later
    token completes it. ``flush`` emits whatever is still held back at the end.
    """

    CONTEXT_TOKENS = 5

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the first output token its leading-space context.
        self.ids = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self._stream = DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)
        self._backend = tokenizer.backend
        # ids[prefix_offset:read_offset] decoded last; ids[read_offset:] are held back
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        delta = self._stream.step(self._backend, token_id)
        if not delta:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: emit whatever is held back, even if incomplete."""
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], skip)
        new_text = decode(self.ids[self.prefix_offset :], skip)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
