"""Chat templates rendered the way ``transformers`` renders them.

Model templates are written for (and tested against) ``transformers``' renderer, so ours
reproduces its environment exactly: a Jinja ``ImmutableSandboxedEnvironment`` with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension (``{% break %}``,
``{% continue %}``), a ``{% generation %}`` block that renders its body, ``tojson`` as
``json.dumps`` (no HTML escaping, ``ensure_ascii=False``, keys in insertion order, ``indent``
and ``separators`` honoured), ``raise_exception``, ``strftime_now``, and the restricted
``dict``/``namespace`` globals. The template sees what ``apply_chat_template`` gives it:
``messages`` (``None`` values dropped, reasoning aliased under its usual names), ``tools``,
``documents``, ``add_generation_prompt``, the named special tokens and any extra keyword.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning arrives under; templates read the first (and gpt-oss's "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    when serving it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (no CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: "
                f"{name!r}"
            )


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` in transformers' chat-template environment (cached per source)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def select_template(
    templates: str | dict[str, str], name: str | None = None, tools: Any = None
) -> str:
    """Pick the template source as transformers does when a model ships several by name:
    ``name`` if given, else ``tool_use`` when tools are passed, else ``default``."""
    if isinstance(templates, str):
        return templates
    if name is not None and name in templates:
        return templates[name]
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise jinja2.TemplateError(
        f"the model has several chat templates and none is named 'default'; "
        f"available: {', '.join(sorted(templates))}"
    )


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render like ``tokenizer.apply_chat_template(messages, tools=..., documents=...,
    add_generation_prompt=..., tokenize=False, **kwargs)``; raises ``jinja2.TemplateError``."""
    chat = [_plain_message(m) for m in messages]
    template_kwargs = {**(special_tokens or {}), **kwargs}  # kwargs win, as in transformers
    return compile_template(source).render(
        messages=chat,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(template_kwargs),
    )


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    # transformers drops None-valued keys (templates handle a missing key, not a literal None)
    # and copies reasoning under the names templates read.
    out = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _plain(value: Any) -> Any:
    # Only JSON data reaches the sandbox: subclasses and objects lose their methods.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"
