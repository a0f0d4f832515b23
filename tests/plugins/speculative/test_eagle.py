"""The ``eagle`` speculative plugin on the tiny random Llama, with random EAGLE heads.

- The plugin keeps the target's last layer's output through the target's final norm (the
  features the training tool captures), and drafts exactly what the training tool's
  training-time-test forward predicts for those features (tools/train_draft.py ``ttt_logits``),
  through the target's LM head over its full vocabulary: from scratch, after a verify
  (catch-up over the draft KV it kept), and after the prefix cache re-points a slot.
- Through the engine: greedy outputs equal speculation off under retraction, a too-small
  paged pool and repeated prompts (prefix reuse), with no KV leak.
- Heads that cannot serve the target, and draft trees, are refused at start-up with the reason.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from small_pool_speculation import run_small_pool

from radixserve import Engine
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.memory import ReqToTokenPool
from radixserve.core.plugins import default_host
from radixserve.core.weights import iter_weights
from radixserve.plugins.hardware.cpu import CpuPlatform
from radixserve.plugins.models.blocks import RMSNorm
from radixserve.plugins.speculative.eagle import EagleDraft
from radixserve.plugins.speculative.eagle3_head import new_head
from radixserve.plugins.speculative.eagle_head import EagleHead, new_eagle_head, tied_lm_head
from radixserve.plugins.speculative.head_layer import save_head


def _ttt_logits() -> Any:
    import radixserve.tools.train_draft as train_draft  # a repository tool, not a package module

    return train_draft.ttt_logits


def _embedding(model_dir: Path) -> torch.Tensor:
    return dict(iter_weights(model_dir, torch.float32))["model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random head whose weights are large enough for clear argmaxes."""
    head = new_eagle_head(ModelConfig.from_dir(tiny_llama_dir), seed=3)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    out = tmp_path_factory.mktemp("eagle-head")
    save_head(head, out, torch.float32, {"note": "random, for tests"})
    return out


def _drafter(
    model_dir: Path, head: Path
) -> tuple[EagleDraft, ReqToTokenPool, torch.Tensor, RMSNorm]:
    mc = ModelConfig.from_dir(model_dir)
    emb = _embedding(model_dir)
    norm = RMSNorm(mc.hidden_size, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, mc.hidden_size))
    pool = ReqToTokenPool(4, 128)
    draft = EagleDraft()
    target = SimpleNamespace(embed=lambda ids: emb[ids], logits=tied_lm_head(emb), norm=norm)
    draft.setup(
        SimpleNamespace(  # type: ignore[arg-type]
            config=SimpleNamespace(
                speculative_draft_model_path=str(head), enable_torch_compile=False,
                enable_deterministic_inference=False,
                speculative_eagle_topk=1, draft_depth=4,
            ),
            platform=CpuPlatform(),  # the head's linears packed, as in the engine
            host=default_host(), model_config=mc, device="cpu", dtype=torch.float32,
            target_model=target, req_to_token=pool, kv_size=256, page_size=1,
            attention="torch_native",
        )
    )  # fmt: skip
    return draft, pool, emb, norm


def _dense_drafts(
    head: EagleHead, emb: torch.Tensor, tokens: list[int], feats: torch.Tensor, k: int
) -> list[int]:
    """The k tokens the training forward drafts after ``tokens`` (its last is the token being
    verified, at position kv_len = len(tokens) - 1), feeding its own drafts back."""
    kv_len = len(tokens) - 1
    out: list[int] = []
    for s in range(k):
        seq = torch.tensor([tokens + out])
        f = torch.zeros(1, seq.shape[1], feats.shape[-1])
        f[0, :kv_len] = feats[:kv_len]  # only target features below kv_len are read
        with torch.no_grad():
            logits = _ttt_logits()(head, emb, seq, f, s + 1)[s]
        out.append(int(logits[0, kv_len - 1 + s].argmax()))
    return out


def _feed(draft: EagleDraft, slots: torch.Tensor, raw: torch.Tensor) -> None:
    """What the target's forward hands over for tokens written at ``slots``: the last layer's
    output before the final norm (layer 0 is there to be ignored)."""
    (last,) = draft.capture_hidden_layers
    hidden = {0: torch.zeros_like(raw), last: raw}
    draft.target_hidden(SimpleNamespace(hidden_states=hidden, out_cache_loc=slots))  # type: ignore[arg-type]


def test_plugin_drafts_what_training_time_test_predicts(tiny_llama_dir: Path, head_dir: Path):
    draft, pool, emb, norm = _drafter(tiny_llama_dir, head_dir)
    assert draft.capture_hidden_layers == (1,)  # the tiny Llama's last layer
    gen = torch.Generator().manual_seed(0)
    vocab, d = emb.shape
    tokens = torch.randint(3, vocab, (40,), generator=gen).tolist()
    raw = 3 * torch.randn(60, d, generator=gen)
    with torch.no_grad():
        feats = norm(raw)  # what training reads: the final-normed last hidden state
    row = pool.alloc()
    assert row is not None
    slots = torch.arange(10, 70)
    pool.write(row, 0, slots)
    k = 3

    # A new request: prompt x0 .. x19, its KV and features at positions 0 .. 18.
    prompt = tokens[:20]
    _feed(draft, slots[:19], raw[:19])
    assert torch.allclose(draft.features[slots[:19]], feats[:19])
    req = SimpleNamespace(rid="r", input_ids=prompt, output_ids=[], kv_len=19, req_pool_idx=row)
    (first,) = draft.propose([req], [k])
    assert first.pending is not None
    drafted = first.pending.tolist()
    assert drafted == _dense_drafts(draft.head, emb, prompt, feats, k)
    assert len(set(drafted)) > 1 or max(drafted) >= 64  # full vocabulary, not a constant

    # Verify accepted d1 and emitted t: positions 19, 20 now have target KV and features.
    req.output_ids = [drafted[0], tokens[30]]
    req.kv_len = 21
    _feed(draft, slots[19:21], raw[19:21])
    (second,) = draft.propose([req], [k])
    assert second.pending is not None
    history = prompt + req.output_ids
    assert second.pending.tolist() == _dense_drafts(draft.head, emb, history, feats, k)

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


def test_eagle_under_retraction_and_prefix_reuse_equals_speculation_off(
    tiny_llama_dir: Path, head_dir: Path
) -> None:
    reference, _, _ = run_small_pool(tiny_llama_dir)
    outputs, retractions, stats = run_small_pool(
        tiny_llama_dir,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=str(head_dir),
        speculative_disable_pause=True,
    )
    assert retractions > 0, "the pool must force retractions"
    assert outputs == reference
    assert stats["algorithm"] == "eagle" and stats["verified_requests"] > 0


def test_eagle_trees_under_retraction_and_prefix_reuse_equal_speculation_off(
    tiny_llama_dir: Path, head_dir: Path
) -> None:
    """Draft trees (topk 3, depth 3, 8 nodes) through the same traffic on single-slot pages:
    every tree verify's nodes run on scratch rows, and the accepted path's slots replace the
    row's, under retraction, with no KV leaked."""
    reference, _, _ = run_small_pool(tiny_llama_dir, page_size=1)
    outputs, retractions, stats = run_small_pool(
        tiny_llama_dir,
        page_size=1,
        speculative_algorithm="EAGLE",
        speculative_draft_model_path=str(head_dir),
        speculative_disable_pause=True,
        speculative_eagle_topk=3,
        speculative_num_steps=3,
        speculative_num_draft_tokens=9,
    )
    assert retractions > 0, "the pool must force retractions"
    assert outputs == reference
    assert stats["trees"] > 20, stats  # (a random head: acceptance is the core test's)


def test_heads_that_cannot_serve_the_target_are_refused(
    tiny_llama_dir: Path, tmp_path: Path, head_dir: Path
) -> None:
    mc = ModelConfig.from_dir(tiny_llama_dir)
    eagle3 = tmp_path / "eagle3"
    save_head(new_head(mc, _embedding(tiny_llama_dir), torch.arange(64)), eagle3, torch.float32, {})
    cases: list[tuple[dict[str, Any], str]] = [
        ({"speculative_draft_model_path": str(eagle3)}, "an EAGLE head is LlamaForCausalLMEagle"),
        ({"speculative_draft_model_path": str(tmp_path / "none")}, "not a directory"),
        ({}, "no head ships for this target"),
        (
            {
                "speculative_draft_model_path": str(head_dir),
                "speculative_eagle_topk": 2,
                "page_size": 4,
            },
            "draft trees.*needs --page-size 1",
        ),
        (
            {"speculative_draft_model_path": str(head_dir), "speculative_eagle_topk": 17},
            "speculative_eagle_topk must be 1 to 16",
        ),
    ]
    for kw, reason in cases:
        with pytest.raises(ConfigError, match=reason):
            Engine(str(tiny_llama_dir), speculative_algorithm="EAGLE", **kw)
