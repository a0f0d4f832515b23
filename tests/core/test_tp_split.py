"""How tensor parallelism splits a model (core/parallel.py), checked without processes: every
rank holds exactly the KV heads its query heads read, the ranks' shares cover the model once,
and a checkpoint cut by a tp_plan puts back together into the original tensors."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.parallel import (
    TensorParallel,
    local_model_config,
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
