"""The LoRA Triton kernels (plugins/models/lora_triton.py) against the plain product, with
tokens of several adapters and of the base model (slot 0) interleaved and ranks below the
pool's. On a CPU machine they run under TRITON_INTERPRET=1 at small sizes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: must be set before the kernels are defined (triton.jit reads it at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.plugins.models.lora_triton import add_lora  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("offset", [0, 24])
def test_add_lora_matches_the_product_per_slot(offset: int) -> None:
    g = torch.Generator().manual_seed(0)
    t, k, n, r, slots = 7, 40, 24, 16, 3
    x = torch.randn(t, k, generator=g)
    a = torch.randn(slots, r, k, generator=g)
    b = torch.randn(slots, n, r, generator=g)
    a[1, 8:] = 0  # adapter 2 has rank 8: the pool's tail is zeros
    b[1, :, 8:] = 0
    scale = torch.tensor([0.5, 2.0, 1.25])
    token_slots = torch.tensor([0, 1, 2, 0, 3, 1, 2], dtype=torch.int32)
    y = torch.randn(t, offset + n + 8, generator=g)
    want = y.clone()
    for i, s in enumerate(token_slots.tolist()):
        if s:
            want[i, offset : offset + n] += scale[s - 1] * (b[s - 1] @ (a[s - 1] @ x[i]))
    got = y.to(DEVICE)
    add_lora(got, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), scale.to(DEVICE),
             token_slots.to(DEVICE), offset)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_engine_on_the_triton_backend_equals_the_torch_backend(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The hooks, the slot buffer and the kernels together: one batch of an adapter and the
    base model gives the torch backend's tokens (interpreted on the CPU: a short run; on a GPU
    the triton backend runs in CUDA graphs, the torch one, which a graph would not replay,
    without)."""
    from lora_adapters import make_adapter

    from radixserve.entrypoints.engine import Engine

    adapter = make_adapter(tiny_llama_dir, tmp_path / "a", rank=4, seed=1, scale=4.0)
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        graphs_off = DEVICE == "cuda" and backend == "torch"
        with Engine(str(tiny_llama_dir), lora_paths=[f"a={adapter}"], lora_backend=backend,
                    max_total_tokens=4096, plugins={"hardware": DEVICE}, dtype="float32",
                    disable_cuda_graph=graphs_off) as engine:  # fmt: skip
            out = engine.generate(input_ids=[[5, 6, 7, 8, 9]] * 2, sampling_params=params,
                                  lora_path=["a", None])  # fmt: skip
            outs[backend] = [o["output_ids"] for o in out]
    assert outs["triton"] == outs["torch"]
    assert outs["torch"][0] != outs["torch"][1]
