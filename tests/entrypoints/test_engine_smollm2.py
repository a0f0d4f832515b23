"""End-to-end truth: the Engine's greedy output on SmolLM2 equals HF transformers' token for
token (float32, same dequantized weights), one request at a time and all batched together."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from platform_choice import CPU

from radixserve import Engine

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
    [{"role": "user", "content": "def fib(n):\n    # complete this Python function"}],
    [{"role": "user", "content": "Explain what a radix tree is to a five year old, briefly."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path):
    eng = Engine(str(smollm2_dir), plugins=[CPU], max_total_tokens=8192)  # as transformers
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    ids = [engine.tokenizer.encode_chat(chat) for chat in CHATS]
    assert len({len(p) for p in ids}) > 4, "prompt lengths should differ"
    return ids


@pytest.fixture(scope="module")
def hf_outputs(smollm2_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=engine_eos(smollm2_dir),
                pad_token_id=0,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


def engine_eos(model_dir: Path) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["eos_token_id"]


def _params() -> dict:
    return {"max_new_tokens": NEW_TOKENS, "temperature": 0}


def test_hf_template_matches_ours(engine: Engine, smollm2_dir: Path, prompts) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    for chat, ids in zip(CHATS, prompts, strict=True):
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert engine.tokenizer.apply_chat_template(chat) == text
        assert tok(text, add_special_tokens=False)["input_ids"] == ids


def test_one_at_a_time_equals_hf(engine: Engine, prompts, hf_outputs) -> None:
    for ids, expected in zip(prompts, hf_outputs, strict=True):
        out = engine.generate(input_ids=ids, sampling_params=_params())
        assert out["output_ids"] == expected
        assert out["text"] == engine.tokenizer.decode(expected)


def test_batched_equals_hf(engine: Engine, prompts, hf_outputs) -> None:
    engine.flush_cache()
    outs = engine.generate(input_ids=prompts, sampling_params=_params())
    assert [o["output_ids"] for o in outs] == hf_outputs
    engine.core.scheduler.check_no_leak()


def test_requests_join_running_decodes(engine: Engine, prompts, hf_outputs) -> None:
    """Continuous batching: later requests enter while earlier ones decode."""
    scheduler = engine.core.scheduler
    scheduler.trace_steps, scheduler.stats.step_trace = True, []
    stream = engine.generate(input_ids=prompts[0], sampling_params=_params(), stream=True)
    first_chunks = [next(stream) for _ in range(3)]
    assert first_chunks[-1]["meta_info"]["completion_tokens"] >= 3
    late = engine.generate(input_ids=prompts[1:4], sampling_params=_params())
    rest = list(stream)
    assert rest[-1]["output_ids"] == hf_outputs[0]
    assert [o["output_ids"] for o in late] == hf_outputs[1:4]
    scheduler.trace_steps = False
    # some step ran decodes of the first request together with the late prompts' prefill
    assert any(decodes > 0 and prefill > 0 for decodes, prefill in scheduler.stats.step_trace)
