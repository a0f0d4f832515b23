"""Client-side chat templates: how role blocks become text for a completion-style backend.

A backend picks its template from the model's name (``/get_model_info``'s ``model_path``, a
local model directory or an OpenAI model name), or from the model's own Jinja template text
when the name says nothing. Each template lists the stop strings that end an assistant turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: dict[str, tuple[str, str]]  # role -> (prefix, suffix)
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = field(default_factory=tuple)
    image_token: str = "<image>"  # the text image(path) adds for one image

    def prefix_and_suffix(self, role: str) -> tuple[str, str]:
        try:
            return self.roles[role]
        except KeyError:
            raise ValueError(
                f"chat template {self.name!r} has no role {role!r}; it has {', '.join(self.roles)}"
            ) from None


def _chatml(name: str, system: str | None = None) -> ChatTemplate:
    roles = {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")}
    return ChatTemplate(name, roles, system, ("<|im_end|>",))


SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate(
            "default",
            {
                "system": ("SYSTEM:", "\n"),
                "user": ("USER:", "\n"),
                "assistant": ("ASSISTANT:", "\n"),
            },
        ),
        _chatml("chatml"),
        ChatTemplate(
            "qwen2-vl",
            {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant")},
            stop_str=("<|im_end|>",),
            image_token="<|vision_start|><|image_pad|><|vision_end|>",
        ),
        # SmolLM2's own template inserts this system turn when a conversation has none.
        _chatml("smollm2", SMOLLM_SYSTEM),
        ChatTemplate(
            "llama-3-instruct",
            {
                r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>")
                for r in ("system", "user", "assistant")
            },
            stop_str=("<|eot_id|>",),
        ),
    )
}

# (substring of the lower-cased model name, template name), first match wins.
_BY_NAME = (
    ("smollm", "smollm2"),
    ("qwen2-vl", "qwen2-vl"),
    ("qwen2_vl", "qwen2-vl"),
    ("qwen", "chatml"),
    ("chatml", "chatml"),
    ("llama-3", "llama-3-instruct"),
    ("llama3", "llama-3-instruct"),
)


def get_chat_template(name: str) -> ChatTemplate:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; available: {', '.join(TEMPLATES)}")
    return TEMPLATES[name]


def template_for_model(model_name: str, jinja_template: str | None = None) -> ChatTemplate:
    """The template for a model name, else one recognised in its Jinja template, else
    ``default``."""
    lowered = model_name.lower()
    for needle, name in _BY_NAME:
        if needle in lowered:
            return TEMPLATES[name]
    if jinja_template:
        if "<|image_pad|>" in jinja_template:
            return TEMPLATES["qwen2-vl"]
        if "<|im_start|>" in jinja_template:
            return TEMPLATES["chatml"]
        if "<|start_header_id|>" in jinja_template:
            return TEMPLATES["llama-3-instruct"]
    return TEMPLATES["default"]
