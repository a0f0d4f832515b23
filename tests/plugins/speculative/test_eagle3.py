"""The ``eagle3`` speculative plugin on the tiny random Llama, with random draft heads.

- The plugin drafts exactly what the training tool's training-time-test forward predicts for
  the same features (tools/train_draft.py ``ttt_logits``), first from scratch, then after a
  verify (catch-up of the accepted positions over the draft KV it kept) and after the prefix
  cache re-points a slot (recomputed from the feature pool): what the head learns is what it
  drafts.
- Through the engine: greedy outputs equal speculation off under retraction, a too-small
  paged pool and repeated prompts (prefix reuse), with no KV leak.
- Heads that cannot serve the target are refused at start-up with the reason.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from random_heads import embedding, write_random_eagle3_head
from small_pool_speculation import run_small_pool

from radixserve import Engine
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.plugins import default_host
from radixserve.plugins.hardware.cpu import CpuPlatform
from radixserve.plugins.hardware.cpu_linear import PackedLinear, default_packing
from radixserve.plugins.speculative.eagle3 import Eagle3Draft
from radixserve.plugins.speculative.eagle3_head import new_head, save_head

AUX = [0, 1, 1]  # the tiny Llama has two layers


def _train_draft() -> Any:
    import radixserve.tools.train_draft as train_draft  # a repository tool, not a package module

    return train_draft


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_eagle3_head(tiny_llama_dir, tmp_path_factory.mktemp("eagle3-head"), AUX)


def _drafter(model_dir: Path, head: Path) -> tuple[Eagle3Draft, ReqToTokenPool, torch.Tensor]:
    mc = ModelConfig.from_dir(model_dir)
    emb = embedding(model_dir)
    pool = ReqToTokenPool(4, 128)
    draft = Eagle3Draft()
    draft.setup(
        SimpleNamespace(  # type: ignore[arg-type]
            config=SimpleNamespace(
                speculative_draft_model_path=str(head), enable_torch_compile=False,
                enable_deterministic_inference=False,
                speculative_eagle_topk=1, draft_depth=4,
            ),
            platform=CpuPlatform(),  # the head's linears packed, as in the engine
            host=default_host(), model_config=mc, device="cpu", dtype=torch.float32,
            target_model=SimpleNamespace(embed=lambda ids: emb[ids]), req_to_token=pool,
            kv_size=256, page_size=1, attention="torch_native",
        )
    )  # fmt: skip
    return draft, pool, emb


def _dense_drafts(
    draft: Eagle3Draft, emb: torch.Tensor, tokens: list[int], feats: torch.Tensor, k: int
) -> list[int]:
    """The k tokens the training forward drafts after ``tokens`` (its last is the token being
    verified, at position kv_len = len(tokens) - 1), feeding its own drafts back."""
    ttt_logits = _train_draft().ttt_logits
    kv_len = len(tokens) - 1
    out: list[int] = []
    for s in range(k):
        seq = torch.tensor([tokens + out])
        f = torch.zeros(1, seq.shape[1], feats.shape[-1])
        f[0, :kv_len] = feats[:kv_len]  # only target features below kv_len are read
        with torch.no_grad():
            logits = ttt_logits(draft.head, emb, seq, f, s + 1)[s]
        out.append(int(draft.target_ids[logits[0, kv_len - 1 + s].argmax()]))
    return out


def _feed(draft: Eagle3Draft, slots: torch.Tensor, feats: torch.Tensor) -> None:
    """What the target's forward hands over for tokens written at ``slots``."""
    d = feats.shape[-1] // 3
    hidden = {0: feats[:, :d], 1: feats[:, d : 2 * d]}
    assert torch.equal(feats[:, 2 * d :], feats[:, d : 2 * d])  # layer 1 twice (AUX)
    draft.target_hidden(SimpleNamespace(hidden_states=hidden, out_cache_loc=slots))  # type: ignore[arg-type]


def test_plugin_drafts_what_training_time_test_predicts(tiny_llama_dir: Path, head_dir: Path):
    draft, pool, emb = _drafter(tiny_llama_dir, head_dir)
    if default_packing() is not None:  # the CPU platform packed the head's linears
        assert isinstance(draft.head.lm_head, PackedLinear)
    gen = torch.Generator().manual_seed(0)
    vocab = emb.shape[0]
    tokens = torch.randint(3, vocab, (40,), generator=gen).tolist()
    width = 3 * draft.head.config.target_hidden_size
    d = width // 3
    base = torch.randn(60, 2 * d, generator=gen)
    feats = torch.cat([base, base[:, d:]], dim=-1)  # [f0 | f1 | f1]
    row = pool.alloc()
    assert row is not None
    slots = torch.arange(10, 70)
    pool.write(row, 0, slots)
    k = 3

    # A new request: prompt x0 .. x19, its KV and features at positions 0 .. 18.
    prompt = tokens[:20]
    _feed(draft, slots[:19], feats[:19])
    req = SimpleNamespace(rid="r", input_ids=prompt, output_ids=[], kv_len=19, req_pool_idx=row)
    (first,) = draft.propose([req], [k])
    assert first.pending is not None
    drafted = first.pending.tolist()
    assert drafted == _dense_drafts(draft, emb, prompt, feats, k)

    # Verify accepted d1 and emitted t: positions 19, 20 now have target KV and features.
    req.output_ids = [drafted[0], tokens[30]]
    req.kv_len = 21
    _feed(draft, slots[19:21], feats[19:21])
    (second,) = draft.propose([req], [k])
    assert second.pending is not None
    history = prompt + req.output_ids
    assert second.pending.tolist() == _dense_drafts(draft, emb, history, feats, k)

    # The prefix cache re-points position 5 at another slot holding the same KV and features:
    # the draft KV from there on is recomputed, the drafts stay the same.
    moved = slots.clone()
    moved[5] = 200
    draft.features[200] = draft.features[int(slots[5])]
    pool.write(row, 0, moved[:21])
    kept = draft.kv_pool.k[0].clone()
    (third,) = draft.propose([req], [k])
    assert third.pending is not None
    assert third.pending.tolist() == second.pending.tolist()
    assert not torch.equal(kept[200], draft.kv_pool.k[0][200])  # written by the catch-up


def test_eagle3_under_retraction_and_prefix_reuse_equals_speculation_off(
    tiny_llama_dir: Path, head_dir: Path
) -> None:
    reference, _, _ = run_small_pool(tiny_llama_dir)
    outputs, retractions, stats = run_small_pool(
        tiny_llama_dir,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(head_dir),
        speculative_disable_pause=True,
    )
    assert retractions > 0, "the pool must force retractions"
    assert outputs == reference
    assert stats["algorithm"] == "eagle3" and stats["verified_requests"] > 0


def test_eagle3_trees_equal_speculation_off_greedy_and_seeded(
    tiny_llama_dir: Path, head_dir: Path
) -> None:
    """Draft trees under retraction and prefix reuse (greedy), then seeded sampling: each node
    row is sampled as the output position it stands for (its path's penalties and seed), so
    sampled outputs equal speculation off token for token too."""
    tree = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(head_dir),
        "speculative_disable_pause": True,
        "speculative_eagle_topk": 4,
        "speculative_num_steps": 4,
        "speculative_num_draft_tokens": 9,
    }
    reference, _, _ = run_small_pool(tiny_llama_dir, page_size=1)
    outputs, retractions, stats = run_small_pool(tiny_llama_dir, page_size=1, **tree)
    assert retractions > 0 and outputs == reference
    assert stats["trees"] > 10, stats  # (a random head: acceptance is the core test's)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    params = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_new_tokens": 24,
              "repetition_penalty": 1.2, "ignore_eos": True}  # fmt: skip
    runs = []
    for kw in ({}, {**tree, "speculative_disable_batch_size": 8}):
        with Engine(str(tiny_llama_dir), dtype="float32", debug_leak_check=True, **kw) as eng:
            out = eng.generate(input_ids=prompts, sampling_params=params)
            runs.append([o["output_ids"] for o in out])
            stats = eng.core.spec_stats()
    assert runs[0] == runs[1]
    assert stats is not None and stats["trees"] > 10


def test_heads_that_cannot_serve_the_target_are_refused(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    mc = ModelConfig.from_dir(tiny_llama_dir)
    emb = embedding(tiny_llama_dir)
    deep = tmp_path / "deep"
    save_head(new_head(mc, emb, torch.arange(64), 0, [0, 1, 5]), deep, torch.float32, {})
    cases = [
        ({"speculative_draft_model_path": str(deep)}, "aux layers [0, 1, 5]"),
        ({"speculative_draft_model_path": str(tmp_path / "none")}, "not a directory"),
        ({}, "no head ships for this target"),
    ]
    for kw, reason in cases:
        with pytest.raises(ConfigError, match=reason.replace("[", r"\[").replace("]", r"\]")):
            Engine(str(tiny_llama_dir), speculative_algorithm="EAGLE3", **kw)
