"""core/weights.py on safetensors files written here and a small torch module (no engine):
dtypes as read, parameter counts from the headers, a failed reload put back, weight copies
rebuilt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve.core.weights import (
    count_parameters,
    iter_weights,
    reload_in_place,
    weights_reloaded,
)


def _shards(tmp_path: Path) -> Path:
    save_file(
        {
            "a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "a.weight_scale": torch.tensor([0.5], dtype=torch.float32),
            "a.weight_scale_inv": torch.tensor([2.0], dtype=torch.float32),
        },
        str(tmp_path / "x-1.safetensors"),
    )
    save_file(
        {
            "b.weight": torch.ones(4, 5, 2, dtype=torch.bfloat16),
            "c.e4m3": torch.zeros(3, dtype=torch.float8_e4m3fn),
            "c.e5m2": torch.zeros(2, dtype=torch.float8_e5m2),
            "d.scales": torch.ones(1, dtype=torch.float32),
        },
        str(tmp_path / "x-2.safetensors"),
    )
    return tmp_path


def test_tensors_are_converted_except_fp8_and_scales(tmp_path: Path) -> None:
    got = dict(iter_weights(_shards(tmp_path), torch.float16))
    assert {n: t.dtype for n, t in got.items()} == {
        "a.weight": torch.float16,
        "a.weight_scale": torch.float32,
        "a.weight_scale_inv": torch.float32,
        "b.weight": torch.float16,
        "c.e4m3": torch.float8_e4m3fn,
        "c.e5m2": torch.float8_e5m2,
        "d.scales": torch.float16,  # not a "_scale" suffix
    }
    assert got["a.weight"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["a.weight_scale"].item() == 0.5
    assert got["b.weight"].shape == (4, 5, 2)
    assert [n for n, _ in iter_weights(str(tmp_path), torch.float32)][:3] == [
        "a.weight", "a.weight_scale", "a.weight_scale_inv"
    ]  # fmt: skip


def test_parameters_are_counted_from_the_headers(tmp_path: Path) -> None:
    assert count_parameters(_shards(tmp_path)) == 6 + 1 + 1 + 40 + 3 + 2 + 1
    assert count_parameters(str(tmp_path)) == 54


def test_a_reload_that_fails_puts_the_old_weights_back() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}

    def bad() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7.0)
        raise KeyboardInterrupt  # any exception, not only Exception

    with pytest.raises(KeyboardInterrupt):
        reload_in_place(model, bad)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and id(p) == ids[name]

    def good() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(3.0)

    reload_in_place(model, good)
    assert all(bool((p == 3.0).all()) for p in model.parameters())


class _Copies(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rebuilt = 0

    def weights_reloaded(self) -> None:
        self.rebuilt += 1


def test_modules_keeping_weight_copies_rebuild_them() -> None:
    inner, outer = _Copies(), _Copies()
    outer.add_module("inner", inner)
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), outer)
    weights_reloaded(model)
    assert (outer.rebuilt, inner.rebuilt) == (1, 1)
