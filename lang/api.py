"""The frontend's public functions: gen, gen_int, gen_string, select, role blocks.

Example::

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is the capital of France?")["answer"])
"""

from __future__ import annotations

from typing import Any

from radixserve.lang import choices as _choices
from radixserve.lang import ir
from radixserve.lang.choices import ChoicesMethod
from radixserve.lang.program import Function, function, get_default_backend, set_default_backend
from radixserve.lang.sampling import SamplingOptions

__all__ = [
    "Function",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: str | type | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | str | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    lora_path: str | None = None,
) -> ir.Expr:
    """Generate text into variable ``name``. Unset options take the run() defaults, then the
    server's. With ``choices`` this is select(). ``regex`` / ``json_schema`` (a JSON string,
    dict or pydantic model) constrain the output on backends with a grammar engine.
    ``lora_path`` names a LoRA adapter the server has loaded (``run(lora_path=...)`` sets it
    for every gen() of the program)."""
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method)
    options = SamplingOptions(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        regex=regex,
        json_schema=json_schema,
        dtype=_dtype(dtype),
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
        lora_path=lora_path,
    )
    return ir.Gen(name, options)


def gen_int(name: str | None = None, **kwargs: Any) -> ir.Expr:
    """Generate an integer (as text), constrained by a regex."""
    return gen(name, dtype="int", **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> ir.Expr:
    """Generate a double-quoted string, constrained by a regex."""
    return gen(name, dtype="str", **kwargs)


def image(path: str) -> ir.Expr:
    """An image at this point of the prompt (a file path, a data: URL or base64 text), for a
    vision-language model: the chat template's image token goes in the text, the image beside
    it (docs/vision.md)."""
    return ir.Image(path)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod | str | None = None,
) -> ir.Expr:
    """Append the choice the model finds most likely (scored, not sampled) into ``name``.
    ``choices_method``: token_length_normalized (default), greedy, or
    unconditional_likelihood_normalized."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select() needs a non-empty list of non-empty strings, got {choices!r}")
    method = _choices.choices_method(choices_method)
    return ir.Select(name, list(choices), temperature, method)


def _dtype(dtype: str | type | None) -> str | None:
    names = {int: "int", str: "str", "int": "int", "str": "str", "string": "str"}
    if dtype is None:
        return None
    if dtype not in names:
        raise ValueError(f"dtype must be int or str, got {dtype!r}")
    return names[dtype]


def _role_block(role: str, expr: Any) -> ir.Expr:
    if expr is None:
        raise TypeError(f"{role}() takes the block's content; use {role}_begin()/{role}_end()")
    return ir.ExprList([ir.RoleBegin(role), ir.to_expr(expr), ir.RoleEnd(role)])


def system(expr: Any = None) -> ir.Expr:
    return _role_block("system", expr)


def user(expr: Any = None) -> ir.Expr:
    return _role_block("user", expr)


def assistant(expr: Any = None) -> ir.Expr:
    return _role_block("assistant", expr)


def system_begin() -> ir.Expr:
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    return ir.RoleEnd("assistant")
