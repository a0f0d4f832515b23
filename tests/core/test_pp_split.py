"""Pipeline parallelism's pure parts: how the layers split into stages, how a step splits into
micro-batches of disjoint requests (rows, tokens, decodes and logits rows each land in their
micro-batch, in the step's order), the settings refused with it, and how a dead stage is
named."""

from __future__ import annotations

import pytest
import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.parallel import SINGLE, Span, TensorParallel, local_model_config
from radixserve.core.parallel import pipeline_stage as stage_of
from radixserve.core.pp_step import split_batch
from radixserve.entrypoints.tp_workers import rank_label


def test_layers_split_into_contiguous_stages_the_larger_last() -> None:
    stages = [stage_of(5, r, 2) for r in range(2)]
    assert [s.layers for s in stages] == [Span(0, 2), Span(2, 3)]
    assert stages[0].first and not stages[0].last and stages[1].last
    four = [stage_of(10, r, 4).layers for r in range(4)]
    assert [s.size for s in four] == [2, 3, 2, 3] and four[-1].stop == 10
    assert all(a.stop == b.start for a, b in zip(four, four[1:], strict=False))
    with pytest.raises(ConfigError, match="at least one decoder layer per stage"):
        stage_of(2, 0, 3)


def test_a_stage_config_counts_only_its_layers() -> None:
    from radixserve.core.config import ModelConfig

    mc = ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=64, num_layers=5, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=100, max_context=64, eos_token_ids=(0,),
        bos_token_id=None, raw={},
    )  # fmt: skip
    group = TensorParallel(stage=stage_of(5, 1, 2))
    assert local_model_config(mc, group).num_layers == 3
    assert local_model_config(mc, SINGLE).num_layers == 5


def _batch(extend: list[int], num_decode: int, logits_rows: list[int]) -> ForwardBatch:
    t = sum(extend)
    return ForwardBatch(
        input_ids=torch.arange(100, 100 + t),
        positions=torch.arange(t),
        out_cache_loc=torch.arange(200, 200 + t),
        req_pool_indices=torch.arange(len(extend)) + 10,
        req_to_token=torch.zeros(1, 1, dtype=torch.int64),
        seq_lens=[n + 5 for n in extend],
        extend_lens=extend,
        num_decode=num_decode,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        kv_pool=None,  # type: ignore[arg-type]
        req_to_token_pool=None,  # type: ignore[arg-type]
    )


def test_a_step_splits_into_micro_batches_of_disjoint_requests() -> None:
    # 3 decodes, then prefill chunks of 4 and 5 tokens (the last one's final token sampled)
    extend = [1, 1, 1, 4, 5]
    batch = _batch(extend, 3, [0, 1, 2, 11])
    parts = split_batch(batch, 2)
    assert len(parts) == 2
    (a, na), (b, nb) = parts
    assert a.extend_lens + b.extend_lens == extend  # every request once, in order
    assert torch.equal(torch.cat([a.input_ids, b.input_ids]), batch.input_ids)
    assert torch.equal(torch.cat([a.out_cache_loc, b.out_cache_loc]), batch.out_cache_loc)
    assert torch.equal(torch.cat([a.req_pool_indices, b.req_pool_indices]), batch.req_pool_indices)
    assert a.seq_lens + b.seq_lens == batch.seq_lens
    assert a.num_decode + b.num_decode == 3
    assert a.num_decode == len([n for n in a.extend_lens if n == 1])
    # as even in tokens as whole requests allow: 1+1+1+4 | 5
    assert (a.num_tokens, b.num_tokens) == (7, 5)
    # each part's logits rows are its own tokens', counted from its first token
    assert (na, nb) == (3, 1) and a.logits_indices.tolist() == [0, 1, 2]
    assert b.logits_indices.tolist() == [4]  # the step's row 11, the 5th token of part b


def test_a_decode_batch_splits_evenly_and_never_into_empty_parts() -> None:
    parts = split_batch(_batch([1] * 7, 7, list(range(7))), 4)
    assert [p.batch_size for p, _ in parts] == [2, 2, 2, 1]
    assert [n for _, n in parts] == [2, 2, 2, 1]
    one = split_batch(_batch([1], 1, [0]), 4)
    assert len(one) == 1 and one[0][0].batch_size == 1
    # logits rows out of token order: the step stays whole rather than be reordered
    whole = split_batch(_batch([1, 1], 2, [1, 0]), 2)
    assert len(whole) == 1 and whole[0][1] == 2


@pytest.mark.parametrize(
    ("settings", "what"),
    [
        ({"speculative_algorithm": "ngram"}, "speculative decoding"),
        ({"disaggregation_mode": "prefill"}, "disaggregation_mode=prefill"),
        ({"quantization": "int8wo"}, "--quantization int8wo"),
        ({"enable_torch_compile": True}, "--enable-torch-compile"),
    ],
)
def test_settings_pipeline_stages_do_not_run_with_are_refused(
    settings: dict[str, object], what: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{what} does not run with pp_size=2 yet$"):
        EngineConfig(pp_size=2, **settings)  # type: ignore[arg-type]
    EngineConfig(pp_size=1, **settings)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pp_size must be >= 1"):
        EngineConfig(pp_size=0)


def test_a_rank_is_named_by_its_stage_and_tensor_parallel_rank() -> None:
    assert rank_label(1, 2, 1) == "tensor-parallel rank 1"
    assert rank_label(3, 4, 2) == "engine rank 3 (pipeline stage 1, tensor-parallel rank 1)"
    assert rank_label(1, 2, 2) == "engine rank 1 (pipeline stage 1, tensor-parallel rank 0)"
