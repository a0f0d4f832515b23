"""Speculative decoding on a CUDA device: Triton attention with CUDA graphs (verify steps
replayed from captured graphs) gives the same greedy tokens as ``torch_native`` without
speculation, on traffic that reuses KV: identical and repeated prompts, n=2, a small paged
pool that forces retraction, stop tokens and logprobs; for the n-gram plugin, the standalone
plugin with the target as its own draft, a random draft, random EAGLE and EAGLE-3 heads and a
random DFlash drafter (whose graphs also keep the target layers the heads read, and whose
proposals replay graphs of their own). Skipped without CUDA.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.core.spec_strategy import speculator_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NUM_PROMPTS = 200


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tiny_models import make_tiny_llama_dir

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    target = make_tiny_llama_dir(tmp_path_factory.mktemp("target"), **shape)
    other = make_tiny_llama_dir(tmp_path_factory.mktemp("random-draft"), seed=7, **shape)
    return target, other


@pytest.fixture(scope="module")
def heads(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random EAGLE and EAGLE-3 heads and a DFlash drafter for the target (what is tested is
    the plumbing: the features the graphs keep, not what the heads draft)."""
    from radixserve.core.config import ModelConfig
    from radixserve.core.weights import iter_weights
    from radixserve.plugins.speculative.dflash_head import DFlashConfig, DFlashHead
    from radixserve.plugins.speculative.eagle3_head import new_head
    from radixserve.plugins.speculative.eagle_head import new_eagle_head
    from radixserve.plugins.speculative.head_layer import save_head

    mc = ModelConfig.from_dir(models[0])
    embed = dict(iter_weights(models[0], torch.float32))["model.embed_tokens.weight"]
    out = {"eagle": tmp_path_factory.mktemp("eagle"), "eagle3": tmp_path_factory.mktemp("eagle3")}
    save_head(new_eagle_head(mc, seed=3), out["eagle"], torch.float32, {})
    eagle3 = new_head(mc, embed, torch.arange(min(256, mc.vocab_size)), seed=3)
    save_head(eagle3, out["eagle3"], torch.float32, {})
    out["dflash"] = tmp_path_factory.mktemp("dflash")
    torch.manual_seed(3)
    # block 5: 4 drafts, the default draft length (the verify graphs take one length)
    dflash = DFlashHead(DFlashConfig.for_target(mc, [0, 2], 5), 4096, torch.float32, "cpu")
    dflash.init_weights(std=0.3)
    save_head(dflash, out["dflash"], torch.float32, {})
    return out


def _traffic(engine: Engine) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 360) for _ in range(40)]
    prompts = []
    for i in range(NUM_PROMPTS // 2):
        tail = [rng.randrange(3, 360) for _ in range(rng.randrange(1, 60))]
        prompts.append((shared if i % 3 == 0 else []) + tail)
    prompts += prompts[: NUM_PROMPTS // 4]  # repeated: full cache hits
    prompts += [prompts[5]] * (NUM_PROMPTS // 4)  # identical, sent together
    params = [
        {"temperature": 0, "max_new_tokens": 24 + i % 17, "ignore_eos": i % 5 != 0,
         "stop_token_ids": [7] if i % 7 == 0 else [], "n": 2 if i % 11 == 0 else 1}
        for i in range(len(prompts))
    ]  # fmt: skip
    out = engine.generate(input_ids=prompts, sampling_params=params)
    lp = engine.generate(
        input_ids=prompts[:16],
        sampling_params={"temperature": 0, "max_new_tokens": 12},
        return_logprob=True,
    )
    return [o["output_ids"] for o in out] + [o["output_ids"] for o in lp]


def _run(target: Path, attention: str, **kw: Any) -> tuple[list[list[int]], Any]:
    kw.setdefault("max_total_tokens", 16384)
    kw.setdefault("speculative_disable_pause", True)  # pausing depends on the machine's speed
    kw.setdefault("speculative_disable_batch_size", 8)  # every step drafts (CUDA's cut-off: 4)
    with Engine(
        str(target), plugins=[f"attention={attention}", "hardware=cuda"], dtype="float32",
        max_running_requests=8, debug_leak_check=True, **kw,
    ) as engine:  # fmt: skip
        outputs = _traffic(engine)
        runner = engine.core.runner.step
        algorithm = getattr(speculator_of(engine.core), "algorithm", None)
        # the heads' proposal graphs, or DFlash's block graphs
        chain = getattr(algorithm, "chain", None) or getattr(algorithm, "graphs", None)
        replays = (getattr(runner, "verify_replays", 0), chain.replays if chain else 0)
        return outputs, (engine.core.spec_stats(), replays)


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path]) -> list[list[int]]:
    return _run(models[0], "torch_native", disable_cuda_graph=True)[0]


CASES = {
    "ngram": lambda t, o: {"speculative_algorithm": "NGRAM"},
    "self-draft": lambda t, o: {"speculative_algorithm": "STANDALONE",
                                "speculative_draft_model_path": str(t)},
    "random-draft": lambda t, o: {"speculative_algorithm": "STANDALONE",
                                  "speculative_draft_model_path": str(o)},
    "self-draft-paged-small-pool": lambda t, o: {
        "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(t),
        "page_size": 16, "max_total_tokens": 1024},
}  # fmt: skip


HEAD_CASES = {
    "eagle3-random-head": ("EAGLE3", "eagle3"),
    "eagle-random-head": ("EAGLE", "eagle"),
    "eagle3-random-head-trees": ("EAGLE3", "eagle3"),
    "dflash-random-drafter": ("DFLASH", "dflash"),
}
#: draft trees: topk 3, depth 3, 6 nodes (trees while at most 4 requests draft, chains above)
TREES = {"speculative_eagle_topk": 3, "speculative_num_steps": 3,
         "speculative_num_draft_tokens": 7}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES) + list(HEAD_CASES))
def test_triton_graphs_speculation_equals_torch_native(
    models: tuple[Path, Path], heads: dict[str, Path], reference: list[list[int]], case: str
) -> None:
    target, other = models
    if case in HEAD_CASES:
        algorithm, head = HEAD_CASES[case]
        flags = {"speculative_algorithm": algorithm,
                 "speculative_draft_model_path": str(heads[head])}  # fmt: skip
        if case.endswith("-trees"):
            flags.update(TREES)
    else:
        flags = CASES[case](target, other)
    outputs, (stats, replays) = _run(target, "triton", **flags)
    differ = [i for i, (a, b) in enumerate(zip(reference, outputs, strict=True)) if a != b]
    assert not differ, f"{len(differ)} of {len(outputs)} differ, first {differ[:5]}"
    assert stats["verified_requests"] > 0
    if case.startswith("self-draft"):
        assert stats["accepted_tokens"] >= 0.9 * stats["draft_tokens"], stats
        verify_replays, chain_replays = replays
        assert verify_replays > 0, "no verify step was replayed from a CUDA graph"
        assert chain_replays > 0, "no draft chain was replayed from a CUDA graph"
    if case == "ngram":  # lookups of every length, padded to one, replay the verify graphs
        assert replays[0] > 0, "no n-gram verify step was replayed from a CUDA graph"
    if case.endswith("-trees"):  # node rows through the decode graphs, eager head trees
        assert stats["trees"] > 0, stats
    elif case in HEAD_CASES:  # the graphs keep the layers the head reads
        assert replays[0] > 0, "no verify step was replayed from a CUDA graph"
        assert replays[1] > 0, "no head proposal was replayed from a CUDA graph"


@pytest.mark.parametrize("case", ["eagle3", "dflash"])
def test_features_written_inside_graphs_equal_eager_writes(
    models: tuple[Path, Path],
    heads: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    """The feature pool (EAGLE-3) or drafter context KV (DFlash) that the decode and verify
    graphs write themselves equals what the eager ``target_hidden`` writes after each replay,
    slot for slot, on the same traffic (same scheduling, so the same slots); and the graphs
    did take the writes over (fewer eager calls)."""
    from radixserve.plugins.speculative.dflash import DFlashDraft
    from radixserve.plugins.speculative.head_draft import HeadDraft

    target = models[0]
    if case == "eagle3":
        flags = {"speculative_algorithm": "EAGLE3",
                 "speculative_draft_model_path": str(heads["eagle3"])}  # fmt: skip
        cls: Any = HeadDraft
    else:
        from radixserve.core.config import ModelConfig
        from radixserve.plugins.speculative.dflash_head import DFlashConfig, DFlashHead
        from radixserve.plugins.speculative.head_layer import save_head

        mc = ModelConfig.from_dir(target)
        torch.manual_seed(3)
        head = DFlashHead(DFlashConfig.for_target(mc, [0, 2], 4), 4096, torch.float32, "cpu")
        head.init_weights(std=0.3)
        save_head(head, tmp_path / "dflash", torch.float32, {})
        flags = {"speculative_algorithm": "DFLASH",
                 "speculative_draft_model_path": str(tmp_path / "dflash")}  # fmt: skip
        cls = DFlashDraft

    def run(capturable: bool) -> tuple[list[torch.Tensor], int]:
        monkeypatch.setattr(cls, "target_hidden_capturable", capturable)
        with Engine(
            str(target), plugins=["attention=triton", "hardware=cuda"], dtype="float32",
            max_running_requests=8, max_total_tokens=16384, speculative_disable_pause=True,
            speculative_disable_batch_size=8, **flags,
        ) as engine:  # fmt: skip
            algorithm = speculator_of(engine.core).algorithm
            eager = {"calls": 0}
            write = algorithm.target_hidden

            def counted(batch: Any) -> None:
                eager["calls"] += 1
                write(batch)

            algorithm.target_hidden = counted
            _traffic(engine)
            torch.cuda.synchronize()
            pools = [algorithm.features] if case == "eagle3" else [*algorithm.k, *algorithm.v]
            return [p[1:].cpu() for p in pools], eager["calls"]

    graphed, graphed_calls = run(True)
    eager, eager_calls = run(False)
    assert graphed_calls < eager_calls, (graphed_calls, eager_calls)
    for got, want in zip(graphed, eager, strict=True):
        assert want.abs().sum() > 0, "no feature was written"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
