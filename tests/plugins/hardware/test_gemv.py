"""The Triton matrix-vector product (plugins/hardware/gemv.py) equals F.linear at one row, and
with SiLU(gate) * up fused into its input equals the down projection of silu_mul's output.

On a CPU machine it runs under TRITON_INTERPRET=1 in float32; on a CUDA machine compiled."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.plugins.hardware.gemv import AUTO, gemv, pick, takes  # noqa: E402
from radixserve.plugins.models.fused_ops import silu_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = (8, 32, 4)  # small blocks for the small test shapes


def test_one_row_equals_linear() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 96, device=DEVICE)
    x = torch.randn(1, 96, device=DEVICE)
    assert takes(x, w, CFG, silu=False)
    torch.testing.assert_close(gemv(x, w, CFG), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_silu_fused_into_the_input_equals_silu_mul_then_linear() -> None:
    torch.manual_seed(1)
    w = torch.randn(40, 64, device=DEVICE)
    gate_up = torch.randn(1, 128, device=DEVICE)
    assert takes(gate_up, w, CFG, silu=True)
    want = F.linear(silu_mul(gate_up), w)
    torch.testing.assert_close(gemv(gate_up, w, CFG, silu=True), want, rtol=1e-5, atol=1e-5)


def test_what_it_does_not_take() -> None:
    w = torch.randn(48, 96, device=DEVICE)
    assert not takes(torch.randn(2, 96, device=DEVICE), w, CFG, silu=False)  # two rows
    assert not takes(torch.randn(1, 96, device=DEVICE), w[:44], CFG, silu=False)  # 44 % 8
    assert not takes(torch.randn(1, 80, device=DEVICE), w[:, :80], CFG, silu=False)  # 80 % 32
    assert not takes(torch.randn(1, 96, device=DEVICE), w, CFG, silu=True)  # not [gate | up]


def test_the_configuration_by_shape() -> None:
    """AUTO picks whole strips of the row (here 256 wide) and refuses a row no strip divides."""
    torch.manual_seed(2)
    w = torch.randn(8, 256, device=DEVICE)
    x = torch.randn(1, 256, device=DEVICE)
    assert pick(8, 256) == (4, 256, 4) and takes(x, w, AUTO, silu=False)
    torch.testing.assert_close(gemv(x, w, AUTO), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert pick(14336, 4096) == (16, 256, 4)  # the tall gate_up of an 8B model at TP2
    assert not takes(torch.randn(1, 96, device=DEVICE), torch.randn(8, 96), AUTO, silu=False)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CPU engine with the interpreted kernel; on a CUDA device the engines use it",
)
def test_a_model_with_the_gemv_decodes_as_without(tmp_path: Path) -> None:
    """The decoder skeleton's one-row products through the kernel (qkv, o, gate_up, and down
    with SiLU inside) give the same greedy tokens as the plain products, float32."""
    from tiny_models import make_tiny_llama_dir

    from radixserve import Engine
    from radixserve.plugins.hardware import gemv as gemv_module
    from radixserve.plugins.models import fused_ops

    model_dir = make_tiny_llama_dir(
        tmp_path / "tiny", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, num_hidden_layers=2,
    )  # fmt: skip
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    plugins = ["hardware=cpu", "attention=torch_native", "grammar=none"]
    with Engine(str(model_dir), dtype="float32", max_total_tokens=1024, plugins=plugins) as eng:
        want = eng.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=params)["output_ids"]
        calls: list[bool] = []

        def counted(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(bool(kwargs.get("silu", args[3] if len(args) > 3 else False)))
            return gemv(*args, **kwargs)  # type: ignore[arg-type]

        gemv_module.gemv = counted  # type: ignore[assignment]
        try:
            for layer in eng.core.runner.model.layers:
                layer.gemv_cfg, layer.gemv_silu, layer.fused = CFG, True, fused_ops
            got = eng.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=params)["output_ids"]
        finally:
            gemv_module.gemv = gemv
    assert got == want
    # at least the 5 decode steps (the cached prompt's 1-token extend is one row too) x 2
    # layers x (qkv, o, gate_up, and down with SiLU inside)
    assert sum(calls) >= 5 * 2 and len(calls) == 4 * sum(calls)
