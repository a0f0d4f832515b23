"""The LoRA Triton kernels (plugins/models/lora_triton.py) against the plain per-row product
and against the torch backend, with rows of several adapters and of the base model (slot 0) in
one block, ranks below the pool's, a fused module's sub-projections in one launch pair, K split
over programs. On a CPU machine they run under TRITON_INTERPRET=1 at small sizes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    # NOTE: must be set before the kernels are defined (triton.jit reads it at decoration).
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from radixserve.core.lora import LORA_MODULES, LoRAAdapter  # noqa: E402
from radixserve.plugins.models import lora_triton  # noqa: E402
from radixserve.plugins.models.lora_layers import LoRALayers  # noqa: E402
from radixserve.plugins.models.lora_triton import add_lora, default_tiles, tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(g: torch.Generator, slots: int, rank: int, k: int, sizes: list[int],
          ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Stacked A [slots, len(sizes) * rank, k] and B [slots, sum(sizes), rank]; slot i's
    adapter has rank ``ranks[i]`` (the pool's tail zeros, as LoRALayers.load leaves it)."""
    a = torch.randn(slots, len(sizes) * rank, k, generator=g) / k**0.5
    b = torch.randn(slots, sum(sizes), rank, generator=g)
    for i, r in enumerate(ranks):
        for j in range(len(sizes)):
            a[i, j * rank + r : (j + 1) * rank] = 0
        b[i, :, r:] = 0
    return a, b


def _reference(y, x, a, b, scale, token_slots, subs) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The existing test's per-row product, in float64, for every sub-projection."""
    want = y.double().clone()
    rank = b.shape[2]
    for t, s in enumerate(token_slots.tolist()):
        if not s:
            continue
        for j, (col, size, out) in enumerate(subs):
            aj = a[s - 1, j * rank : (j + 1) * rank].double()
            bj = b[s - 1, col : col + size].double()
            want[t, out : out + size] += float(scale[s - 1]) * (bj @ (aj @ x[t].double()))
    return want


def _run(y, x, a, b, scale, token_slots, order, subs, split_k=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    got = y.to(DEVICE, copy=True)
    add_lora(got, x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), scale.to(DEVICE),
             token_slots.to(DEVICE, torch.int32), order.to(DEVICE, torch.int32), subs,
             split_k)  # fmt: skip
    return got.cpu()


@pytest.mark.parametrize("offset", [0, 24])
def test_mixed_slots_in_one_block_match_the_product_per_row(offset: int) -> None:
    """Rows of three adapters and of the base model interleaved in one 16-row block, in the
    order they come (not sorted): each slot's masked tile adds to its own rows only."""
    g = torch.Generator().manual_seed(0)
    t, k, n, r = 7, 40, 24, 16
    a, b = _pool(g, 3, r, k, [n], [16, 8, 16])
    x = torch.randn(t, k, generator=g)
    scale = torch.tensor([0.5, 2.0, 1.25])
    token_slots = torch.tensor([0, 1, 2, 0, 3, 1, 2])
    y = torch.randn(t, offset + n + 8, generator=g)
    subs = ((0, n, offset),)
    got = _run(y, x, a, b, scale, token_slots, torch.arange(t), subs)
    want = _reference(y, x, a, b, scale, token_slots, subs)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    base = token_slots == 0
    assert torch.equal(got[base], y[base])  # the base model's rows are not written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_subs_ranks_8_and_64_split_k(dtype: torch.dtype) -> None:
    """q/k/v in one launch pair, placed past other columns of y and with a gap of columns
    between k and v that no sub-projection adds to, adapters of rank 8 and 64 in a
    rank-64 pool, K split over three programs whose partial sums the expand adds."""
    g = torch.Generator().manual_seed(1)
    t, k, r = 19, 96, 64
    sizes = [32, 16, 16]
    a, b = _pool(g, 2, r, k, sizes, [8, 64])
    x = torch.randn(t, k, generator=g)
    scale = torch.tensor([2.0, 0.25])
    token_slots = torch.randint(0, 3, (t,), generator=g)
    order = torch.argsort(token_slots, stable=True)
    y = torch.randn(t, 4 + 32 + 16 + 8 + 16, generator=g)
    subs = ((0, 32, 4), (32, 16, 36), (48, 16, 60))  # v's columns start 8 past k's end
    cast = [v.to(dtype) for v in (y, x, a, b)]
    got = _run(*cast[:2], *cast[2:], scale, token_slots, order, subs, split_k=3)
    want = _reference(*cast, scale, token_slots, subs)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)
    for gap in (slice(0, 4), slice(52, 60)):  # nobody's columns
        assert torch.equal(got[:, gap], cast[0][:, gap])


def test_segments_cross_blocks_mid_block_and_a_ragged_tail() -> None:
    """Prefill-sized: 150 rows (64-row blocks, the last one 22 rows) in four segments whose
    boundaries fall inside blocks, as a batch of four requests lays them out."""
    g = torch.Generator().manual_seed(2)
    t, k, r = 150, 64, 16
    assert tiles(t, k)[0] == 64 and t % 64
    sizes = [24, 40]  # gate/up
    a, b = _pool(g, 3, r, k, sizes, [16, 16, 16])
    x = torch.randn(t, k, generator=g)
    scale = torch.tensor([1.0, 0.5, 3.0])
    token_slots = torch.tensor([2] * 40 + [0] * 30 + [3] * 50 + [1] * 30)
    order = torch.argsort(token_slots, stable=True)
    y = torch.randn(t, 64, generator=g)
    subs = ((0, 24, 0), (24, 40, 24))
    got = _run(y, x, a, b, scale, token_slots, order, subs)
    want = _reference(y, x, a, b, scale, token_slots, subs)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_tiles_come_from_the_gpus_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuned table's tiles at the nearest row count at or above the batch's (else the
    largest), the untuned ones for a GPU it does not name; and the kernels run with them."""
    path = tmp_path / "lora_tiles.json"
    path.write_text(json.dumps({"Some GPU": {"16": [32, 128, 3], "8192": [16, 64, 1]}}))
    monkeypatch.setattr(lora_triton, "CONFIGS", path)
    assert tiles(1, 4096, "Some GPU") == (32, 128, 3)
    assert tiles(16, 4096, "Some GPU") == (32, 128, 3)
    assert tiles(17, 4096, "Some GPU") == (16, 64, 1)
    assert tiles(20000, 4096, "Some GPU") == (16, 64, 1)  # past the largest: the largest
    assert tiles(1, 4096, "Other GPU") == default_tiles(1, 4096)
    assert tiles(1, 4096, None) == default_tiles(1, 4096)
    # the kernels take the table's tiles for their device: split 3 over a K of 200
    monkeypatch.setattr(lora_triton.tuned_tiles, "device_name", lambda device: "Some GPU")
    g = torch.Generator().manual_seed(3)
    t, k, r = 12, 200, 16
    a, b = _pool(g, 2, r, k, [24], [16, 8])
    x = torch.randn(t, k, generator=g)
    scale = torch.tensor([1.0, 2.0])
    token_slots = torch.tensor([1, 0, 2] * 4)
    order = torch.argsort(token_slots, stable=True)
    y = torch.randn(t, 24, generator=g)
    got = _run(y, x, a, b, scale, token_slots, order, ((0, 24, 0),))
    want = _reference(y, x, a, b, scale, token_slots, ((0, 24, 0),))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_the_stored_table_parses() -> None:
    """Every stored entry is (BLOCK_M, BLOCK_N, split_k) the kernels accept."""
    stored = json.loads(lora_triton.CONFIGS.read_text()) if lora_triton.CONFIGS.is_file() else {}
    for entries in stored.values():
        for rows, (block_m, block_n, split_k) in entries.items():
            assert int(rows) > 0 and block_m >= 16 and block_n >= 16 and split_k >= 1
            assert block_m & (block_m - 1) == 0 and block_n & (block_n - 1) == 0


class _Layer(nn.Module):
    def __init__(self, h: int, q: int, kv: int, inter: int) -> None:
        super().__init__()
        self.q_size, self.kv_size, self.inter = q, kv, inter
        self.qkv_proj = nn.Linear(h, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)


class _Decoder(nn.Module):
    """The fused layout of plugins/models/decoder.py, with its ``weight_target`` mapping."""

    def __init__(self, layers: int, h: int, q: int, kv: int, inter: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(h, q, kv, inter) for _ in range(layers))

    def weight_target(self, name: str) -> tuple[str, None, int | None]:
        _, i, block, proj, _ = name.split(".")
        layer = self.layers[int(i)]
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", layer.q_size),
                 "v_proj": ("qkv_proj", layer.q_size + layer.kv_size),
                 "gate_proj": ("gate_up_proj", 0),
                 "up_proj": ("gate_up_proj", layer.inter)}  # fmt: skip
        if proj in fused:
            module, offset = fused[proj]
            return f"layers.{i}.{module}.weight", None, offset
        return f"layers.{i}.{proj}.weight", None, None


def _adapter(model: _Decoder, rank: int, seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    blocks = {p: "mlp" if p in ("gate_proj", "up_proj", "down_proj") else "self_attn"
              for p in LORA_MODULES}  # fmt: skip
    weights = {}
    for i, layer in enumerate(model.layers):
        dims = {"q_proj": (32, layer.q_size), "k_proj": (32, layer.kv_size),
                "v_proj": (32, layer.kv_size), "o_proj": (layer.q_size, 32),
                "gate_proj": (32, layer.inter), "up_proj": (32, layer.inter),
                "down_proj": (layer.inter, 32)}  # fmt: skip
        for proj, (fan_in, fan_out) in dims.items():
            a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=g)
            weights[f"layers.{i}.{blocks[proj]}.{proj}.weight"] = (a, b)
    return LoRAAdapter(f"a{seed}", "", rank, 2.0 / rank, weights, seed)


def _model() -> _Decoder:
    torch.manual_seed(0)
    return _Decoder(1, 32, 32, 16, 48)


def _outputs(
    backend: str, x: dict[str, torch.Tensor], token_slots: torch.Tensor
) -> tuple[dict[str, torch.Tensor], LoRALayers]:
    model = _model().to(DEVICE)  # a model of its own: the hooks stay on it
    layers = LoRALayers(model, tuple(LORA_MODULES), 3, 64, backend, 32)
    for slot, (rank, seed) in enumerate([(8, 1), (64, 2), (16, 3)], start=1):
        layers.load(slot, _adapter(model, rank, seed))
    out = {}
    for step in (token_slots[:5], token_slots):  # a short step, then the whole one
        layers.set_step(step.to(DEVICE))
        with torch.no_grad():
            layer = model.layers[0]
            out = {n: getattr(layer, n)(v[: step.shape[0]].to(DEVICE)).cpu() for n, v in x.items()}
    return out, layers


MIXED = [1, 0, 2, 3, 2, 1, 1, 0, 3, 3, 2, 0, 1, 2, 3, 3, 3, 1, 0, 2, 2]
UNEVEN = [2, 0, 0, 3, 3] + [1] * 90 + [0] * 5 + [3] * 4  # past the 32-row buffers too


@pytest.mark.parametrize(("rows", "padded"), [(MIXED, True), (UNEVEN, False)])
def test_triton_backend_equals_the_torch_backend(rows: list[int], padded: bool) -> None:
    """The hooks on a fused decoder layer: per module, the Triton launch pair (q/k/v and
    gate/up each in one) gives the torch backend's output, for a mixed step of a few rows an
    adapter (the torch backend's padded batched product) and a longer one (its loop)."""
    t = len(rows)
    token_slots = torch.tensor(rows)
    g = torch.Generator().manual_seed(5)
    x = {"qkv_proj": torch.randn(t, 32, generator=g), "o_proj": torch.randn(t, 32, generator=g),
         "gate_up_proj": torch.randn(t, 32, generator=g),
         "down_proj": torch.randn(t, 48, generator=g)}  # fmt: skip
    want, torch_layers = _outputs("torch", x, token_slots)
    assert (torch_layers.padded is not None) == padded
    got, triton_layers = _outputs("triton", x, token_slots)
    base = _model().to(DEVICE).layers[0]  # the same device's product: bit-equal base rows
    lora_rows = token_slots != 0
    for name in x:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            plain = getattr(base, name)(x[name].to(DEVICE)).cpu()
        assert torch.equal(got[name][~lora_rows], plain[~lora_rows])
        assert not torch.allclose(got[name][lora_rows], plain[lora_rows])
    triton_layers.set_step(token_slots[:3].to(DEVICE))  # a shorter step puts rows past it back
    assert triton_layers.filled == 3 and triton_layers.token_slots[3:].eq(0).all()
    assert torch.equal(triton_layers.token_order[3:].long().cpu(), torch.arange(3, 32))


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
