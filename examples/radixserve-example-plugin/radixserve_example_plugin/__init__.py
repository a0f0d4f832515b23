"""radixserve example plugin: adds the model architecture ``ExampleLlamaForCausalLM``.

radixserve finds this module through the entry point ``example_arch`` in the ``radixserve``
group (see pyproject.toml) and calls its hook implementations once per process. The module
imports nothing heavy: the model (and torch) are imported only when the factory runs, so
``radixserve plugins`` and ``--help`` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import radixserve

if TYPE_CHECKING:
    from radixserve_example_plugin.model import ExampleLlamaForCausalLM

ARCHITECTURE = "ExampleLlamaForCausalLM"


def build_model(config: Any, attention: Any, dtype: Any, device: str) -> ExampleLlamaForCausalLM:
    """The model factory: ``(model_config, attention, dtype, device) -> CausalLM``."""
    from radixserve_example_plugin.model import ExampleLlamaForCausalLM

    return ExampleLlamaForCausalLM(config, attention, dtype, device)


@radixserve.hookimpl
def register_models(register: Any) -> None:
    # The name must equal the `architectures[0]` entry of the model's config.json.
    register(
        ARCHITECTURE,
        build_model,
        description="example plugin: Llama with logits scaled by config.json `logit_scale`",
    )
