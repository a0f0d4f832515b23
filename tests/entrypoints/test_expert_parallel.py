"""Expert parallelism on CPU (gloo, 2 ranks, float32): greedy outputs of a --tp-size 2
--ep-size 2 server (attention tensor-parallel, experts 0-1 on rank 0 and 2-3 on rank 1, tokens
dispatched with all-to-all) equal the single-process engine's token for token, on a tiny random
Qwen3-MoE (one dense layer among the sparse ones) and a tiny random Mixtral, with the KV-leak
check on; through the offline Engine the experts are seen sharded, and tensor parallelism
without expert parallelism (each expert's intermediate features cut over the ranks) matches
too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from platform_choice import CPU_FLAGS, on_cpu
from server_process import RunningServer, start_server, stop_server
from tiny_models import make_tiny_model_dir

from radixserve import Engine

HANG_GUARD_S = 120  # only stops a hung test; no outcome depends on it
PROMPTS = ["The quick brown fox jumps over", "def add(a, b):\n    return", "Hello world! I am"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
SETTINGS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 8}
FAMILIES = {
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", {
        "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 48, "norm_topk_prob": True, "mlp_only_layers": [1],
    }),
    "mixtral": ("mixtral", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
    }),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, arch, overrides = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    return make_tiny_model_dir(out, model_type, arch, **overrides)


def _engine_outputs(model_dir: Path, **settings: Any) -> tuple[list[list[int]], Any]:
    with Engine(str(model_dir), **on_cpu({**SETTINGS, **settings})) as engine:
        moe = next(layer.moe for layer in engine.core.runner.model.layers if layer.moe)
        shapes = (tuple(moe.w13.shape), tuple(moe.w2.shape))
        return [r["output_ids"] for r in engine.generate(PROMPTS, GREEDY)], shapes


@pytest.fixture(scope="module")
def reference(family: Path) -> list[list[int]]:
    outputs, _ = _engine_outputs(family)
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in outputs)
    return outputs


@pytest.fixture(scope="module")
def ep2_server(family: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    flags = [*CPU_FLAGS, "--model-path", str(family), "--tp-size", "2", "--ep-size", "2",
             "--dtype", "float32", "--max-total-tokens", "4096", "--chunked-prefill-size", "8",
             "--debug-leak-check"]  # fmt: skip
    log = tmp_path_factory.mktemp("ep-logs") / f"{family.name}.log"
    server = start_server(flags, log, timeout=HANG_GUARD_S)
    yield server
    code = stop_server(server)  # with --debug-leak-check a KV leak fails the exit code
    assert code == 0, server.log()[-3000:]


def test_server_ep2_equals_ep1(
    family: Path, reference: list[list[int]], ep2_server: RunningServer
) -> None:
    body = {"text": PROMPTS, "sampling_params": GREEDY}
    r = httpx.post(ep2_server.url + "/generate", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 200, r.text
    assert [item["output_ids"] for item in r.json()] == reference
    info = httpx.get(ep2_server.url + "/get_server_info", timeout=30).json()
    assert info["tp_size"] == 2 and info["ep_size"] == 2
    # a second round: the first prompt's prefix from the radix cache, decodes beside prefills
    r = httpx.post(ep2_server.url + "/generate", json=body, timeout=HANG_GUARD_S)
    assert [item["output_ids"] for item in r.json()] == reference


@pytest.mark.slow
def test_engine_shards_the_experts(family: Path, reference: list[list[int]]) -> None:
    """Mixtral at --tp-size 2: each of the 4 experts keeps half its 64 intermediate features;
    Qwen3-MoE at --ep-size 2: each rank keeps 2 whole experts (48 intermediate features)."""
    if "mixtral" in family.name:
        outputs, (w13, w2) = _engine_outputs(family, tp_size=2)
        assert w13 == (4, 2 * 32, 96) and w2 == (4, 96, 32)
    else:
        outputs, (w13, w2) = _engine_outputs(family, tp_size=2, ep_size=2)
        assert w13 == (2, 2 * 48, 96) and w2 == (2, 96, 48)
    assert outputs == reference


def test_ep_size_is_refused_for_a_dense_model(tmp_path: Path) -> None:
    from tiny_models import make_tiny_llama_dir

    from radixserve.core.config import ConfigError

    model_dir = make_tiny_llama_dir(tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"ep_size=2: model plugin 'LlamaForCausalLM' has no"):
        Engine(str(model_dir), **on_cpu({**SETTINGS, "tp_size": 2, "ep_size": 2}))
