"""The ``dflash`` speculative plugin on the tiny random Llama, with random block drafters.

- The block mask: context keys before each block's start, every key of its own block.
- The plugin drafts exactly what the training tool's block forward predicts
  (tools/train_dflash.py ``block_logits``) for the same features, first for a new request,
  then after a verify that rejected drafts (the context K/V of the accepted positions came
  with the verify forward, the rejected positions' were overwritten), and after the prefix
  cache re-points a slot: what the drafter learns is what it drafts.
- Through the engine: greedy outputs equal speculation off under retraction, a too-small
  paged pool and repeated prompts (prefix reuse), with no KV leak.
- Drafters that cannot serve the target are refused at start-up with the reason.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from small_pool_speculation import run_small_pool

from radixserve import Engine
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.plugins import default_host
from radixserve.core.weights import iter_weights
from radixserve.plugins.hardware.cpu import CpuPlatform
from radixserve.plugins.speculative.dflash import DFlashDraft
from radixserve.plugins.speculative.dflash_graph import DFlashBlockGraphs, context_widths
from radixserve.plugins.speculative.dflash_head import (
    DFlashConfig,
    DFlashHead,
    block_attention_mask,
)
from radixserve.plugins.speculative.head_layer import save_head

LAYERS = [0, 1]  # the tiny Llama has two layers
BLOCK = 4


def _train_dflash() -> Any:
    import radixserve.tools.train_dflash as train_dflash  # a repository tool, not a package

    return train_dflash


def _weights(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    w = dict(iter_weights(model_dir, torch.float32))
    return w["model.embed_tokens.weight"], w["lm_head.weight"]


def _new_head(mc: ModelConfig, layers: list[int], seed: int = 3) -> DFlashHead:
    torch.manual_seed(seed)
    head = DFlashHead(
        DFlashConfig.for_target(mc, layers, BLOCK), mc.max_context, torch.float32, "cpu"
    )
    head.init_weights(std=0.3)  # large: clear argmaxes, drafts that differ by context
    return head


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dflash-head")
    save_head(_new_head(ModelConfig.from_dir(tiny_llama_dir), LAYERS), out, torch.float32, {})
    return out


def test_block_mask_sees_the_context_before_the_block_and_the_whole_block() -> None:
    mask = block_attention_mask(torch.tensor([2, 0, 3]), 3, BLOCK)
    assert mask.shape == (3, BLOCK, 3 + BLOCK)
    for i, n in enumerate([2, 0, 3]):
        for row in range(BLOCK):  # every row of a block sees the same keys: bidirectional
            assert mask[i, row].tolist() == [k < n for k in range(3)] + [True] * BLOCK


def _drafter(
    model_dir: Path, head: Path, padded: bool = False
) -> tuple[DFlashDraft, ReqToTokenPool, Any]:
    """``padded``: proposals run the CUDA graphs' padded forward (``dflash_graph.py``), eagerly,
    and never the plain eager one."""
    mc = ModelConfig.from_dir(model_dir)
    emb, lm = _weights(model_dir)
    pool = ReqToTokenPool(4, 128)
    draft = DFlashDraft()
    target = SimpleNamespace(embed=lambda ids: emb[ids], logits=lambda h: F.linear(h, lm))
    draft.setup(
        SimpleNamespace(  # type: ignore[arg-type]
            config=SimpleNamespace(
                speculative_draft_model_path=str(head), enable_torch_compile=False,
                enable_deterministic_inference=False,
            ),
            platform=CpuPlatform(),  # the head's linears packed, as in the engine
            host=default_host(), model_config=mc, device="cpu", dtype=torch.float32,
            target_model=target, req_to_token=pool, kv_size=256, page_size=1,
        )
    )  # fmt: skip
    if padded:
        draft.graphs = DFlashBlockGraphs(draft, pool, [1, 2, 4], pool.max_context, "cpu", False)
        assert draft.graphs.widths == [64, 128]

        def unpadded(reqs: Any) -> None:
            raise AssertionError("the padded forward should have served this proposal")

        draft._eager_block = unpadded  # type: ignore[method-assign]
    return draft, pool, (emb, lm)


def _dense_drafts(
    draft: DFlashDraft, weights: Any, tokens: list[int], feats: torch.Tensor
) -> list[int]:
    """The B - 1 tokens the training forward drafts after ``tokens`` (its last is the token
    being verified, at position kv_len = len(tokens) - 1), from the features of positions
    below kv_len only."""
    emb, lm = weights
    kv_len = len(tokens) - 1
    f = torch.zeros(len(tokens), feats.shape[-1])
    f[:kv_len] = feats[:kv_len]  # the block must not read features at or past kv_len
    with torch.no_grad():
        logits = _train_dflash().block_logits(
            draft.head, emb, lm, torch.tensor(tokens), f, [kv_len]
        )
    return logits[0].argmax(-1).tolist()


def _feed(
    draft: DFlashDraft, slots: torch.Tensor, positions: torch.Tensor, feats: torch.Tensor
) -> None:
    """What the target's forward hands over for tokens at ``positions`` written at ``slots``."""
    d = feats.shape[-1] // 2
    hidden = {0: feats[:, :d], 1: feats[:, d:]}
    draft.target_hidden(
        SimpleNamespace(hidden_states=hidden, out_cache_loc=slots, positions=positions)
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-padded"])
def test_plugin_drafts_what_the_block_training_forward_predicts(
    tiny_llama_dir: Path, head_dir: Path, padded: bool
) -> None:
    draft, pool, weights = _drafter(tiny_llama_dir, head_dir, padded)
    gen = torch.Generator().manual_seed(0)
    vocab = weights[0].shape[0]
    tokens = torch.randint(3, vocab, (40,), generator=gen).tolist()
    feats = torch.randn(60, 2 * draft.head.config.target_hidden_size, generator=gen)
    row = pool.alloc()
    assert row is not None
    slots = torch.arange(10, 70)
    pool.write(row, 0, slots)

    # A new request: prompt x0 .. x19, its KV and features at positions 0 .. 18.
    prompt = tokens[:20]
    _feed(draft, slots[:19], torch.arange(19), feats[:19])
    req = SimpleNamespace(rid="r", input_ids=prompt, output_ids=[], kv_len=19, req_pool_idx=row)
    (first,) = draft.propose([req], [BLOCK - 1])
    assert first.pending is not None
    drafted = first.pending.tolist()
    assert len(drafted) == BLOCK - 1
    assert drafted == _dense_drafts(draft, weights, prompt, feats)

    # Verify: the target ran x19, d1, d2, d3 at positions 19 .. 22 (features written for all
    # four, garbage at the rejected ones), accepted d1 and emitted t. Positions 19, 20 are
    # committed; 21, 22 are rewritten by the next forwards before anything reads them.
    _feed(draft, slots[19:23], torch.arange(19, 23), torch.randn(4, feats.shape[-1], generator=gen))
    _feed(draft, slots[19:21], torch.arange(19, 21), feats[19:21])
    req.output_ids = [drafted[0], tokens[30]]
    req.kv_len = 21
    (second,) = draft.propose([req], [BLOCK - 1])
    assert second.pending is not None
    history = prompt + req.output_ids
    assert second.pending.tolist() == _dense_drafts(draft, weights, history, feats)
    assert second.pending.tolist() != drafted  # a different context drafts differently

    # A step that allows fewer drafts gets the block's first ones.
    (short,) = draft.propose([req], [1])
    assert short.pending is not None and short.pending.tolist() == second.pending.tolist()[:1]

    # The prefix cache re-points position 5 at slot 200, which a forward of the same prefix
    # filled: the drafts stay the same. Rows re-pointed at slots that hold another context
    # read that context.
    moved = slots.clone()
    moved[5] = 200
    pool.write(row, 0, moved[:21])
    _feed(draft, torch.tensor([200]), torch.tensor([5]), feats[5:6])
    (third,) = draft.propose([req], [BLOCK - 1])
    assert third.pending is not None and third.pending.tolist() == second.pending.tolist()
    other = torch.randn(21, feats.shape[-1], generator=gen)
    _feed(draft, torch.arange(100, 121), torch.arange(21), other)
    pool.write(row, 0, torch.arange(100, 121))
    (fourth,) = draft.propose([req], [BLOCK - 1])
    assert fourth.pending is not None
    assert fourth.pending.tolist() == _dense_drafts(draft, weights, history, other)
    assert fourth.pending.tolist() != second.pending.tolist()


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph-padded"])
def test_batched_proposals_equal_one_request_at_a_time(
    tiny_llama_dir: Path, head_dir: Path, padded: bool
) -> None:
    """Padding the shorter contexts of a batch (and, for the graphs, the batch to 4 requests
    and the contexts to a width of 64) changes nothing."""
    draft, pool, weights = _drafter(tiny_llama_dir, head_dir, padded)
    gen = torch.Generator().manual_seed(1)
    reqs = []
    for i, n in enumerate([3, 17, 9]):
        row = pool.alloc()
        assert row is not None
        slots = torch.arange(1 + 30 * i, 1 + 30 * i + n)
        pool.write(row, 0, slots)
        _feed(
            draft,
            slots[:-1],
            torch.arange(n - 1),
            torch.randn(n - 1, 2 * draft.head.config.target_hidden_size, generator=gen),
        )
        ids = torch.randint(3, weights[0].shape[0], (n,), generator=gen).tolist()
        reqs.append(
            SimpleNamespace(
                rid=str(i), input_ids=ids, output_ids=[], kv_len=n - 1, req_pool_idx=row
            )
        )
    together = [d.pending.tolist() for d in draft.propose(reqs, [BLOCK - 1] * 3)]  # type: ignore[union-attr]
    alone = [draft.propose([r], [BLOCK - 1])[0].pending.tolist() for r in reqs]  # type: ignore[union-attr]
    assert together == alone


def test_dflash_under_retraction_and_prefix_reuse_equals_speculation_off(
    tiny_llama_dir: Path, head_dir: Path
) -> None:
    reference, _, _ = run_small_pool(tiny_llama_dir)
    outputs, retractions, stats = run_small_pool(
        tiny_llama_dir,
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(head_dir),
        speculative_disable_pause=True,
    )
    assert retractions > 0, "the pool must force retractions"
    assert outputs == reference
    assert stats["algorithm"] == "dflash" and stats["verified_requests"] > 0


def test_drafters_that_cannot_serve_the_target_are_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    mc = ModelConfig.from_dir(tiny_llama_dir)
    deep = tmp_path / "deep"
    save_head(_new_head(mc, [0, 5]), deep, torch.float32, {})
    cases = [
        ({"speculative_draft_model_path": str(deep)}, "target layers [0, 5]"),
        ({"speculative_draft_model_path": str(tmp_path / "none")}, "not a directory"),
        ({}, "none ships for this target"),
    ]
    for kw, reason in cases:
        with pytest.raises(ConfigError, match=reason.replace("[", r"\[").replace("]", r"\]")):
            Engine(str(tiny_llama_dir), speculative_algorithm="DFLASH", **kw)


def test_graph_widths_double_from_64_to_the_cap() -> None:
    assert context_widths(128) == [64, 128]
    assert context_widths(300) == [64, 128, 256, 300]
    assert context_widths(8193) == [64, 128, 256, 512, 1024, 2048, 4096]
