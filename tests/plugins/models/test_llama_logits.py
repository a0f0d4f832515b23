"""The llama plugin's logits equal HF transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.core.config import EngineConfig
from radixserve.core.model_runner import ModelRunner
from radixserve.core.plugins import default_host
from radixserve.core.request import Req, SamplingParams
from radixserve.core.step_plan import StepPlan

ATOL = 1e-4


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    return ModelRunner(
        tiny_llama_dir, EngineConfig(max_total_tokens=2048, dtype="float32"), default_host()
    )


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _admit(runner: ModelRunner, req: Req) -> None:
    row = runner.req_to_token.alloc()
    assert row is not None
    req.req_pool_idx = row


def _forward(runner: ModelRunner, reqs: list[Req], lens: list[int], all_logits: bool = False):
    """Allocate KV for the next ``lens`` tokens of each request and run one model step."""
    for req, n in zip(reqs, lens, strict=True):
        slots = runner.allocator.alloc(n)
        assert slots is not None
        runner.req_to_token.write(req.req_pool_idx, req.kv_len, slots)
    num_decode = sum(1 for n in lens if n == 1)
    fb, _ = runner.build_batch(StepPlan(reqs, lens, num_decode))
    if all_logits:
        fb.logits_indices = torch.arange(sum(lens))
    runner.attention.prepare(fb)
    logits = runner.model.forward(fb)
    for req, n in zip(reqs, lens, strict=True):
        req.kv_len += n
    return logits.cpu()  # the HF reference runs on the CPU


def test_prefill_and_16_decode_steps_match_hf(runner: ModelRunner, hf_model) -> None:
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 64, 128, 31]
    req = Req("r0", list(prompt), SamplingParams())
    _admit(runner, req)
    ours = _forward(runner, [req], [len(prompt)], all_logits=True)
    torch.testing.assert_close(ours, _hf_logits(hf_model, prompt), atol=ATOL, rtol=0)
    for _ in range(16):
        nxt = int(ours[-1].argmax())
        req.output_ids.append(nxt)
        ours = _forward(runner, [req], [1])
        ref = _hf_logits(hf_model, req.fill_ids())[-1:]
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_mixed_batch_of_decodes_and_chunks_matches_hf(runner: ModelRunner, hf_model) -> None:
    """Two decoding requests and a prompt prefilled in two chunks, all in shared steps."""
    a = Req("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    b = Req("b", [9, 8, 7], SamplingParams())
    c = Req("c", list(range(20, 61)), SamplingParams())
    for req in (a, b, c):
        _admit(runner, req)
    logits = _forward(runner, [a, b], [7, 3])
    for req, row in zip((a, b), logits, strict=True):
        req.output_ids.append(int(row.argmax()))
    # step 2: a and b decode while c's first chunk (after a cached-prefix-free start) runs
    logits = _forward(runner, [a, b, c], [1, 1, 25])
    for req, row in zip((a, b), logits[:2], strict=True):
        torch.testing.assert_close(row, _hf_logits(hf_model, req.fill_ids())[-1], atol=ATOL, rtol=0)
        req.output_ids.append(int(row.argmax()))
    # step 3: c's second chunk attends to its first chunk's KV in the pool
    logits = _forward(runner, [a, b, c], [1, 1, 16])
    for req, row in zip((a, b, c), logits, strict=True):
        torch.testing.assert_close(row, _hf_logits(hf_model, req.fill_ids())[-1], atol=ATOL, rtol=0)
