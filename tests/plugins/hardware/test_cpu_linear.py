"""The CPU platform's float32 linears on packed weights (plugins/hardware/cpu_linear.py): the
AVX2 panels kernel at every row count, or oneDNN's blocked layout for decode-sized steps (MKL's
``F.linear`` for the rest); the same products as ``F.linear`` to float32 rounding; left out
where they do not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixserve import Engine
from radixserve.plugins.hardware import cpu_kernels
from radixserve.plugins.hardware.cpu_linear import (
    PACKED_MAX_ROWS,
    OneDNNPacking,
    PackedHead,
    PackedLinear,
    PanelPacking,
    default_packing,
)

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)
needs_panels = pytest.mark.skipif(
    cpu_kernels.unavailable_reason() is not None or not cpu_kernels.load().linear_f32_vectorized(),
    reason="radixserve's CPU kernels are not built with AVX2 + FMA here",
)


def packed_copy(layer: nn.Linear, packing: OneDNNPacking | PanelPacking) -> PackedLinear:
    packed = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    packed.load_state_dict(layer.state_dict())
    packed.__class__ = PackedLinear
    packed.packing = packing  # type: ignore[attr-defined]
    packed.weights_reloaded()  # type: ignore[attr-defined]
    return packed  # type: ignore[return-value]


@needs_panels
@pytest.mark.parametrize("shape", [(64, 96), (40, 33), (576, 16), (7, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_panels_match_f_linear_for_any_rows(shape: tuple[int, int], bias: bool) -> None:
    """Every tile height (1-6 rows and their sums), a partial last panel (33, 7 and 1
    features), with and without bias; rows are also strided views."""
    reference = nn.Linear(*shape, bias=bias)
    layer = packed_copy(reference, PanelPacking())
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 32, 300):
        x = torch.randn(rows, 2 * shape[0])[:, : shape[0]]  # row stride twice the width
        bias64 = None if reference.bias is None else reference.bias.double()
        expected = F.linear(x.double(), reference.weight.double(), bias64)
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, shape[0])  # leading dims are kept
    assert layer(x).shape == (2, 3, shape[1])


@needs_panels
def test_a_row_does_not_depend_on_its_batch() -> None:
    """Each output sums its products in one fixed order, at any rows and threads."""
    layer = packed_copy(nn.Linear(576, 200), PanelPacking())
    x = torch.randn(37, 576)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(37)])
    assert torch.equal(layer(x), alone)


@needs_panels
def test_bad_inputs_get_a_reason() -> None:
    op = cpu_kernels.load().linear_f32_packed
    packed = PanelPacking.pack(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="do not fill"):
        op(torch.randn(2, 8), packed, 60, None)
    with pytest.raises(RuntimeError, match="packed must be"):
        op(torch.randn(2, 9), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(torch.randn(2, 8), packed, 40, torch.zeros(39))


@needs_onednn
def test_onednn_matches_f_linear_and_leaves_one_row_and_prefill_to_mkl() -> None:
    reference = nn.Linear(64, 96)
    layer = packed_copy(reference, OneDNNPacking())
    for rows in (1, 2, 8, 33, PACKED_MAX_ROWS - 1, PACKED_MAX_ROWS):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    # one row and prefill-sized steps: the float parameter itself (MKL)
    for rows in (1, PACKED_MAX_ROWS, 3 * PACKED_MAX_ROWS):
        x = torch.randn(rows, 64)
        assert torch.equal(layer(x), reference(x))


@pytest.mark.skipif(default_packing() is None, reason="no packing on this machine")
def test_reloads_rebuild_the_packed_copies() -> None:
    layer = packed_copy(nn.Linear(64, 96), default_packing())  # type: ignore[arg-type]
    head = PackedHead(torch.randn(50, 64))
    with torch.no_grad():
        layer.weight.mul_(2)  # a reload changes the parameters in place ...
        head.weight.mul_(-1)
    layer.weights_reloaded()  # ... and rebuilds the packed copies
    head.weights_reloaded()
    x = torch.randn(4, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(head(x), F.linear(x, head.weight))


@pytest.mark.skipif(default_packing() is None, reason="no packing on this machine")
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
