"""Tensor parallelism with n-gram speculation (CPU, gloo, 2 ranks, float32): the drafts come
from rank 0 alone (an n-gram table needs no draft model), each verify step is broadcast like any
other, and greedy outputs equal --tp-size 1 without speculation token for token, with drafts
accepted on the way and the KV-leak check on. Through the offline Engine (one rank spawned)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from platform_choice import on_cpu
from tiny_models import make_tiny_llama_dir

from radixserve import Engine

# repetitive prompts: the n-gram table finds drafts in them
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\ndef add(a, b):\n",
    "Hello world! Hello world! Hello",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}
# speculate at every batch size, whatever the measured payoff (this tests outputs, not speed)
SPECULATION = {"speculative_algorithm": "ngram", "speculative_disable_batch_size": 16,
               "speculative_disable_pause": True}  # fmt: skip
SETTINGS: dict[str, Any] = {
    "dtype": "float32", "max_total_tokens": 4096, "chunked_prefill_size": 8,
    "debug_leak_check": True,
}  # fmt: skip


def _generate(model_dir: Path, **settings: Any) -> list[dict[str, Any]]:
    with Engine(str(model_dir), **on_cpu({**SETTINGS, **settings})) as engine:
        return engine.generate(PROMPTS, GREEDY)


def test_tp2_with_ngram_speculation_equals_tp1(tmp_path: Path) -> None:
    model_dir = make_tiny_llama_dir(
        tmp_path / "tiny", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
        head_dim=16, intermediate_size=161,
    )  # fmt: skip
    reference = [r["output_ids"] for r in _generate(model_dir)]
    spec = _generate(model_dir, tp_size=2, **SPECULATION)
    assert [r["output_ids"] for r in spec] == reference
    accepted = sum(r["meta_info"]["spec_accepted_tokens"] for r in spec)
    verified = sum(r["meta_info"]["spec_verify_ct"] for r in spec)
    assert verified > 0 and accepted > 0, (verified, accepted)


@pytest.mark.parametrize("algorithm", ["standalone", "eagle3"])
def test_tp_with_a_draft_model_is_refused(tmp_path: Path, algorithm: str) -> None:
    from radixserve.core.config import ConfigError
    from radixserve.core.spec_setup import algorithm_for

    class Host:  # algorithm_for refuses before it looks the plugin up
        registries: dict[str, Any] = {}

    config = type("Config", (), {"speculative_eagle_topk": 1})()
    with pytest.raises(ConfigError, match=rf"\({algorithm}, speculative_eagle_topk=1\) does"):
        algorithm_for(Host(), {"speculative": algorithm}, config, None, 2)  # type: ignore[arg-type]
