"""The batch-invariant Triton GEMM (plugins/models/invariant_gemm.py) and its opt-in in the
deterministic mode's linears (invariant_ops.py, RADIXSERVE_INVARIANT_GEMM=triton): F.linear's
values, a row's bits whatever batch it comes in and wherever in it, tiles that do not depend
on M. On a CPU machine under TRITON_INTERPRET=1 at small sizes (small tiles, so that a batch
spans several tiles and K several splits); the ``gpu`` test checks an 8B layer's shape."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    # NOTE: must be set before the kernels are defined (triton.jit reads it at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.plugins.models import invariant_gemm  # noqa: E402
from radixserve.plugins.models.invariant_gemm import (  # noqa: E402
    GemmTiles,
    invariant_linear,
    tiles_for,
)
from radixserve.plugins.models.invariant_ops import (  # noqa: E402
    GEMM_ENV,
    BlockHead,
    BlockLinear,
    block_linear,
    block_linears,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# 16-row tiles, 3 splits of K: a 40-row batch spans three M tiles, K=100 gives ragged splits
SMALL = GemmTiles(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2,
                  splits=3)  # fmt: skip
M, N, K = 40, 50, 100
# F.linear on the same inputs summed in float32: float32 within summation-order error,
# bfloat16 within one unit in the last place of the output (2**-7 relative: the interpreter's
# float32 -> bfloat16 store truncates where a GPU rounds to nearest)
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2**-7, 1e-2)}


def _operands(
    dtype: torch.dtype, m: int = M, n: int = N, k: int = K
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) / k**0.5
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), b.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("tiles", [SMALL, None], ids=["small-tiles", "default-tiles"])
def test_it_computes_f_linear(dtype: torch.dtype, with_bias: bool, tiles: GemmTiles) -> None:
    x, w, b = _operands(dtype)
    bias = b if with_bias else None
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    out = invariant_linear(x, w, bias, tiles=tiles)
    assert out.dtype == dtype and out.shape == (M, N)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=atol)


def test_leading_dimensions_and_an_empty_batch_keep_their_shape() -> None:
    x, w, b = _operands(torch.float32)
    out = invariant_linear(x[:12].view(3, 4, K), w, b, tiles=SMALL)
    assert out.shape == (3, 4, N)
    assert torch.equal(out.view(12, N), invariant_linear(x[:12], w, b, tiles=SMALL))
    assert invariant_linear(x[:0], w, b).shape == (0, N)
    with pytest.raises(ValueError, match="bfloat16"):
        invariant_linear(x, w.bfloat16(), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Rows alone, in batches of several sizes, at other positions of a tile and in other
    tiles, with the K splits added in registers or through the workspace: the same bits."""
    x, w, b = _operands(dtype)
    full = invariant_linear(x, w, b, tiles=SMALL, workspace=False)
    assert not torch.equal(full[0], full[1])  # rows differ: the comparisons below can fail
    for start, rows in [(0, 1), (7, 1), (39, 1), (3, 5), (0, 17), (9, 31)]:
        for workspace in (True, False):
            part = invariant_linear(x[start : start + rows], w, b, tiles=SMALL,
                                    workspace=workspace)  # fmt: skip
            assert torch.equal(part, full[start : start + rows]), (start, rows, workspace)


def test_default_tiles_keep_a_rows_bits_too() -> None:
    x, w, b = _operands(torch.bfloat16, m=140)
    full = invariant_linear(x, w, b)
    for start, rows in [(0, 1), (131, 1), (5, 3), (100, 40)]:
        assert torch.equal(invariant_linear(x[start : start + rows], w, b), full[start:][:rows])


def test_the_tiles_are_chosen_without_m(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list(inspect.signature(tiles_for).parameters) == ["n", "k", "dtype"]
    chosen: list[GemmTiles] = []

    def recording(n: int, k: int, dtype: torch.dtype) -> GemmTiles:
        chosen.append(tiles_for(n, k, dtype))
        return chosen[-1]

    monkeypatch.setattr(invariant_gemm, "tiles_for", recording)
    x, w, _ = _operands(torch.bfloat16, m=130)
    for m in (1, 3, 130):
        invariant_linear(x[:m], w, None)
    assert len(chosen) == 3 and all(t is chosen[0] for t in chosen)


def test_narrow_weights_split_k_and_wide_ones_do_not() -> None:
    """An 8B layer's o_proj (N=4096: 32 column tiles) splits K so that a decode step has
    enough programs; gate_up (N=28672) fills the GPU without a split."""
    o_proj, gate_up = tiles_for(4096, 4096, torch.bfloat16), tiles_for(28672, 4096, torch.bfloat16)
    assert o_proj.splits > 1 and gate_up.splits == 1
    n_tiles = 4096 // o_proj.block_n
    assert n_tiles * o_proj.splits >= invariant_gemm.FILL_PROGRAMS
    assert tiles_for(64, 64, torch.bfloat16).splits == 1  # too short a K to split


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of invariant_gemm.invariant_linear (as the swap picks it up)."""
    calls: list[int] = []

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return invariant_linear(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(invariant_gemm, "invariant_linear", counting)
    return calls


@pytest.mark.parametrize("choice", ["triton", None, "blocks"])
def test_the_environment_picks_the_kernel_or_the_row_blocks(
    monkeypatch: pytest.MonkeyPatch, choice: str | None
) -> None:
    if choice is None:
        monkeypatch.delenv(GEMM_ENV, raising=False)
    else:
        monkeypatch.setenv(GEMM_ENV, choice)
    calls = _spy(monkeypatch)
    x, w, b = _operands(torch.float32, m=9)
    model = nn.Sequential(nn.Linear(K, N)).to(DEVICE)
    with torch.no_grad():
        model[0].weight.copy_(w)
        model[0].bias.copy_(b)
    assert block_linears(model, 4) == 1 and isinstance(model[0], BlockLinear)
    head = BlockHead(w, 4)
    with torch.no_grad():
        outs = [model[0](x), model[0].partial(x), head(x)]
    if choice == "triton":
        assert len(calls) == 3
        expected = [invariant_linear(x, w, b), invariant_linear(x, w), invariant_linear(x, w)]
    else:
        assert not calls
        expected = [block_linear(x, w, b, 4)] + [block_linear(x, w, None, 4)] * 2
    for out, want in zip(outs, expected, strict=True):
        assert torch.equal(out, want)


def test_an_unknown_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GEMM_ENV, "cublas")
    with pytest.raises(ValueError, match="RADIXSERVE_INVARIANT_GEMM='cublas'.*'triton'"):
        block_linears(nn.Linear(4, 4), 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 14336)], ids=["o_proj", "down"])
def test_gpu_an_8b_layers_rows_are_batch_invariant(n: int, k: int) -> None:
    """bf16 at Llama-3.1-8B's shapes: batches of 1 to 4,096 rows (through the workspace and in
    registers) give each row the bits it has in the largest one, close to F.linear's."""
    x, w, _ = _operands(torch.bfloat16, m=4096 + 7, n=n, k=k)
    full = invariant_linear(x, w)
    ref = F.linear(x, w)
    torch.testing.assert_close(full.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for m in (1, 3, 64, 65, 300, 4096):
        for start in (0, 7):
            part = invariant_linear(x[start : start + m], w)
            assert torch.equal(part, full[start : start + m]), (m, start)


@pytest.mark.slow
def test_the_engine_runs_its_linears_through_the_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A tiny bfloat16 Llama in deterministic mode with RADIXSERVE_INVARIANT_GEMM=triton (the
    interpreter on a CPU machine): the layers and the LM head call the kernel, and greedy
    outputs are the same alone and in a batch."""
    from tiny_models import make_tiny_llama_dir

    from radixserve import Engine

    monkeypatch.setenv(GEMM_ENV, "triton")
    calls = _spy(monkeypatch)
    model = make_tiny_llama_dir(tmp_path / "tiny")
    prompts = [list(range(3, 30)), list(range(50, 55)), [7] * 12]
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    hardware = "hardware=cuda" if DEVICE == "cuda" else "hardware=cpu"
    with Engine(str(model), dtype="bfloat16", max_total_tokens=1024,
                plugins=(hardware, "attention=torch_native"),
                enable_deterministic_inference=True) as engine:  # fmt: skip
        alone = [engine.generate(input_ids=p, sampling_params=greedy)["output_ids"]
                 for p in prompts]  # fmt: skip
        batch = [r["output_ids"] for r in engine.generate(input_ids=prompts,
                                                          sampling_params=greedy)]  # fmt: skip
    assert batch == alone and all(len(ids) == 4 for ids in alone)
    # 16 steps (4 per prompt alone, 4 for the batch), each 2 layers x (qkv, o, gate_up, down)
    # and the head
    assert len(calls) >= 16 * 9
