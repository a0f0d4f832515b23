"""The Triton product of a few dozen rows split over K (plugins/hardware/skinny_gemm.py) equals
F.linear, with the splits merged in its launch, over repeated launches (the merge counters must
be left zeroed), and with SiLU(gate) * up fused into its input equals the down projection of
silu_mul's output.

On a CPU machine it runs under TRITON_INTERPRET=1 in float32 at small sizes; on a CUDA machine
compiled, in bfloat16, at the 8B shape's sizes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.plugins.hardware.skinny_gemm import (  # noqa: E402
    TABLE,
    counters,
    pick,
    skinny_gemm,
    takes,
)
from radixserve.plugins.models.fused_ops import silu_mul  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float32
# (N, K) and configurations (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, swap)
SHAPE = (6144, 4096) if GPU else (64, 128)
CONFIGS = (
    [(64, 128, 4, 4, 4, True), (128, 128, 2, 4, 3, False), (64, 128, 1, 4, 4, True)]
    if GPU
    else [(32, 32, 4, 4, 1, True), (16, 32, 2, 4, 1, False), (32, 64, 1, 4, 1, True)]
)
TOL = {"rtol": 2e-2, "atol": 2e-2} if GPU else {"rtol": 1e-4, "atol": 1e-4}


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, DTYPE)
    x = torch.randn(m, k, generator=g).to(DEVICE, DTYPE)
    return x, w


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"split{c[2]}-swap{int(c[5])}")
@pytest.mark.parametrize("m", [2, 17, 64])
def test_equals_linear(m: int, cfg: tuple) -> None:
    n, k = SHAPE
    x, w = _operands(m, n, k, seed=m)
    assert takes(x, w, cfg, silu=False)
    want = F.linear(x.float(), w.float())
    for _ in range(2):  # a second launch finds the counters the first one left
        torch.testing.assert_close(skinny_gemm(x, w, cfg).float(), want, **TOL)
    assert not counters(x.device).any(), "the merge counters are left zeroed"


def test_the_result_does_not_depend_on_which_split_finished_last() -> None:
    """The last program sums the partials in split order: launches agree bit for bit."""
    n, k = SHAPE
    x, w = _operands(33, n, k, seed=5)
    cfg = CONFIGS[0]
    first = skinny_gemm(x, w, cfg)
    for _ in range(3):
        assert torch.equal(skinny_gemm(x, w, cfg), first)


def test_silu_fused_into_the_input_equals_silu_mul_then_linear() -> None:
    n, k = SHAPE
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, DTYPE)
    gate_up = torch.randn(24, 2 * k, generator=g).to(DEVICE, DTYPE)
    cfg = CONFIGS[0]
    assert takes(gate_up, w, cfg, silu=True)
    want = F.linear(silu_mul(gate_up).float(), w.float())
    torch.testing.assert_close(skinny_gemm(gate_up, w, cfg, silu=True).float(), want, **TOL)


def test_what_it_does_not_take() -> None:
    n, k = SHAPE
    cfg = CONFIGS[0]
    w = torch.empty(n, k, device=DEVICE, dtype=DTYPE)
    assert not takes(torch.empty(1, k, device=DEVICE, dtype=DTYPE), w, cfg, silu=False)  # 1 row
    assert not takes(torch.empty(65, k, device=DEVICE, dtype=DTYPE), w, cfg, silu=False)
    assert not takes(torch.empty(8, k, device=DEVICE, dtype=DTYPE), w[:-8], cfg, silu=False)
    assert not takes(torch.empty(8, k, device=DEVICE, dtype=DTYPE), w, cfg, silu=True)
    assert not takes(torch.empty(8, k, device=DEVICE, dtype=DTYPE), w, None, silu=False)


def test_pick_covers_only_measured_shapes() -> None:
    """A shape the table does not name stays with cuBLAS; a named one has a configuration for
    every row block it lists, and each of those divides its shape."""
    assert pick(12345, 4096, 64) is None
    assert pick(4096, 14336, 64) is not None and pick(4096, 14336, 8) is None  # 9 rows up
    assert pick(4096, 14336, 65) is None
    for (n, k, _), by_rows in TABLE.items():
        for bm, (bn, bk, split, *_rest) in by_rows.items():
            assert bm in (16, 32, 64) and n % bn == 0 and k % (bk * split) == 0


@pytest.mark.skipif(GPU, reason="a CPU engine with the interpreted kernel; on a CUDA device "
                    "the engines of the 8B shape use it (bench/gpu.py)")  # fmt: skip
def test_a_model_with_the_skinny_gemm_decodes_as_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 12 decodes through the decoder skeleton with every product of 9-64 rows in
    the kernel (qkv, o, gate_up, down; split over K or not) gives the plain products' greedy
    tokens, float32."""
    from tiny_models import make_tiny_llama_dir

    from radixserve import Engine
    from radixserve.plugins.hardware import skinny_gemm as module

    model_dir = make_tiny_llama_dir(
        tmp_path / "tiny", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, num_hidden_layers=2,
    )  # fmt: skip
    prompts = [[5 + i, 6, 7 + 2 * i, 8, 9] for i in range(12)]
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    plugins = ["hardware=cpu", "attention=torch_native", "grammar=none"]
    split, whole = (32, 32, 2, 4, 1, True), (32, 32, 1, 4, 1, False)
    table = {(128, 64, False): {16: split}, (64, 64, False): {16: whole},
             (256, 64, False): {16: whole}, (64, 128, False): {16: split}}  # fmt: skip
    with Engine(str(model_dir), dtype="float32", max_total_tokens=1024, plugins=plugins) as eng:
        want = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        shapes: list[tuple[int, ...]] = []

        def counted(x: torch.Tensor, weight: torch.Tensor, *args: object) -> torch.Tensor:
            shapes.append(tuple(weight.shape))
            return skinny_gemm(x, weight, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(module, "TABLE", table)
        monkeypatch.setattr(module, "skinny_gemm", counted)
        for layer in eng.core.runner.model.layers:
            layer.gemv_cfg, layer.skinny = (8, 32, 4), True
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert got == want
    # at least 3 decode steps of 12 rows x 2 layers x the four products
    assert len(shapes) >= 3 * 2 * 4
    assert sorted(set(shapes)) == sorted((n, k) for n, k, _ in table)
