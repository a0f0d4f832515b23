"""The CPU platform's float32 linears on oneDNN's packed weights (plugins/hardware/cpu_linear.py):
used for decode-sized steps of two rows or more, with the float parameter for one row and for
prefill-sized steps; the same products as
``F.linear`` to float32 rounding; left out where they do not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixserve import Engine
from radixserve.plugins.hardware.cpu_linear import PACKED_MAX_ROWS, PackedHead, PackedLinear

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


def test_packed_linear_matches_f_linear_for_any_rows() -> None:
    layer = nn.Linear(64, 96)
    reference = nn.Linear(64, 96)
    reference.load_state_dict(layer.state_dict())
    layer.__class__ = PackedLinear
    layer.weights_reloaded()
    for rows in (1, 2, 8, 33, PACKED_MAX_ROWS - 1, PACKED_MAX_ROWS):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    # one row and prefill-sized steps: the float parameter itself (MKL)
    for rows in (1, PACKED_MAX_ROWS, 3 * PACKED_MAX_ROWS):
        x = torch.randn(rows, 64)
        assert torch.equal(layer(x), reference(x))
    with torch.no_grad():
        layer.weight.mul_(2)  # a reload changes the parameter in place ...
    layer.weights_reloaded()  # ... and rebuilds the packed copy
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("flags", [{}, {"dtype": "bfloat16"}, {"quantization": "int8wo"}])
def test_the_platform_packs_float32_models_only(tiny_llama_dir: Path, flags: dict) -> None:
    with Engine(str(tiny_llama_dir), plugins=["hardware=cpu"], **flags) as engine:
        model = engine.core.runner.model
        packed = isinstance(model.layers[0].qkv_proj, PackedLinear)
        assert packed == (not flags)
        assert isinstance(model.head, PackedHead) == (not flags)
        out = engine.generate(
            input_ids=[[5, 6, 7, 8], [9, 10, 11]],
            sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        )
        assert all(len(o["output_ids"]) == 4 for o in out)
