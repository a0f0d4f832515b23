"""An engine's ranks (core/distributed.py) without processes: the model plugin builds this rank's
share for the group it is given (two ranks' models side by side in one process, as no
process-wide group would allow), a factory of one rank's models is called as it always was, and
one that cannot take a group is refused with a line naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.distributed import Ranks
from radixserve.core.memory import KVPool
from radixserve.core.parallel import TensorParallel
from radixserve.plugins.attention.torch_native import TorchNativeAttention
from radixserve.plugins.models.llama import build_llama
from radixserve.plugins.models.parallel_layers import RowParallelLinear


def _config() -> ModelConfig:
    raw = dict(architectures=["LlamaForCausalLM"], hidden_size=32, num_attention_heads=6,
               num_key_value_heads=3, head_dim=4, num_hidden_layers=2, vocab_size=11,
               intermediate_size=7, max_position_embeddings=64)  # fmt: skip
    return ModelConfig.from_dict(raw)


def _build(ranks: Ranks, factory: Any = build_llama) -> Any:
    local = ranks.local_config(_config())
    pool = KVPool(16, local.num_layers, local.num_kv_heads, local.head_dim, torch.float32, "cpu")
    attention = TorchNativeAttention(pool, local, "cpu")
    name = "LlamaForCausalLM"
    return ranks.build_model(name, factory, _config(), attention, torch.float32, "cpu")


def test_each_rank_model_is_built_for_the_group_it_is_given() -> None:
    groups = [TensorParallel(rank, 2) for rank in range(2)]
    models = [_build(Ranks(g)) for g in groups]  # both in this one process
    for model, group, (heads, kv_heads, inter) in zip(
        models, groups, [(2, 1, 3), (4, 2, 4)], strict=True
    ):
        assert model.tp is group
        assert model.embed_tokens.tp is group
        assert model.lm_head.weight.shape[0] == 6  # ceil(11 / 2) vocabulary rows
        for layer in model.layers:
            assert layer.tp is group and (layer.num_heads, layer.num_kv_heads) == (heads, kv_heads)
            assert layer.qkv_proj.weight.shape[0] == (heads + 2 * kv_heads) * 4
            assert isinstance(layer.o_proj, RowParallelLinear) and layer.o_proj.tp is group
            assert layer.o_proj.weight.shape == (32, heads * 4)
            assert layer.down_proj.tp is group and layer.intermediate_size == inter


def test_one_rank_calls_the_factory_as_it_always_was() -> None:
    calls: list[tuple[int, dict[str, Any]]] = []

    def factory(config: ModelConfig, *args: Any, **kw: Any) -> Any:
        calls.append((len(args), kw))
        return build_llama(config, *args, **kw)

    model = _build(Ranks(), factory)
    assert calls == [(3, {})]  # (attention, dtype, device), no group keyword
    assert model.tp.size == 1 and model.layers[0].num_heads == 6


def test_a_factory_that_takes_no_group_is_refused_with_several_ranks() -> None:
    def old_factory(config: ModelConfig, attention: Any, dtype: Any, device: str) -> Any:
        raise AssertionError("must not be called")

    with pytest.raises(ConfigError, match="model plugin 'LlamaForCausalLM' takes no group"):
        _build(Ranks(TensorParallel(0, 2)), old_factory)
    # one rank: the same factory is called as it always was
    with pytest.raises(AssertionError, match="must not be called"):
        _build(Ranks(), old_factory)
