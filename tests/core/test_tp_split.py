"""How tensor parallelism splits a model (core/parallel.py), checked without processes: every
rank holds exactly the KV heads its query heads read, the ranks' shares cover the model once,
and a checkpoint cut by a tp_plan puts back together into the original tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.parallel import (
    SHARD_KINDS,
    TensorParallel,
    local_model_config,
    pipeline_stage,
    shard_weights,
    split_heads,
    split_range,
    vocab_shard,
)
from radixserve.plugins.models.parallel_layers import DECODER_TP_PLAN


def _ranks(size: int) -> list[TensorParallel]:
    return [TensorParallel(rank, size) for rank in range(size)]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"),
    [(9, 3, 2), (6, 3, 2), (32, 8, 2), (32, 8, 4), (8, 1, 2), (8, 2, 4), (16, 2, 8), (4, 4, 3)],
)
def test_each_rank_holds_the_kv_heads_its_query_heads_read(
    heads: int, kv_heads: int, size: int
) -> None:
    group = heads // kv_heads
    seen: list[int] = []
    for tp in _ranks(size):
        split = split_heads(heads, kv_heads, tp)
        q = range(split.q.start, split.q.stop)
        needed = {h // group for h in q}
        assert needed == set(range(split.kv.start, split.kv.stop))
        # the model's group size on every rank: attention backends need no change
        assert split.num_heads == split.num_kv_heads * group or split.num_kv_heads == 1
        seen += q
    assert seen == list(range(heads))  # every query head on exactly one rank


def test_three_kv_heads_on_two_ranks_split_one_and_two() -> None:
    # the smaller share goes to rank 0, which also schedules and samples
    a, b = (split_heads(9, 3, tp) for tp in _ranks(2))
    assert (a.q, a.kv, b.q, b.kv) == ((0, 3), (0, 1), (3, 6), (1, 2))


def test_a_layout_no_rule_covers_is_refused_with_a_way_out() -> None:
    with pytest.raises(ConfigError, match="above the KV heads must be a multiple of them .2.; a"):
        split_heads(6, 2, TensorParallel(0, 3))
    with pytest.raises(ConfigError, match="6 query heads do not divide among 4 ranks"):
        split_heads(6, 1, TensorParallel(0, 4))


def test_even_splits_and_padded_vocabulary_shards() -> None:
    assert [split_range(161, tp) for tp in _ranks(2)] == [(0, 80), (80, 81)]
    shards = [vocab_shard(49153, tp) for tp in _ranks(2)]
    assert shards == [((0, 24577), 24577), ((24577, 24576), 24577)]


def _config(**over: int) -> ModelConfig:
    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=32, num_attention_heads=6,
               num_key_value_heads=3, head_dim=4, num_hidden_layers=1, vocab_size=11,
               intermediate_size=7)  # fmt: skip
    return ModelConfig.from_dict({**raw, **over})


def test_the_kv_pool_and_attention_see_this_ranks_heads() -> None:
    local = [local_model_config(_config(), tp) for tp in _ranks(2)]
    assert [(c.num_heads, c.num_kv_heads) for c in local] == [(2, 1), (4, 2)]
    assert local_model_config(_config(), TensorParallel()) == _config()


def test_sharded_checkpoint_tensors_put_back_together() -> None:
    config = _config()
    hd, inter, hidden = config.head_dim, 7, config.hidden_size
    full = {
        "model.embed_tokens.weight": torch.randn(11, hidden),
        "lm_head.weight": torch.randn(11, hidden),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(6 * hd, hidden),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(6 * hd),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(3 * hd, hidden),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(3 * hd, hidden),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, 6 * hd),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(hidden),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(inter, hidden),
        "model.layers.0.mlp.up_proj.weight": torch.randn(inter, hidden),
        "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, inter),
        "model.layers.0.input_layernorm.weight": torch.randn(hidden),
    }
    parts = [dict(shard_weights(full.items(), DECODER_TP_PLAN, config, tp)) for tp in _ranks(2)]
    a, b = parts
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "v_proj.weight"):
        key = f"model.layers.0.self_attn.{name}"
        assert torch.equal(torch.cat([a[key], b[key]]), full[key]), key
    # rank 0 has query heads 0-1 over KV head 0; rank 1 query heads 2-5 over KV heads 1-2
    assert a["model.layers.0.self_attn.k_proj.weight"].shape[0] == hd
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([a[o], b[o]], dim=1), full[o])
    for key in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert torch.equal(torch.cat([a[key], b[key]]), full[key])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(torch.cat([a[down], b[down]], dim=1), full[down])
    for key in ("model.embed_tokens.weight", "lm_head.weight"):  # 6 rows each, one padding row
        assert a[key].shape[0] == b[key].shape[0] == 6
        assert torch.equal(torch.cat([a[key], b[key][:5]]), full[key])
        assert not b[key][5].any()
    for key in ("model.layers.0.self_attn.o_proj.bias", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(a[key], full[key]) and torch.equal(b[key], full[key])  # replicated


def test_an_unknown_shard_kind_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="tp_plan kind 'diagonal' is unknown; choose one of"):
        list(shard_weights([], {"x.*": "diagonal"}, _config(), TensorParallel(0, 2)))


def test_each_rank_holds_its_own_share_of_a_checkpoint_tensor() -> None:
    # 6 query heads over 3 KV heads on 2 ranks: 2 and 4 query heads, not an even 3 and 3
    config, hd = _config(), 4
    plan = {"q": "q_heads", "o": "q_heads_in", "k": "kv_heads", "gate": "column", "down": "row"}
    full = {"q": torch.randn(6 * hd, 5), "o": torch.randn(5, 6 * hd), "k": torch.randn(3 * hd, 5),
            "gate": torch.randn(7, 32), "down": torch.randn(32, 7)}  # fmt: skip
    a, b = (dict(shard_weights(full.items(), plan, config, tp)) for tp in _ranks(2))
    assert torch.equal(a["q"], full["q"][: 2 * hd]) and torch.equal(b["q"], full["q"][2 * hd :])
    assert torch.equal(a["o"], full["o"][:, : 2 * hd]) and torch.equal(
        b["o"], full["o"][:, 2 * hd :]
    )
    assert torch.equal(a["k"], full["k"][:hd]) and torch.equal(b["k"], full["k"][hd:])
    assert torch.equal(a["gate"], full["gate"][:3]) and torch.equal(b["gate"], full["gate"][3:])
    assert torch.equal(a["down"], full["down"][:, :3]) and b["down"].shape == (32, 4)
    assert all(t.is_contiguous() for t in (*a.values(), *b.values()))
    with pytest.raises(ConfigError) as err:
        list(shard_weights([], {"x": "diagonal", "y": "wedge"}, config, TensorParallel(0, 2)))
    assert str(err.value) == (
        f"tp_plan kind 'diagonal' is unknown; choose one of {', '.join(SHARD_KINDS)}"
    )
    one = [("q", full["q"])]
    assert list(shard_weights(one, plan, config, TensorParallel())) == one  # one rank: whole


def test_single_rank_and_boundary_splits() -> None:
    assert split_heads(6, 3, TensorParallel()) == ((0, 6), (0, 3))
    # as many KV heads as ranks: one each, with their query heads
    assert [split_heads(8, 2, tp) for tp in _ranks(2)] == [((0, 4), (0, 1)), ((4, 4), (1, 1))]
    assert pipeline_stage(3, 2, 3).layers == (2, 1)  # one layer per stage still works
    with pytest.raises(ConfigError) as err:
        pipeline_stage(2, 0, 3)
    assert str(err.value) == (
        "pp_size=3 needs at least one decoder layer per stage; the model has 2: a pp_size of at "
        "most 2 works"
    )
    default = TensorParallel()
    assert (default.rank, default.size, default.leader, default.stage) == (0, 1, True, None)
    assert not TensorParallel(1, 2).leader


class Collectives:
    """torch.distributed's collectives as two ranks would answer them: the other rank holds
    ``other`` (a tensor) or ``other_value``; every call logged with its group."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, Any]] = []
        dist = torch.distributed
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
        for name in ("all_reduce", "all_gather_into_tensor", "all_to_all_single"):
            monkeypatch.setattr(dist, name, getattr(self, name))

    def all_reduce(self, t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        self.calls.append(("all_reduce", (op, group)))
        if op == torch.distributed.ReduceOp.MIN:
            t.copy_(torch.minimum(t, torch.tensor([5])))
        else:
            t.add_(t)  # both ranks hold the same here

    def all_gather_into_tensor(self, out: torch.Tensor, x: torch.Tensor, group: Any = None) -> None:
        self.calls.append(("all_gather", group))
        out.copy_(torch.cat([x, x + 100]))  # rank 1's columns are rank 0's + 100

    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor, receive: list[int],
                          send: list[int], group: Any = None) -> None:  # fmt: skip
        self.calls.append(("all_to_all", (receive, send, group)))
        out.copy_(x.flip(0)[: out.shape[0]])


def test_collectives_on_two_ranks_and_none_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Collectives(monkeypatch)
    tp = TensorParallel(0, 2, group="device", cpu_group="gloo")
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(tp.gather_columns(x), torch.cat([x, x + 100], dim=1))
    assert tp.agree_min(9) == 5 and tp.agree_min(3) == 3
    assert torch.equal(tp.all_reduce(torch.ones(2)), torch.full((2,), 2.0))
    rows = torch.arange(8.0).view(4, 2)
    moved = tp.all_to_all(rows, send=[1, 3], receive=[2, 1])
    assert moved.shape == (3, 2) and torch.equal(moved, rows.flip(0)[:3])
    min_op = torch.distributed.ReduceOp.MIN
    assert net.calls == [("all_gather", "device"), ("all_reduce", (min_op, "gloo")),
                         ("all_reduce", (min_op, "gloo")), ("all_reduce", (None, "device")),
                         ("all_to_all", ([2, 1], [1, 3], "device"))]  # fmt: skip
    # where torch has all_gather_single, that one
    single: list[Any] = []
    monkeypatch.setattr(torch.distributed, "all_gather_single",
                        lambda out, x, group=None: single.append(group) or out.copy_(
                            torch.cat([x, -x])), raising=False)  # fmt: skip
    assert torch.equal(tp.gather_columns(x), torch.cat([x, -x], dim=1)) and single == ["device"]
    net.calls.clear()
    one = TensorParallel()
    assert one.gather_columns(x) is x and one.agree_min(9) == 9
    assert torch.equal(one.all_reduce(torch.ones(2)), torch.ones(2))
    assert net.calls == []


class FusedFast:
    """A platform's fast all-reduce with the fused add + RMS norm."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, x: torch.Tensor) -> bool:
        return True

    def close(self) -> None:
        pass

    def add_rms_norm(self, *args: Any) -> tuple[str, str]:
        self.calls.append(args)
        return "normed", "residual"


def test_the_fused_all_reduce_and_norm_only_with_several_ranks() -> None:
    fast = FusedFast()
    x, r, w = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    assert TensorParallel(0, 2, fast_all_reduce=fast).all_reduce_add_rms_norm(x, r, w, 1e-6, 1) == (
        "normed", "residual")  # fmt: skip
    assert fast.calls == [(x, r, w, 1e-6, 1)]
    assert (
        TensorParallel(0, 1, fast_all_reduce=fast).all_reduce_add_rms_norm(x, r, w, 1e-6, 0) is None
    )
    assert TensorParallel(0, 2).all_reduce_add_rms_norm(x, r, w, 1e-6, 0) is None
    assert len(fast.calls) == 1
