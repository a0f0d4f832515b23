"""Our chat-template renderer against transformers' ``apply_chat_template`` (the reference).

The templates below are written for these tests in the style of real model templates
(Qwen2.5-style ChatML with a tools block, Llama-3.1-style headers with JSON tool specs, a
reasoning template with documents and extra keywords); they use the features transformers'
environment adds: ``tojson`` without sorting or HTML escaping (plus ``indent``), loop
controls, ``raise_exception``, ``strftime_now``, ``namespace``, ``{% generation %}``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tiny_models import SPECIAL_TOKENS, make_tokenizer_json

from radixserve.core.request import InvalidRequest
from radixserve.core.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CHATML_TOOLS = """\
{%- if tools %}
<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions. Signatures:
<tools>
{%- for tool in tools %}
{{ "\\n" }}{{ tool | tojson }}
{%- endfor %}
</tools>

Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{%- set plain = message.role == 'assistant' and not message.tool_calls %}
{%- if message.role in ['user', 'system'] or plain %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for call in message.tool_calls %}
{%- set fn = call.function if call.function is defined else call %}
<tool_call>
{%- set args = fn.arguments if fn.arguments is string else fn.arguments | tojson %}
{"name": "{{ fn.name }}", "arguments": {{ args }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA_TOOLS = """\
{{- bos_token }}
{%- set ns = namespace(system='', first_user=-1) %}
{%- for m in messages %}
{%- if m.role == 'user' %}{% set ns.first_user = loop.index0 %}{% break %}{% endif %}
{%- if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}
{%- endfor %}
<|im_start|>system
Cutting Knowledge Date: December 2023
Today Date: {{ strftime_now('%d %b %Y') }}
{% if tools %}Environment: ipython
{% endif %}
{{ ns.system }}<|im_end|>
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- if loop.index0 == ns.first_user and tools %}
<|im_start|>user
Given the following functions, respond with a JSON function call.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ m.content }}<|im_end|>
{%- elif m.role == 'tool' %}
<|im_start|>ipython
{{ m.content | tojson if m.content is mapping else m.content }}<|im_end|>
{%- elif m.tool_calls %}
{%- if m.tool_calls | length != 1 %}{{ raise_exception('one tool call per turn') }}{% endif %}
<|im_start|>assistant
{%- set fn = m.tool_calls[0].function %}
{"name": "{{ fn.name }}", "parameters": {{ fn.arguments | tojson }}}<|im_end|>
{%- else %}
<|im_start|>{{ m.role }}
{% generation %}{{ m.content | trim }}{% endgeneration %}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

REASONING_DOCS = """\
{%- set sep = dict(a=',', b=': ') %}
{%- if documents %}<|im_start|>system
{% for d in documents %}[{{ loop.index }}] {{ d.title }}: {{ d|tojson(separators=(sep.a, sep.b)) }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{{- m.content if m.content is defined else '(none)' }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}
{% endif %}{{ eos_token if close else '' }}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city; use <b>only</b> if asked & needed. Zürich OK, 東京 too",
        "parameters": {
            "type": "object",
            "properties": {
                "zcity": {"type": "string", "description": 'City name, e.g. "São Paulo"'},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "nested": {"type": "object", "properties": {"a<b": {"type": "boolean"}}},
            },
            "required": ["zcity"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief & exact <always>."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"zcity": "Zürich", "unit": "c", "opts": {"x<y": "a&b"}},
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
        {"role": "assistant", "content": "  21 °C and sunny.  "},
        {"role": "user", "content": "Thanks"},
    ],
]


def _tokenizer_dirs(tmp_path: Path, template: Any) -> tuple[Tokenizer, Any]:
    make_tokenizer_json(tmp_path / "tokenizer.json")
    config = {
        "chat_template": template,
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    return Tokenizer(tmp_path), reference


def _both(ours: Tokenizer, ref: Any, chat: list[dict[str, Any]], **kw: Any) -> tuple[str, str]:
    expected = ref.apply_chat_template(chat, tokenize=False, **kw)
    kw.setdefault("add_generation_prompt", False)  # transformers' default; ours defaults to True
    return ours.apply_chat_template(chat, **kw), expected


@pytest.mark.parametrize("template", [CHATML_TOOLS, LLAMA_TOOLS], ids=["chatml", "llama"])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL, SEARCH_TOOL]], ids=["plain", "tools"])
@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "tool-turns"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_renders_as_transformers(
    tmp_path: Path, template: str, tools: Any, chat: list[dict[str, Any]], gen: bool
) -> None:
    ours, ref = _tokenizer_dirs(tmp_path, template)
    got, expected = _both(ours, ref, chat, tools=tools, add_generation_prompt=gen)
    assert got == expected
    ids = ref.apply_chat_template(
        chat, tools=tools, add_generation_prompt=gen, tokenize=True, return_dict=False
    )
    assert ours.encode_chat(chat, tools=tools, add_generation_prompt=gen) == ids
    if tools:  # tojson as transformers': insertion order, no HTML escapes, raw non-ASCII
        assert "Zürich OK, 東京 too" in got and "<b>only</b>" in got and "&" in got
        assert got.index('"zcity"') < got.index('"unit"')


def test_documents_extra_kwargs_reasoning_and_generation_block(tmp_path: Path) -> None:
    ours, ref = _tokenizer_dirs(tmp_path, REASONING_DOCS)
    docs = [{"title": "Doc <1>", "text": "a & b — ü"}, {"title": "Two", "text": "x"}]
    chat = [
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A.", "reasoning": "because <reasons>"},
        {"role": "user", "content": None, "name": None},
    ]
    for kw in (
        {"documents": docs, "enable_thinking": False, "close": True},
        {"documents": None, "close": False, "add_generation_prompt": True},
        {"documents": docs, "enable_thinking": True, "close": False, "eos_token": "<END>"},
    ):
        got, expected = _both(ours, ref, chat, **kw)
        assert got == expected


def test_named_templates_pick_tool_use_with_tools(tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": REASONING_DOCS.replace("close", "false")},
        {"name": "tool_use", "template": CHATML_TOOLS},
    ]
    ours, ref = _tokenizer_dirs(tmp_path, named)
    for tools in (None, [SEARCH_TOOL]):
        got, expected = _both(ours, ref, CHATS[0], tools=tools)
        assert got == expected


def test_raise_exception_and_sandbox(tmp_path: Path) -> None:
    ours, ref = _tokenizer_dirs(tmp_path, LLAMA_TOOLS)
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call, call]}]
    with pytest.raises(Exception, match="one tool call per turn"):
        ref.apply_chat_template(chat, tokenize=False)
    with pytest.raises(InvalidRequest, match="one tool call per turn"):
        ours.apply_chat_template(chat)
    escape = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(InvalidRequest, match="underscore"):
        Tokenizer(tmp_path, chat_template=escape).apply_chat_template(chat[:1])


# -- the renderer alone (core/chat_template.py), without a tokenizer --------------------------


class _Str(str):
    secret = "leaked"


class _Int(int):
    secret = "leaked"


class _Float(float):
    secret = "leaked"


def test_only_plain_json_data_reaches_the_template() -> None:
    from pydantic import BaseModel

    from radixserve.core.chat_template import render

    class Tool(BaseModel):
        name: str
        tags: tuple[str, ...]

    source = (
        "{% for x in items %}[{{ x }}|{{ x.secret }}]{% endfor %}"
        "{{ pair[1] }}{{ pair | length }}{{ tool.name }}{{ tool.tags[0] }}{{ other }}"
    )
    items = [_Str("s"), _Int(3), _Float(1.5), True]
    tool = Tool(name="f", tags=("t",))
    out = render(source, [], items=items, pair=(_Str("a"), _Str("b")), tool=tool, other=object())
    assert out == "[s|][3|][1.5|][True|]b2ft<object>"


def test_reasoning_aliases_messages_and_the_generation_prompt() -> None:
    from radixserve.core.chat_template import render

    source = (
        "{% for m in messages %}{{ m.role }}:{{ m.thinking }}/{{ m.reasoning_content }}"
        "/{{ m.content is defined }};{% endfor %}{% if add_generation_prompt %}GEN{% endif %}"
    )
    chat = [{"role": "assistant", "content": None, "reasoning": "why"}]
    assert render(source, chat) == "assistant:why/why/False;"
    assert render(source, chat, add_generation_prompt=True).endswith("GEN")


def test_tojson_dict_and_namespace_globals() -> None:
    from radixserve.core.chat_template import render

    source = (
        "{{ d | tojson(sort_keys=True) }} {{ d | tojson }} {{ 'é' | tojson }} "
        "{{ dict([['a', 1]]) | tojson }} {{ dict.fromkeys(['x', 'y'], 0) | tojson }} "
        "{% set ns = namespace({'n': 1}, m=2) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{{ ns.m }}"
    )
    assert render(source, [], d={"b": 1, "a": 2}) == (
        '{"a": 2, "b": 1} {"b": 1, "a": 2} "é" {"a": 1} {"x": 0, "y": 0} 22'
    )
    with pytest.raises(jinja2.exceptions.SecurityError, match="'_hidden'"):
        render("{% set ns = namespace() %}{% set ns._hidden = 1 %}", [])
    with pytest.raises(jinja2.exceptions.SecurityError, match="'_x'"):
        render("{% set ns = namespace({'_x': 1}) %}", [])


def test_select_template_by_name_tools_and_default() -> None:
    from radixserve.core.chat_template import select_template

    named = {"default": "D", "tool_use": "T", "rag": "R"}
    assert select_template("S") == "S"
    assert select_template(named, "rag") == "R"
    assert select_template(named, "rag", tools=[{}]) == "R"
    assert select_template(named, "missing") == "D"
    assert select_template(named, "missing", tools=[]) == "T"
    assert select_template(named) == "D"
    assert select_template({"default": "D", "rag": "R"}, tools=[{}]) == "D"
    with pytest.raises(jinja2.TemplateError) as e:
        select_template({"rag": "R", "chat": "C"}, "missing")
    assert str(e.value) == (
        "the model has several chat templates and none is named 'default'; available: chat, rag"
    )
