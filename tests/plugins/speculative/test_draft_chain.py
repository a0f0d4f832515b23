"""The standalone drafter's chain graph (plugins/speculative/draft_chain.py), checked on the CPU:
CUDA graphs cannot be captured here, so each "graph" replays the same captured function
eagerly, with the Triton attention kernels under TRITON_INTERPRET. What is checked is what the
graph computes: its inputs (the two last tokens, the positions, the k + 1 slots, the sequence
lengths) and outputs. With the target as its own draft every draft token must be accepted, the
chain must serve the proposals (including those after a whole draft was accepted), and outputs
must equal speculation off.
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
# tests/plugins/hardware/test_cuda_speculative.py captures and replays the standalone
# drafter's real graphs.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU emulation of the graphs")

from radixserve import Engine  # noqa: E402
from radixserve.core.spec_strategy import speculator_of  # noqa: E402
from radixserve.plugins.speculative import draft_chain, standalone  # noqa: E402
from radixserve.plugins.speculative.draft_chain import DraftChainGraphs  # noqa: E402

K = 3


class _EagerGraph:
    def __init__(self, chain: DraftChainGraphs, bs: int, refresh: bool) -> None:
        self.chain, self.bs, self.refresh = chain, bs, refresh

    def replay(self) -> None:
        self.chain._chain(self.bs, self.refresh)


@pytest.fixture
def eager_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        DraftChainGraphs, "_capture", lambda self, bs, refresh, pool: _EagerGraph(self, bs, refresh)
    )
    monkeypatch.setattr(draft_chain.torch.cuda, "graph_pool_handle", lambda: None)

    def build(context: Any, model: Any, attention: Any, kv_pool: Any) -> DraftChainGraphs:
        return DraftChainGraphs(
            model, attention, kv_pool, context.req_to_token, K, [1, 2, 4], context.device
        )

    monkeypatch.setattr(standalone, "_chain_graphs", build)


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("chain"), num_hidden_layers=1)


@pytest.fixture(scope="module")
def reference(one_layer_llama: Path) -> list[list[int]]:
    return _generate(one_layer_llama)[0]


def _generate(model: Path, **kw: Any) -> tuple[list[list[int]], Any, Any]:
    prompts = [[5 + i, 40 + 3 * i, 77, 9 + i] * (i + 1) for i in range(4)]
    # 14 tokens: 1 from the prefill, then 4 a step: a catch-up proposal and two from the chain
    params = {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True}
    # Every step drafts: pausing depends on measured step times (the machine's speed).
    kw.setdefault("speculative_disable_pause", True)
    kw.setdefault("speculative_disable_batch_size", 4)  # every request (the CPU's cut-off: 2)
    with Engine(
        str(model), plugins=["attention=triton", "hardware=cpu"], dtype="float32",
        max_running_requests=4, **kw,
    ) as engine:  # fmt: skip
        out = engine.generate(input_ids=prompts, sampling_params=params)
        algorithm = getattr(speculator_of(engine.core), "algorithm", None)
        chain = getattr(algorithm, "chain", None)
        return [o["output_ids"] for o in out], engine.core.spec_stats(), chain


def test_chain_graph_drafts_what_the_target_decodes(
    eager_chain: None, one_layer_llama: Path, reference: list[list[int]]
) -> None:
    outputs, stats, chain = _generate(
        one_layer_llama,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(one_layer_llama),
        speculative_num_steps=K,
    )
    assert outputs == reference
    assert chain is not None and chain.replays >= 2, "the chain served no proposal"
    assert stats["accepted_tokens"] == stats["draft_tokens"] > 0, stats


def test_chain_skips_the_refresh_step_after_a_rejection(
    eager_chain: None, one_layer_llama: Path, reference: list[list[int]]
) -> None:
    """Simulated acceptance 1.0 rejects every draft (the target's own token is emitted, so
    outputs still equal speculation off): the draft KV then holds the token before the last,
    and the chain runs without its refresh step."""
    outputs, stats, chain = _generate(
        one_layer_llama,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(one_layer_llama),
        speculative_num_steps=K,
        speculative_simulate_accept_len=1.0,
    )
    assert outputs == reference
    assert stats["accepted_tokens"] == 0 < stats["draft_tokens"], stats
    assert chain is not None and chain.replays > chain.refreshes, (chain.replays, stats)
