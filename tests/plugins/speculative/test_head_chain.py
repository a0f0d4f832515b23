"""The EAGLE / EAGLE-3 proposal graph (plugins/speculative/head_chain.py), checked on the CPU:
CUDA graphs cannot be captured here, so each "graph" replays the captured function eagerly,
with the Triton attention kernels under TRITON_INTERPRET. What is checked is what the graph
computes from its staged inputs (the fixed-length catch-up, the draft steps' positions, slots
and sequence lengths).

Every proposal the graph serves is also drafted by the eager steps from the same draft KV
record, and the tokens must be the same, over catch-ups of every length a verify leaves (the
random heads' attention is sharpened so that a wrong position or slot shows in the drafts).
Greedy outputs must equal speculation off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

# These tests run the graphs' functions eagerly on CPU tensors; on a CUDA device
# tests/plugins/hardware/test_cuda_speculative.py captures and replays the heads' real graphs.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU emulation of the graphs")

from radixserve import Engine  # noqa: E402
from radixserve.core.spec_strategy import speculator_of  # noqa: E402
from radixserve.plugins.speculative import head_chain, head_draft  # noqa: E402
from radixserve.plugins.speculative.head_chain import HeadChainGraphs  # noqa: E402

K = 3
GREEDY_TOKENS = 10  # test_graph_keeps_greedy_outputs' tokens a request


class _EagerGraph:
    def __init__(self, chain: HeadChainGraphs, bs: int) -> None:
        self.chain, self.bs = chain, bs

    def replay(self) -> None:
        self.chain._chain(self.bs)


def eager_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Build the head's graphs on the CPU, each replayed eagerly."""
    monkeypatch.setattr(HeadChainGraphs, "_capture", lambda self, bs, pool: _EagerGraph(self, bs))
    monkeypatch.setattr(head_chain.torch.cuda, "graph_pool_handle", lambda: None)

    def build(drafter: Any, context: Any) -> HeadChainGraphs:
        return HeadChainGraphs(drafter, context.req_to_token, K, [1, 2, 4], context.device)

    monkeypatch.setattr(head_draft, "_chain_graphs", build)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("head-chain"), num_hidden_layers=2)


@pytest.fixture(scope="module")
def heads(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from radixserve.core.config import ModelConfig
    from radixserve.core.weights import iter_weights
    from radixserve.plugins.speculative.eagle3_head import new_head
    from radixserve.plugins.speculative.eagle_head import new_eagle_head
    from radixserve.plugins.speculative.head_layer import save_head

    mc = ModelConfig.from_dir(target)
    embed = dict(iter_weights(target, torch.float32))["model.embed_tokens.weight"]
    out = {"EAGLE": tmp_path_factory.mktemp("eagle"), "EAGLE3": tmp_path_factory.mktemp("eagle3")}
    eagle = new_eagle_head(mc, seed=3)
    eagle3 = new_head(
        mc, embed, torch.arange(min(256, mc.vocab_size)), seed=3, aux_layers=[0, 1, 1]
    )
    for head, name in ((eagle, "EAGLE"), (eagle3, "EAGLE3")):
        with torch.no_grad():  # sharp attention: a wrong position or slot changes the drafts
            head.layer.self_attn.q_proj.weight.mul_(30)
            head.layer.self_attn.k_proj.weight.mul_(30)
        save_head(head, out[name], torch.float32, {})
    return out


def _generate(
    model: Path, attention: str = "triton", max_new_tokens: int = 16, **kw: Any
) -> tuple[list[list[int]], Any, Any]:
    prompts = [[5 + i, 40 + 3 * i, 77, 9 + i] * (i + 1) for i in range(4)]
    prompts.append(prompts[1][:6])  # shares a prefix with a running request
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    with Engine(
        str(model), plugins=[f"attention={attention}", "hardware=cpu"], dtype="float32",
        max_running_requests=4, debug_leak_check=True, **kw,
    ) as engine:  # fmt: skip
        out = engine.generate(input_ids=prompts, sampling_params=params)
        algorithm = getattr(speculator_of(engine.core), "algorithm", None)
        chain = getattr(algorithm, "chain", None)
        return [o["output_ids"] for o in out], engine.core.spec_stats(), chain


def _flags(heads: dict[str, Path], algorithm: str, **extra: Any) -> dict[str, Any]:
    return {"speculative_algorithm": algorithm,
            "speculative_draft_model_path": str(heads[algorithm]),
            "speculative_num_steps": K, "speculative_disable_pause": True,
            "speculative_disable_batch_size": 64, **extra}  # fmt: skip


def compare_with_eager_steps(monkeypatch: pytest.MonkeyPatch, forget_every: int = 0) -> list[bool]:
    """Every proposal the graph serves is first drafted by the eager steps from the same draft
    KV record; returns, per such proposal, whether the two drafted the same tokens. With
    ``forget_every`` n, every n-th proposal starts with no draft KV trusted and the draft KV
    pool scrambled (as positions never written after a pause or a retraction): the graph's
    proposal, run first, must catch up eagerly over the lag; the eager steps, run after it,
    recompute every position."""
    original = head_draft.HeadDraft.propose
    same: list[bool] = []
    proposals = [0]

    def propose(self: Any, reqs: Any, max_drafts: Any) -> Any:
        chain = self.chain
        if chain is None or not chain.fits(reqs, max_drafts):
            return original(self, reqs, max_drafts)
        proposals[0] += 1
        replays = chain.replays
        if forget_every and proposals[0] % forget_every == 0:
            self._kv.clear()
            for buffer in (*self.kv_pool.k, *self.kv_pool.v):
                buffer.normal_()
            graphed = original(self, reqs, max_drafts)
            self.chain, self._kv = None, {}
            eager = original(self, reqs, max_drafts)
            self.chain = chain
        else:
            saved, self.chain = dict(self._kv), None
            eager = original(self, reqs, max_drafts)
            self.chain, self._kv = chain, saved
            graphed = original(self, reqs, max_drafts)
        assert chain.replays == replays + 1, "a proposal that fits the graph was not graphed"
        same.append([d.pending.tolist() for d in eager] == [d.pending.tolist() for d in graphed])
        return graphed

    monkeypatch.setattr(head_draft.HeadDraft, "propose", propose)
    return same


@pytest.mark.parametrize("algorithm", ["EAGLE3", "EAGLE"])
def test_graph_drafts_what_the_eager_steps_draft(
    algorithm: str, target: Path, heads: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated acceptance varies how many positions each catch-up must cover (1 to k + 1)."""
    eager_chain(monkeypatch)
    same = compare_with_eager_steps(monkeypatch)
    _, stats, chain = _generate(
        target, **_flags(heads, algorithm, speculative_simulate_accept_len=2.5)
    )
    assert chain is not None and chain.replays == len(same) > 5, "too few proposals were graphed"
    assert all(same), f"{same.count(False)} of {len(same)} graphed proposals differ"
    assert stats["accepted_tokens"] > 0


def test_graph_drafts_after_catching_up_a_lag_what_the_eager_steps_draft(
    target: Path, heads: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Draft KV that lags behind the graph's fixed catch-up (a pause, a new request, a row
    re-pointed) is written by one eager forward first; the graph then drafts what the eager
    steps draft."""
    eager_chain(monkeypatch)
    same = compare_with_eager_steps(monkeypatch, forget_every=2)
    _, _, chain = _generate(target, **_flags(heads, "EAGLE3", speculative_simulate_accept_len=2.5))
    assert chain is not None and len(same) > 5, "too few proposals were graphed"
    assert all(same), f"{same.count(False)} of {len(same)} graphed proposals differ"


def test_graph_keeps_greedy_outputs(
    target: Path, heads: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The random head accepts almost nothing, so nearly every token costs a verify step of
    the interpreted kernels: 10 tokens a request here (16 took ~65 s on one CPU core). The
    sequences still end past the CPU kernels' 16-key block (at 14 to 26 positions)."""
    reference = _generate(target, "torch_native", GREEDY_TOKENS)[0]  # no interpreted kernels
    eager_chain(monkeypatch)
    outputs, stats, chain = _generate(target, max_new_tokens=GREEDY_TOKENS,
                                      **_flags(heads, "EAGLE3"))  # fmt: skip
    assert chain is not None and chain.replays > 5
    assert stats["verified_requests"] > 0
    assert outputs == reference
