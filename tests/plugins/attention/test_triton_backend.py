"""The ``triton`` attention backend against ``torch_native``: one layer over mixed decode +
prefill steps (its per-step metadata and device table), and whole engines (greedy tokens).

On a CPU machine the kernels run under TRITON_INTERPRET=1; the real-GPU tests are marked ``gpu``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from paged_steps import shuffled_allocator, step_batch  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.core.config import ModelConfig  # noqa: E402
from radixserve.core.memory import KVPool, ReqToTokenPool  # noqa: E402
from radixserve.plugins.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.plugins.attention.triton.backend import TritonAttention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CONFIG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 6 * 32,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
)


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_matches_torch_native_over_steps(page_size: int) -> None:
    torch.manual_seed(0)
    heads, kvh, dim = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    size = 20 * page_size - 1 if page_size > 1 else 200
    pools = [KVPool(size, 1, kvh, dim, torch.float32, DEVICE, page_size) for _ in range(2)]
    backends = [TritonAttention(pools[0], CONFIG, DEVICE), TorchNativeAttention(pools[1], CONFIG,
                                                                               DEVICE)]  # fmt: skip
    assert backends[0].page_size == page_size  # read from the KV pool
    alloc = shuffled_allocator(size, page_size)
    pool = ReqToTokenPool(6, 64)
    # Request 4's first 21 positions are a "cached prefix" written before it was scheduled.
    prefix = alloc.alloc(21)
    assert prefix is not None
    pool.write(4, 0, prefix)
    cached = pool.table[4, :21].to(DEVICE)
    pools[0].k[0][cached] = pools[1].k[0][cached] = torch.randn(21, kvh, dim, device=DEVICE)
    pools[0].v[0][cached] = pools[1].v[0][cached] = torch.randn(21, kvh, dim, device=DEVICE)
    steps = [  # (rows, cached, new, num_decode): prefill, then decodes mixed with prefill
        ([1, 3], [0, 0], [18, 5], 0),
        ([1, 3, 4, 0], [18, 5, 21, 0], [1, 1, 12, 33], 2),
        ([1, 3, 4, 0], [19, 6, 33, 33], [1, 1, 1, 1], 4),
    ]
    for rows, cached, new, nd in steps:
        batch = step_batch(pool, alloc, rows, cached, new, nd, DEVICE)
        t = batch.num_tokens
        q = torch.randn(t, heads, dim, device=DEVICE)
        k = torch.randn(t, kvh, dim, device=DEVICE)
        v = torch.randn(t, kvh, dim, device=DEVICE)
        outs = []
        for backend in backends:
            backend.prepare(batch)
            outs.append(backend.forward(q, k, v, 0, batch))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
        assert torch.equal(pools[0].k[0], pools[1].k[0])
        assert torch.equal(pools[0].v[0], pools[1].v[0])


def _greedy(model_dir: Path, plugins: list[str], prompts: list[list[int]], new: int,
            **settings: object) -> list[list[int]]:  # fmt: skip
    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    with Engine(str(model_dir), plugins=plugins, **settings) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=params)
    return [r["output_ids"] for r in results]


@pytest.mark.parametrize("rope", ["model", "store"])
def test_engine_greedy_tokens_equal_torch_native(
    tiny_llama_dir: Path, rope: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rope``: applied by the model, or (as on a GPU by default) by the K/V store."""
    monkeypatch.setenv("RADIXSERVE_ROPE_IN_ATTENTION", "1" if rope == "store" else "0")
    shared = list(range(5, 30))  # a shared prefix: the second round hits the radix cache
    prompts = [shared + [40, 41], shared + [50], [7, 8, 9]]
    settings = dict(max_total_tokens=2048, dtype="float32")
    hardware = "hardware=cuda" if DEVICE == "cuda" else "hardware=cpu"  # cpu: the interpreter
    ours = _greedy(tiny_llama_dir, ["attention=triton", hardware], prompts, 6, **settings)
    ref = _greedy(tiny_llama_dir, ["attention=torch_native", "hardware=cpu"], prompts, 6,
                  **settings)  # fmt: skip
    assert ours == ref


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("disable_cuda_graph", "disable_overlap_schedule", "page_size"),
    [(False, False, 1), (True, False, 1), (False, True, 1), (False, False, 16)],
    ids=["graphs-overlap", "eager-overlap", "graphs-no-overlap", "graphs-overlap-page16"],
)
def test_gpu_greedy_equals_cpu_float32_smollm2_shape(
    tmp_path: Path, disable_cuda_graph: bool, disable_overlap_schedule: bool, page_size: int
) -> None:
    """SmolLM2-shaped random weights, float32: the GPU (triton, graphs, overlap scheduling,
    paged KV) gives the CPU's tokens."""
    from tiny_models import make_tiny_llama_dir

    model_dir = make_tiny_llama_dir(
        tmp_path / "smollm2-shape", hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    prompts = [list(range(3, 40)), list(range(100, 111)), [5] * 70]
    settings = dict(max_total_tokens=4096, dtype="float32")
    gpu = _greedy(model_dir, ["hardware=cuda"], prompts, 32,
                  disable_cuda_graph=disable_cuda_graph,
                  disable_overlap_schedule=disable_overlap_schedule, page_size=page_size,
                  **settings)  # fmt: skip
    cpu = _greedy(model_dir, ["hardware=cpu"], prompts, 32, **settings)
    assert gpu == cpu
