"""Each built-in model family equals transformers' own implementation on the same random weights.

Tiny configs (2-3 layers, 6 query heads over 3 KV heads, head_dim 16), float32, HF's eager
attention as the reference:
- one model step at a time (``ModelRunner``): every row's logits of prefills, prompt chunks after
  a cached prefix and decodes sharing steps, with the ``torch_native`` and ``triton`` attention
  backends (the Triton kernels interpreted on a CPU machine);
- through the offline ``Engine`` with a small ``chunked_prefill_size``: prompt logprobs (chosen and
  top-5) at every position, again for a longer prompt whose start is a radix-cache hit, and
  greedy generation of 32 tokens equal to ``generate()`` with the logprob of every output token.

Gemma 2 runs with a sliding window (8) shorter than the prompts, soft-capped attention scores and
logits and ``query_pre_attn_scalar`` != head_dim; Qwen3-MoE has a dense (``mlp_only_layers``)
layer between sparse ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

from tiny_models import make_tiny_model_dir  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.core.config import EngineConfig  # noqa: E402
from radixserve.core.model_runner import ModelRunner  # noqa: E402
from radixserve.core.plugins import default_host  # noqa: E402
from radixserve.core.request import Req, SamplingParams  # noqa: E402
from radixserve.core.step_plan import StepPlan  # noqa: E402

ATOL = 1e-4
#: name -> (transformers model_type, architecture, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("qwen2", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": (
        "qwen3",
        "Qwen3ForCausalLM",
        {"num_hidden_layers": 3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "gemma2": (
        "gemma2",
        "Gemma2ForCausalLM",
        {
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        {
            "num_hidden_layers": 3,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": (
        "mixtral",
        "MixtralForCausalLM",
        {"num_local_experts": 5, "num_experts_per_tok": 2, "intermediate_size": 64},
    ),
}
NAMES = list(FAMILIES)
PROMPT_LENS = (3, 13, 37)  # with chunks of 8: one chunk, two, five


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs: dict[str, Path] = {}
    for name, (model_type, arch, overrides) in FAMILIES.items():
        dirs[name] = make_tiny_model_dir(
            tmp_path_factory.mktemp(name), model_type, arch, **overrides
        )
    return dirs


_HF: dict[Path, torch.nn.Module] = {}


def _hf(model_dir: Path) -> torch.nn.Module:
    if model_dir not in _HF:
        from transformers import AutoModelForCausalLM

        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    return _HF[model_dir]


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


# ---- one step at a time -----------------------------------------------------------------------


def _forward(runner: ModelRunner, reqs: list[Req], lens: list[int]) -> torch.Tensor:
    """Run one step of ``lens`` new tokens per request; logits of every row."""
    for req, n in zip(reqs, lens, strict=True):
        slots = runner.allocator.alloc(n)
        assert slots is not None
        runner.req_to_token.write(req.req_pool_idx, req.kv_len, slots)
    num_decode = sum(1 for n in lens if n == 1)
    fb, _ = runner.build_batch(StepPlan(reqs, lens, num_decode))
    fb.logits_indices = torch.arange(sum(lens))
    runner.attention.prepare(fb)
    logits = runner.model.forward(fb)
    for req, n in zip(reqs, lens, strict=True):
        req.kv_len += n
    return logits.cpu()  # the HF reference runs on the CPU


#: the interpreted Triton kernels are slow: they run the family whose attention has options
STEP_CASES = [(name, "torch_native") for name in NAMES] + [("gemma2", "triton")]


@pytest.mark.parametrize(("name", "attention"), STEP_CASES, ids=[f"{n}-{a}" for n, a in STEP_CASES])
def test_step_logits_match_hf(family_dirs: dict[str, Path], name: str, attention: str) -> None:
    """Prefills, a prompt continued in chunks after its KV is in the pool (a cached prefix),
    and decodes sharing steps: every row's logits equal HF's on the same tokens. The prompts
    (11 and 30 tokens) are longer than Gemma's window (8) from the first step."""
    model_dir = family_dirs[name]
    config = EngineConfig(
        max_total_tokens=1024, dtype="float32", plugins=(f"attention={attention}",)
    )
    runner = ModelRunner(model_dir, config, default_host())
    hf = _hf(model_dir)
    a, b, c = (Req(r, _prompt(n, i), SamplingParams()) for i, (r, n) in enumerate(
        [("a", 11), ("b", 4), ("c", 30)]))  # fmt: skip
    for req in (a, b, c):
        row = runner.req_to_token.alloc()
        assert row is not None
        req.req_pool_idx = row

    def check(reqs: list[Req], lens: list[int], logits: torch.Tensor) -> None:
        row = 0
        for req, n in zip(reqs, lens, strict=True):
            ids = req.fill_ids()[: req.kv_len]
            ref = _hf_logits(hf, ids)[len(ids) - n :]
            torch.testing.assert_close(logits[row : row + n], ref, atol=ATOL, rtol=0)
            row += n

    def take_argmax(reqs: list[Req], lens: list[int], logits: torch.Tensor) -> None:
        row = 0
        for req, n in zip(reqs, lens, strict=True):
            row += n
            if req.kv_len >= len(req.input_ids):  # not after a partial prompt chunk
                req.output_ids.append(int(logits[row - 1].argmax()))

    steps = [([a, b], [11, 4]), ([a, b, c], [1, 1, 13]), ([a, b, c], [1, 1, 17])]
    steps += [([a, b, c], [1, 1, 1])] * (3 if attention == "triton" else 10)
    for reqs, lens in steps:
        logits = _forward(runner, reqs, lens)
        check(reqs, lens, logits)
        take_argmax(reqs, lens, logits)


# ---- through the offline Engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(family_dirs: dict[str, Path]):
    """One engine per family: float32, chunks of 8 tokens, the CPU's torch_native attention."""
    made: dict[str, Engine] = {}

    def get(name: str) -> Engine:
        if name not in made:
            made[name] = Engine(
                str(family_dirs[name]),
                dtype="float32",
                chunked_prefill_size=8,
                max_total_tokens=2048,
            )
        return made[name]

    yield get
    for engine in made.values():
        engine.shutdown()


def _check_input_logprobs(meta: dict[str, Any], ids: list[int], start: int,
                          ref: torch.Tensor) -> None:  # fmt: skip
    """Engine input logprob entries for positions ``start``.. against HF log-softmax rows."""
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [e[1] for e in entries] == ids[start:]
    for pos in range(max(start, 1), len(ids)):
        got, top = entries[pos - start][0], tops[pos - start]
        assert got == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=ATOL)
        values, indices = ref[pos - 1].topk(5)
        assert [t[0] for t in top] == pytest.approx(values.tolist(), abs=ATOL)
        assert [t[1] for t in top] == indices.tolist()


@pytest.mark.parametrize("name", NAMES)
def test_engine_prompt_logprobs_match_hf_chunked_and_cached(
    family_dirs: dict[str, Path], engines, name: str
) -> None:
    engine, hf = engines(name), _hf(family_dirs[name])
    for i, n in enumerate(PROMPT_LENS):
        ids = _prompt(n, 100 + i)
        ref = torch.log_softmax(_hf_logits(hf, ids), -1)
        out = engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=5,
        )
        _check_input_logprobs(out["meta_info"], ids, 0, ref)
        # the same prompt with more tokens: its start comes from the radix cache
        longer = ids + _prompt(11, 200 + i)
        ref = torch.log_softmax(_hf_logits(hf, longer), -1)
        out = engine.generate(
            input_ids=longer,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            logprob_start_len=n,
            top_logprobs_num=5,
        )
        assert out["meta_info"]["cached_tokens"] >= n - 1
        _check_input_logprobs(out["meta_info"], longer, n, ref)


@pytest.mark.parametrize("name", NAMES)
def test_engine_greedy_32_tokens_equal_hf_generate(
    family_dirs: dict[str, Path], engines, name: str
) -> None:
    engine, hf = engines(name), _hf(family_dirs[name])
    prompts = [_prompt(n, 300 + i) for i, n in enumerate(PROMPT_LENS)]
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    # twice: the second round's prompts are radix-cache hits
    for _ in range(2):
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        for ids, out in zip(prompts, outs, strict=True):
            with torch.no_grad():
                ref = hf.generate(
                    torch.tensor([ids]),
                    max_new_tokens=32,
                    min_new_tokens=32,
                    do_sample=False,
                    pad_token_id=0,
                )[0, len(ids) :].tolist()
            assert out["output_ids"] == ref
            full = ids + ref
            logprobs = torch.log_softmax(_hf_logits(hf, full), -1)
            expected = [logprobs[len(ids) + j - 1, t].item() for j, t in enumerate(ref)]
            got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(expected, abs=ATOL)


def test_a_backend_without_the_options_serves_plain_families_and_refuses_gemma2(
    family_dirs: dict[str, Path],
) -> None:
    """A third-party backend with the bare ``forward(q, k, v, layer_id, batch)`` still builds
    every family whose layers need no option; Gemma 2 stops at build time, naming them."""
    from radixserve.core.config import ConfigError, ModelConfig
    from radixserve.core.interfaces import AttentionBackend
    from radixserve.plugins.models.gemma2 import Gemma2ForCausalLM
    from radixserve.plugins.models.qwen2 import Qwen2ForCausalLM

    class Bare(AttentionBackend):
        def prepare(self, batch: Any) -> None: ...

        def forward(self, q: Any, k: Any, v: Any, layer_id: int, batch: Any) -> Any: ...

    qwen2 = ModelConfig.from_dir(family_dirs["qwen2"])
    Qwen2ForCausalLM(qwen2, Bare(), torch.float32, "cpu")
    gemma2 = ModelConfig.from_dir(family_dirs["gemma2"])
    with pytest.raises(ConfigError, match="Bare does not support logit_softcap, scale"):
        Gemma2ForCausalLM(gemma2, Bare(), torch.float32, "cpu")
