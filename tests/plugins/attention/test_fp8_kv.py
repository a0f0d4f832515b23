"""An FP8 KV cache (``--kv-cache-dtype fp8_e4m3``): K / k_scale and V / v_scale stored as e4m3,
clamped to its range, and read back times the scales.

- ``triton`` against ``torch_native`` (the reference) over mixed decode + prefill steps with
  scales other than 1: the same FP8 codes in the pool, the same outputs; both within FP8's
  rounding of attention over the unrounded K/V (e4m3 rounds each value by up to 1/16);
- a value past the format's range is clamped, not stored as NaN;
- engines: greedy tokens of a tiny model with an FP8 cache equal between triton and
  torch_native, and on reuse traffic in a small pool (slow).

On a CPU machine the kernels run under TRITON_INTERPRET=1.
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
from reuse_traffic import comparable, run_reuse_traffic  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.core.config import ModelConfig  # noqa: E402
from radixserve.core.memory import KVPool, ReqToTokenPool  # noqa: E402
from radixserve.plugins.attention.torch_native import TorchNativeAttention  # noqa: E402
from radixserve.plugins.attention.triton.backend import TritonAttention  # noqa: E402
from radixserve.plugins.attention.triton.store_kernel import store_kv  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
HARDWARE = "hardware=cuda" if CUDA else "hardware=cpu"
FP8 = torch.float8_e4m3fn
CONFIG = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4 * 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
)
K_SCALE, V_SCALE = 0.5, 3.0


def _pool(dtype: torch.dtype, size: int, page_size: int) -> KVPool:
    pool = KVPool(size, 1, CONFIG.num_kv_heads, CONFIG.head_dim, dtype, DEVICE, page_size)
    pool.set_scales(0, K_SCALE, V_SCALE)
    return pool


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_reads_an_fp8_cache_as_torch_native_does(page_size: int) -> None:
    torch.manual_seed(0)
    heads, kvh, dim = CONFIG.num_heads, CONFIG.num_kv_heads, CONFIG.head_dim
    size = 12 * page_size - 1 if page_size > 1 else 120
    pools = [_pool(FP8, size, page_size), _pool(FP8, size, page_size)]
    exact_pool = _pool(torch.float32, size, page_size)  # the same steps, K/V unrounded
    backends = [
        TritonAttention(pools[0], CONFIG, DEVICE),
        TorchNativeAttention(pools[1], CONFIG, DEVICE),
        TorchNativeAttention(exact_pool, CONFIG, DEVICE),
    ]
    assert backends[0].reads_other_kv_dtype
    alloc = shuffled_allocator(size, page_size)
    table = ReqToTokenPool(4, 48)
    steps = [  # (rows, cached, new, num_decode)
        ([1, 3], [0, 0], [17, 5], 0),
        ([1, 3, 0], [17, 5, 0], [1, 1, 20], 2),
        ([1, 3, 0], [18, 6, 20], [1, 1, 1], 3),
    ]
    for rows, cached, new, nd in steps:
        batch = step_batch(table, alloc, rows, cached, new, nd, DEVICE)
        t = batch.num_tokens
        q = torch.randn(t, heads, dim, device=DEVICE)
        k = torch.randn(t, kvh, dim, device=DEVICE) * 2
        v = torch.randn(t, kvh, dim, device=DEVICE)
        outs = []
        for backend in backends:
            backend.prepare(batch)
            outs.append(backend.forward(q, k, v, 0, batch))
        assert torch.equal(pools[0].k[0].view(torch.uint8), pools[1].k[0].view(torch.uint8))
        assert torch.equal(pools[0].v[0].view(torch.uint8), pools[1].v[0].view(torch.uint8))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
        # FP8's rounding of K and V (the scales undone): a few percent of the output
        err = (outs[1] - outs[2]).norm() / outs[2].norm()
        assert 1e-3 < err < 0.08


def test_the_store_clamps_to_the_fp8_range() -> None:
    pool = _pool(FP8, 8, 1)
    big = torch.full((2, CONFIG.num_kv_heads, CONFIG.head_dim), 1e4, device=DEVICE)
    slots = torch.tensor([1, 2], device=DEVICE)
    pool.store(0, slots, big, -big)
    assert pool.k[0][1:3].float().eq(448.0).all() and pool.v[0][1:3].float().eq(-448.0).all()
    k_buf = torch.zeros_like(pool.k[0])
    v_buf = torch.zeros_like(pool.v[0])
    store_kv(big, -big, k_buf, v_buf, slots, K_SCALE, V_SCALE)
    assert k_buf[1:3].float().eq(448.0).all() and v_buf[1:3].float().eq(-448.0).all()
    # in range: stored / scale, rounded to e4m3 (the same codes as the pool's own store)
    small = torch.randn(2, CONFIG.num_kv_heads, CONFIG.head_dim, device=DEVICE)
    pool.store(0, slots, small, small)
    store_kv(small, small, k_buf, v_buf, slots, K_SCALE, V_SCALE)
    assert torch.equal(k_buf[1:3].view(torch.uint8), pool.k[0][1:3].view(torch.uint8))
    assert torch.equal(v_buf[1:3].view(torch.uint8), pool.v[0][1:3].view(torch.uint8))
    assert torch.equal(k_buf[1:3].float(), (small / K_SCALE).to(FP8).float())


def _greedy(model_dir: Path, attention: str, prompts: list[list[int]], new: int,
            **settings: object) -> list[list[int]]:  # fmt: skip
    hardware = HARDWARE if attention == "triton" else "hardware=cpu"
    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    with Engine(str(model_dir), plugins=[f"attention={attention}", hardware], **settings) as e:
        results = e.generate(input_ids=prompts, sampling_params=params)
    return [r["output_ids"] for r in results]


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("one-layer-fp8"), num_hidden_layers=1)


def test_engines_with_an_fp8_cache_agree(one_layer_llama: Path) -> None:
    shared = list(range(5, 30))  # the second prompt hits the first's cached prefix
    prompts = [shared + [40, 41], shared + [50], [7, 8, 9]]
    settings = dict(max_total_tokens=1024, dtype="float32", kv_cache_dtype="fp8_e4m3")
    ours = _greedy(one_layer_llama, "triton", prompts, 6, **settings)
    ref = _greedy(one_layer_llama, "torch_native", prompts, 6, **settings)
    assert ours == ref


@pytest.mark.slow
def test_reuse_traffic_with_an_fp8_cache_equals_torch_native(one_layer_llama: Path) -> None:
    """Identical and repeated prompts, n=4, retraction in a small pool (tests/support/
    reuse_traffic.py), page size 16 with overlap scheduling, both backends on an FP8 cache."""
    runs = []
    for attention in ("torch_native", "triton"):
        hardware = HARDWARE if attention == "triton" else "hardware=cpu"
        with Engine(
            str(one_layer_llama), plugins=[f"attention={attention}", hardware],
            dtype="float32", kv_cache_dtype="fp8_e4m3", page_size=16, max_total_tokens=96,
            schedule_conservativeness=0.0, enable_overlap_schedule=True,
        ) as engine:  # fmt: skip
            runs.append(run_reuse_traffic(engine, 1))
    assert runs[1]["retractions"] > 0
    assert comparable(runs[1]) == comparable(runs[0])
