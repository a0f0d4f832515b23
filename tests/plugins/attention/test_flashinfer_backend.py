"""The ``flashinfer`` attention backend.

On the CPU: the paged-KV description it hands FlashInfer (indptr, page indices, last-page
lengths) against a plain-Python expectation, and its availability message. On a CUDA device with
flashinfer installed (``gpu``): one layer over prefill, mixed and decode steps against a float64
reference (bf16 tolerance, GQA groups 1/3/4/8, pages of 1 and 16, cached prefixes that are not a
whole number of pages), decode steps replayed from a CUDA graph, and whole engines against triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from paged_steps import extend_row, shuffled_allocator, step_batch

from radixserve.core.batch import ForwardBatch
from radixserve.core.memory import ReqToTokenPool, TokenAllocator
from radixserve.plugins.attention import flashinfer as plugin
from radixserve.plugins.attention.flashinfer.indices import gather_page_indices, page_layout

HAS_FLASHINFER = plugin.unavailable_reason() is None
needs_flashinfer = pytest.mark.skipif(
    not HAS_FLASHINFER, reason=f"flashinfer unavailable: {plugin.unavailable_reason()}"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_description_matches_the_table(page_size: int) -> None:
    """Sequences grown in pieces that end inside pages (a cached prefix, then a chunk, then
    decodes), described for FlashInfer: every page of every request, in order."""
    torch.manual_seed(page_size)
    alloc = shuffled_allocator(max(300, 40 * page_size + 7), page_size)
    pool = ReqToTokenPool(8, 200)
    rows = [5, 0, 3, 7]
    pieces = {5: [21, 12, 1], 0: [1], 3: [16, 16, 1, 1], 7: [33, 40]}
    for row in rows:
        start = 0
        for n in pieces[row]:
            extend_row(pool, alloc, row, start, n)
            start += n
    seq_lens = [sum(pieces[r]) for r in rows]
    layout = page_layout(seq_lens, page_size)
    table = pool.device_table(DEVICE)
    dev = torch.tensor([rows, layout.pages, layout.indptr[:-1]], device=DEVICE)
    indices = gather_page_indices(table, dev[0], dev[1], dev[2], layout.indptr[-1], page_size)
    assert indices.dtype == torch.int32
    indices = indices.tolist()
    for i, (row, n) in enumerate(zip(rows, seq_lens, strict=True)):
        mine = indices[layout.indptr[i] : layout.indptr[i + 1]]
        slots = pool.table[row, :n].tolist()
        # Each position's slot is (its page) * P + (its offset in the page).
        assert [mine[j // page_size] * page_size + j % page_size for j in range(n)] == slots
        assert 1 <= layout.last_page_len[i] <= page_size
        assert (len(mine) - 1) * page_size + layout.last_page_len[i] == n
    assert layout.indptr[-1] == len(indices)


def test_page_layout_by_hand() -> None:
    assert page_layout([1, 16, 17, 33], 16) == ([0, 1, 2, 4, 7], [1, 16, 1, 1], [1, 1, 2, 3])
    assert page_layout([3, 1], 1) == ([0, 3, 4], [1, 1], [3, 1])


def test_unavailable_without_the_package_or_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    def packages(*present: str):  # noqa: ANN202
        return lambda name, *args: object() if name in present else None

    monkeypatch.setattr(importlib.util, "find_spec", packages("tvm_ffi"))
    assert "pip install flashinfer-python" in str(plugin.unavailable_reason())
    monkeypatch.setattr(importlib.util, "find_spec", packages("flashinfer"))
    assert "apache-tvm-ffi" in str(plugin.unavailable_reason())
    monkeypatch.setattr(importlib.util, "find_spec", packages("flashinfer", "tvm_ffi"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA device" in str(plugin.unavailable_reason())


def test_selecting_it_where_unavailable_names_the_reason() -> None:
    from radixserve.core.plugins import PluginError, default_host

    registry = default_host().registries["attention"]
    assert "flashinfer" in registry.names()
    if HAS_FLASHINFER:
        assert registry.get("flashinfer").name == "flashinfer"
        return
    with pytest.raises(PluginError, match=r"'flashinfer' is unavailable \(.*flashinfer.*\)"):
        registry.get("flashinfer")


# -- one layer over steps: FlashInfer itself on a CUDA device, the stand-in on the CPU -----------

HEAD_DIM = 128
BACKEND = "radixserve.plugins.attention.flashinfer.backend"


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """The backend class, importing tests/support/fake_flashinfer.py as ``flashinfer``."""
    import fake_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    sys.modules.pop(BACKEND, None)
    yield importlib.import_module(BACKEND).FlashInferAttention
    sys.modules.pop(BACKEND, None)  # the next import binds the real package again


@pytest.fixture
def real() -> type:
    return importlib.import_module(BACKEND).FlashInferAttention


def _config(group: int, kv_heads: int = 2, head_dim: int = HEAD_DIM):  # noqa: ANN202
    from radixserve.core.config import ModelConfig

    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": group * kv_heads * head_dim,
            "num_attention_heads": group * kv_heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": 1,
            "vocab_size": 10,
        }
    )


def _batch(pool: ReqToTokenPool, alloc: TokenAllocator, rows: list[int], cached: list[int],
           new: list[int], nd: int, kv_pool: object) -> ForwardBatch:  # fmt: skip
    return step_batch(pool, alloc, rows, cached, new, nd, DEVICE, kv_pool)


def _reference(q, kv_pool, pool: ReqToTokenPool, batch: ForwardBatch) -> torch.Tensor:  # noqa: ANN001
    """Causal attention of each new token over its request's whole sequence, float64."""
    outs, start = [], 0
    for b in range(batch.batch_size):
        n, total = batch.extend_lens[b], batch.seq_lens[b]
        row = int(batch.req_pool_indices[b])
        slots = pool.table[row, :total].to(DEVICE)
        k = kv_pool.k[0][slots].double()
        v = kv_pool.v[0][slots].double()
        qq = q[start : start + n].double()
        group = qq.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, 1).transpose(0, 1)
        v = v.repeat_interleave(group, 1).transpose(0, 1)
        s = qq.transpose(0, 1) @ k.transpose(1, 2) * HEAD_DIM**-0.5
        pos = torch.arange(total - n, total, device=DEVICE)
        s = s.masked_fill(torch.arange(total, device=DEVICE)[None, :] > pos[:, None], float("-inf"))
        outs.append((s.softmax(-1) @ v).transpose(0, 1).flatten(1))
        start += n
    return torch.cat(outs)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _setup(backend_cls: type, group: int, page_size: int):  # noqa: ANN202
    from radixserve.core.memory import KVPool

    torch.manual_seed(group * 100 + page_size)
    config = _config(group)
    size = 400 * page_size - 1 if page_size > 1 else 6000
    kv_pool = KVPool(size, 1, config.num_kv_heads, HEAD_DIM, torch.bfloat16, DEVICE, page_size)
    backend = backend_cls(kv_pool, config, DEVICE)
    return config, kv_pool, backend, shuffled_allocator(size, page_size), ReqToTokenPool(12, 3000)


def _qkv(config, t: int):  # noqa: ANN001, ANN202
    """q, k, v as the models pass them: strided views of one projection's output."""
    h, kvh = config.num_heads, config.num_kv_heads
    qkv = torch.randn(t, (h + 2 * kvh) * HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    q = qkv[:, : h * HEAD_DIM].view(t, h, HEAD_DIM)
    k = qkv[:, h * HEAD_DIM : (h + kvh) * HEAD_DIM].view(t, kvh, HEAD_DIM)
    v = qkv[:, (h + kvh) * HEAD_DIM :].view(t, kvh, HEAD_DIM)
    return q, k, v


def _check_steps(backend_cls: type, group: int, page_size: int) -> None:
    """Prefill chunks over cached prefixes that end inside pages, then mixed steps, then
    decode-only steps, with odd lengths around page boundaries."""
    config, kv_pool, backend, alloc, pool = _setup(backend_cls, group, page_size)
    assert backend.page_size == page_size
    # Rows 4 and 9 start with cached prefixes of 21 and 1000 positions written earlier.
    for row, n in ((4, 21), (9, 1000)):
        slots = torch.tensor(extend_row(pool, alloc, row, 0, n), device=DEVICE)
        kv_pool.k[0][slots] = torch.randn(n, 2, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        kv_pool.v[0][slots] = torch.randn(n, 2, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    steps = [  # (rows, cached, new, num_decode)
        ([1, 3, 9], [0, 0, 1000], [18, 517, 33]),
        ([1, 3, 4, 0, 9], [18, 517, 21, 0, 1033], [1, 1, 12, 1500, 1]),
        ([1, 3, 4, 0, 9], [19, 518, 33, 1500, 1034], [1, 1, 1, 1, 1]),
        ([1, 3, 4, 0, 9], [20, 519, 34, 1501, 1035], [1, 1, 1, 1, 1]),
    ]
    for rows, cached, new in steps:
        nd = next((i for i, n in enumerate(new) if n != 1), len(new))
        batch = _batch(pool, alloc, rows, cached, new, nd, kv_pool)
        q, k, v = _qkv(config, batch.num_tokens)
        backend.prepare(batch)
        out = backend.forward(q, k, v, 0, batch)
        ref = _reference(q, kv_pool, pool, batch)
        assert not out.isnan().any()
        err = _rel_err(out, ref)
        assert err < 1e-2, f"step {rows} {new}: rel err {err:.2e}"
        assert torch.equal(kv_pool.k[0][batch.out_cache_loc], k)  # stored first


@pytest.mark.parametrize("page_size", [1, 16])
def test_layer_over_steps_with_the_stand_in(stand_in: type, page_size: int) -> None:
    _check_steps(stand_in, 4, page_size)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_layer_matches_reference_over_steps(real: type, group: int, page_size: int) -> None:
    _check_steps(real, group, page_size)


def test_dtypes_and_head_sizes_it_cannot_run_stop_at_construction(stand_in: type) -> None:
    from radixserve.core.config import ConfigError
    from radixserve.core.memory import KVPool

    config = _config(4)
    fp32 = KVPool(64, 1, config.num_kv_heads, HEAD_DIM, torch.float32, DEVICE)
    with pytest.raises(ConfigError, match="float16 or bfloat16 KV, not torch.float32"):
        stand_in(fp32, config, DEVICE)
    small = _config(4, head_dim=32)
    pool = KVPool(64, 1, small.num_kv_heads, 32, torch.bfloat16, DEVICE)
    with pytest.raises(ConfigError, match="head_dim 64, 128, 256, not 32"):
        stand_in(pool, small, DEVICE)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_plans_with_the_stand_in(stand_in: type, page_size: int) -> None:
    """The graph path without a graph: the wrapper ``plan_decode_graph`` planned for a padded
    size serves ``forward`` after ``prepare_decode_graph``; each size has its own wrapper."""
    config, kv_pool, backend, alloc, pool = _setup(stand_in, 4, page_size)
    with pytest.raises(RuntimeError, match="bind_table"):
        backend.plan_decode_graph(4, [0] * 4, [1] * 4)
    backend.bind_table(pool)
    pad = pool.pad_row
    with pytest.raises(RuntimeError, match="plan_decode_graph"):
        backend.prepare_decode_graph(torch.zeros(4), torch.zeros(4))
    rows, lens = [3, 8, 1], [0, 0, 0]
    for grow in ([40, 1, 17], [1, 1, 1], [15, 16, 1]):
        batch = _batch(pool, alloc, rows, lens, grow, 0, kv_pool)
        backend.prepare(batch)
        backend.forward(*_qkv(config, batch.num_tokens), 0, batch)
        dec = _batch(pool, alloc, rows, batch.seq_lens, [1, 1, 1], 3, kv_pool)
        lens = dec.seq_lens
        q, k, v = _qkv(config, 4)  # padded to 4: the padding row writes slot 0
        pad_slot = torch.zeros(1, dtype=torch.int64, device=dec.out_cache_loc.device)
        loc = torch.cat([dec.out_cache_loc, pad_slot])
        dec_padded = ForwardBatch(**{**{f: getattr(dec, f) for f in dec.__slots__},
                                     "out_cache_loc": loc})  # fmt: skip
        pool.sync()  # as the model runner does before every step
        backend.plan_decode_graph(4, rows + [pad], lens + [1])
        backend.prepare_decode_graph(torch.zeros(4, device=DEVICE), torch.zeros(4, device=DEVICE))
        out = backend.forward(q, k, v, 0, dec_padded)
        assert _rel_err(out[:3], _reference(q[:3], kv_pool, pool, dec)) < 1e-2
    backend.plan_decode_graph(2, [pad] * 2, [1] * 2)
    assert set(backend._graph_decode) == {2, 4}
    assert backend._graph_decode[4].plans == 3


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [3, 4])
def test_decode_replayed_from_a_cuda_graph(real: type, group: int, page_size: int) -> None:
    """A decode step captured once (padded to 8 rows), replayed over batches of other lengths
    after ``plan_decode_graph``: the same answer as the reference each time."""
    config, kv_pool, backend, alloc, pool = _setup(real, group, page_size)
    backend.bind_table(pool)
    pad_row, bs = pool.pad_row, 8
    q_buf, k_buf, v_buf = _qkv(config, bs)
    loc = torch.zeros(bs, dtype=torch.int64, device=DEVICE)
    static = ForwardBatch(
        input_ids=loc, positions=loc, out_cache_loc=loc, req_pool_indices=torch.zeros(bs),
        req_to_token=pool.table, seq_lens=[1] * bs, extend_lens=[1] * bs, num_decode=bs,
        logits_indices=loc, kv_pool=kv_pool, req_to_token_pool=pool,
    )  # fmt: skip
    rows_dev = torch.full((bs,), pad_row, dtype=torch.int32, device=DEVICE)

    def run() -> torch.Tensor:
        backend.prepare_decode_graph(rows_dev, rows_dev)
        return backend.forward(q_buf, k_buf, v_buf, 0, static)

    from radixserve.plugins.hardware.cuda_graph import capture_graph

    backend.plan_decode_graph(bs, [pad_row] * bs, [1] * bs)
    graph, out = capture_graph(run, torch.cuda.graph_pool_handle())
    rows = [2, 7, 0, 5, 11]
    lens = [0] * len(rows)
    for grow in ([40, 1, 16, 700, 15], [1, 1, 1, 1, 1], [1, 16, 1, 1, 1]):
        cached = list(lens)
        batch = _batch(pool, alloc, rows, cached, grow, 0, kv_pool)
        lens = batch.seq_lens
        q, k, v = _qkv(config, batch.num_tokens)
        backend.prepare(batch)  # fill the pool: a prefill step, eager
        backend.forward(q, k, v, 0, batch)
        # Now one decode token each, replayed from the graph.
        cached = list(lens)
        dec = _batch(pool, alloc, rows, cached, [1] * len(rows), len(rows), kv_pool)
        lens = dec.seq_lens
        n = len(rows)
        q, k, v = _qkv(config, n)
        q_buf[:n], k_buf[:n], v_buf[:n] = q, k, v
        loc[:n] = dec.out_cache_loc
        loc[n:] = 0
        pool.sync()  # as the model runner does before every step
        backend.plan_decode_graph(bs, rows + [pad_row] * (bs - n), lens + [1] * (bs - n))
        graph.replay()
        err = _rel_err(out[:n], _reference(q, kv_pool, pool, dec))
        assert err < 1e-2, f"lens {lens}: rel err {err:.2e}"


def _greedy(model_dir: Path, plugins: list[str], prompts: list[list[int]], new: int,
            **settings: object) -> list[dict]:  # fmt: skip
    """Each prompt's result: output ids and, per output token, the top two logprobs."""
    from radixserve import Engine

    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    with Engine(str(model_dir), plugins=plugins, **settings) as engine:
        return engine.generate(
            input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2
        )


def _smollm2_shape(out: Path, layers: int) -> Path:
    from tiny_models import make_tiny_llama_dir

    return make_tiny_llama_dir(
        out, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )  # fmt: skip


def _compare(ours: list[dict], ref: list[dict], label: str) -> list[tuple[int, float]]:
    """Print how ``ours`` compares with ``ref`` (greedy outputs); return the first differences
    that were not near-ties of ``ref``'s."""
    from reuse_traffic import NEAR_TIE, first_differences, top2_gaps

    diffs = first_differences([r["output_ids"] for r in ours], [r["output_ids"] for r in ref],
                              top2_gaps(ref))  # fmt: skip
    where = ", ".join(f"({i}, {g:.4f})" for i, g in diffs)
    print(f"{label}: {len(ours) - len(diffs)}/{len(ours)} identical; first differences "
          f"(token, reference's top-2 gap): {where}")  # fmt: skip
    return [(i, gap) for i, gap in diffs if gap >= NEAR_TIE]


@pytest.mark.gpu
@needs_flashinfer
def test_engine_greedy_against_triton_smollm2_shape(tmp_path: Path) -> None:
    """64 prompts x 64 tokens, bf16, SmolLM2's heads with random weights: flashinfer with CUDA
    graphs and without, page sizes 1 and 16, against triton. On two layers every output must
    equal triton's or first leave it at a near-tie of triton's (reuse_traffic.NEAR_TIE); on all
    30 layers the share of identical outputs is only printed: a random model that deep
    amplifies bf16 rounding into whole nats (0/64 identical on the H200, 2026-11-30)."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 360) for _ in range(rng.randrange(5, 300))] for _ in range(64)]
    settings = dict(max_total_tokens=64 * 400, dtype="bfloat16")
    for layers in (2, 30):
        model = _smollm2_shape(tmp_path / f"smollm2-{layers}", layers)
        ref = _greedy(model, ["hardware=cuda", "attention=triton"], prompts, 64, **settings)
        for graphs, page in ((True, 1), (False, 1), (True, 16)) if layers == 2 else ((True, 1),):
            ours = _greedy(model, ["hardware=cuda", "attention=flashinfer"], prompts, 64,
                           disable_cuda_graph=not graphs, page_size=page, **settings)  # fmt: skip
            far = _compare(ours, ref, f"{layers} layers, graphs={graphs}, page={page}")
            if layers == 2:
                assert not far, f"outputs differ from triton's away from near-ties: {far}"


def test_engine_reuse_traffic_with_the_stand_in(stand_in: type, tmp_path: Path) -> None:
    """The backend inside real engines on the CPU, FlashInfer's kernels replaced by the stand-in:
    the reuse traffic (identical and repeated prompts, n=4, retraction in a small pool) at page
    size 16 with overlap scheduling, bf16, against torch_native: every output equal, or leaving
    torch_native's at a near-tie. (Dropping one key per sequence leaves it at gaps of 0.4-6.)"""
    from reuse_traffic import NEAR_TIE, comparable, first_differences, run_reuse_traffic

    from radixserve import Engine, hookimpl
    from radixserve.core.plugins import PluginHost

    class StandIn:
        @hookimpl
        def register_attention_backends(self, register) -> None:  # type: ignore[no-untyped-def]  # noqa: ANN001
            register("flashinfer_stand_in", stand_in, available=None, description="tests")

    model = _smollm2_shape(tmp_path / "smollm2-2", 2)
    runs = {}
    for attention in ("torch_native", "flashinfer_stand_in"):
        with Engine(
            str(model), host=PluginHost(extra_plugins=[("stand_in", StandIn())]),
            plugins=[f"attention={attention}", "hardware=cpu"], dtype="bfloat16", page_size=16,
            schedule_conservativeness=0.0, max_total_tokens=96, enable_overlap_schedule=True,
        ) as engine:  # fmt: skip
            runs[attention] = run_reuse_traffic(engine, gaps=attention == "torch_native")
    ref, ours = runs["torch_native"], runs["flashinfer_stand_in"]
    assert ours["retractions"] > 0
    for name, outputs in comparable(ours).items():
        diffs = first_differences(outputs, ref[name], ref["gaps"][name])
        assert all(gap < NEAR_TIE for _, gap in diffs), (name, diffs)
