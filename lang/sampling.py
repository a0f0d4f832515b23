"""The sampling options of one gen() call, merged over a program's run() defaults.

Field names follow SGLang's native ``sampling_params`` (``max_new_tokens``, ``min_new_tokens``,
...); ``None`` means "not set here", so a gen() value overrides the run() default only where
given, and what stays unset is left to the server's defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

# gen_int / gen_string constrain the output with these (native ``regex``).
REGEX_INT = r"[-+]?[0-9]+"
REGEX_STRING = r"\"[\w\d\s.,;:!?'()-]*\""

# Request-level (not sampling_params) fields of the native API.
LOGPROB_FIELDS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)
# ... and all request-level fields: those, and the LoRA adapter the request runs with
REQUEST_FIELDS = (*LOGPROB_FIELDS, "lora_path")


@dataclass(slots=True)
class SamplingOptions:
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    dtype: str | None = None  # "int" or "str": gen_int / gen_string
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    lora_path: str | None = None  # a LoRA adapter loaded in the server (None: the base model)

    def __post_init__(self) -> None:
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            self.json_schema = schema_text(self.json_schema)
        if self.dtype not in (None, "int", "str"):
            raise ValueError(f"dtype must be 'int' or 'str', got {self.dtype!r}")
        if self.regex is not None and self.json_schema is not None:
            raise ValueError("gen() takes at most one of regex and json_schema")

    def over(self, defaults: SamplingOptions) -> SamplingOptions:
        """These options, with each unset field taken from ``defaults``."""
        values = {
            f.name: v if (v := getattr(self, f.name)) is not None else getattr(defaults, f.name)
            for f in fields(self)
        }
        return SamplingOptions(**values)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def with_stop(self, extra: tuple[str, ...] | list[str]) -> SamplingOptions:
        stops = self.stop_list()
        stops += [s for s in extra if s not in stops]
        return replace(self, stop=stops or None)

    def resolved(self) -> SamplingOptions:
        """dtype turned into its regex (and whitespace stops for integers)."""
        if self.dtype == "int":
            return replace(self, regex=REGEX_INT, dtype=None).with_stop([" ", "\n"])
        if self.dtype == "str":
            return replace(self, regex=REGEX_STRING, dtype=None)
        return self

    def native(self) -> dict[str, Any]:
        """SGLang's ``sampling_params`` object: the fields that are set."""
        skip = (*REQUEST_FIELDS, "dtype")
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in skip or value is None:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def logprob_request(self) -> dict[str, Any]:
        """The request-level fields that are set (logprobs, the LoRA adapter)."""
        return {k: v for k in REQUEST_FIELDS if (v := getattr(self, k)) is not None}


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingOptions) if f.name != "dtype")


def schema_text(schema: Any) -> str:
    """A JSON schema as the JSON string the native API takes: from a str, a dict or a
    pydantic model class."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    to_schema = getattr(schema, "model_json_schema", None)
    if callable(to_schema):
        return json.dumps(to_schema())
    raise TypeError(
        "json_schema must be a JSON string, a dict or a pydantic model, "
        f"got {type(schema).__name__}"
    )
