"""The radix cache through the offline Engine: reuse of a repeated prompt (cached_tokens in
meta_info, the step trace), greedy outputs independent of caching, chunking, KV pressure and
policy, the engine's hit-rate and retraction counters, flush_cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from platform_choice import CPU, on_cpu

from radixserve import Engine
from radixserve.core.tokenizer import Tokenizer

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}

SYSTEM = (
    "You are a helpful assistant for a small bakery. Answer questions about opening hours, "
    "bread, cakes and pastries politely and briefly. The bakery opens at seven in the morning "
    "and closes at six in the evening, every day except Monday. Never invent prices."
)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    with Engine(str(tiny_llama_dir), plugins=[CPU], max_total_tokens=8192) as eng:
        yield eng


def _finished_ok(result: dict[str, Any]) -> bool:
    reason = result["meta_info"]["finish_reason"]
    return reason is not None and reason["type"] in ("length", "stop")


# -- the seeds' exercise ----------------------------------------------------------------------


def test_same_prompt_twice_reuses_all_but_the_last_token(engine: Engine) -> None:
    assert engine.flush_cache()
    sched = engine.core.scheduler
    sched.trace_steps = True
    prompt = engine.tokenizer.encode_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}]
    )
    assert len(prompt) > 40
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    trace_start = len(sched.stats.step_trace)
    second = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    # Page size 1: everything but the last prompt token is reused; that one is recomputed to
    # get the logits of the first new token.
    assert second["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert sched.stats.step_trace[trace_start] == (0, 1)
    assert sum(p for _, p in sched.stats.step_trace[trace_start:]) == 1
    assert second["output_ids"] == first["output_ids"]

    changed_at = 7  # one token early in the system prompt
    third_prompt = list(prompt)
    third_prompt[changed_at] = prompt[changed_at] + 1
    trace_start = len(sched.stats.step_trace)
    third = engine.generate(input_ids=third_prompt, sampling_params=GREEDY)
    assert third["meta_info"]["cached_tokens"] == changed_at
    assert sched.stats.step_trace[trace_start] == (0, len(prompt) - changed_at)
    sched.trace_steps = False
    sched.check_no_leak()


def test_cached_tokens_per_request_and_engine_hit_rate(engine: Engine) -> None:
    assert engine.flush_cache()
    stats = engine.core.scheduler.stats
    prompts_before, cached_before = stats.prompt_tokens, stats.cached_tokens
    shared = engine.tokenizer.encode(SYSTEM)
    warm = engine.generate(input_ids=shared + [5], sampling_params=GREEDY)
    assert warm["meta_info"]["cached_tokens"] == 0
    tails = [[7, 8, 9], [10, 11], [12]]
    results = engine.generate(input_ids=[shared + t for t in tails], sampling_params=GREEDY)
    assert [r["meta_info"]["cached_tokens"] for r in results] == [len(shared)] * 3
    assert [r["meta_info"]["prompt_tokens"] for r in results] == [
        len(shared) + len(t) for t in tails
    ]
    new_prompt_tokens = len(shared) + 1 + sum(len(shared) + len(t) for t in tails)
    assert stats.prompt_tokens - prompts_before == new_prompt_tokens
    assert stats.cached_tokens - cached_before == 3 * len(shared)
    assert stats.cache_hit_rate == stats.cached_tokens / stats.prompt_tokens
    assert 0.0 < stats.cache_hit_rate < 1.0


def test_flush_cache_empties_the_tree_when_idle(engine: Engine) -> None:
    engine.generate(input_ids=engine.tokenizer.encode(SYSTEM), sampling_params=GREEDY)
    cache = engine.core.cache
    assert cache.evictable_size > 0
    assert engine.flush_cache() is True
    assert cache.evictable_size == 0 and cache.locked_size == 0
    assert engine.core.runner.allocator.available() == engine.core.runner.kv_size
    again = engine.generate(input_ids=engine.tokenizer.encode(SYSTEM), sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0


# -- outputs do not depend on caching, chunking, pressure or policy ---------------------------


def _shared_prefix_chats(
    model_dir: Path, systems: list[str], questions: list[str]
) -> list[list[int]]:
    tokenizer = Tokenizer(model_dir)
    return [
        tokenizer.encode_chat([{"role": "system", "content": s}, {"role": "user", "content": q}])
        for s in systems
        for q in questions
    ]


def _run(model_dir: Path, prompts: list[list[int]], params: dict[str, Any], **settings: Any):
    """Generate in a fresh engine; return (results, scheduler) after checking it is idle and
    leak-free."""
    # the CPU by name: exact equality across chunkings and cache states is the CPU's (a GPU's
    # kernels round differently for different shapes)
    with Engine(str(model_dir), **on_cpu(settings)) as eng:
        results = eng.generate(input_ids=prompts, sampling_params=params)
        sched = eng.core.scheduler
        assert not sched.has_work()
        sched.check_no_leak()
        assert eng.core.cache.locked_size == 0
    assert all(_finished_ok(r) for r in results), [r["meta_info"] for r in results]
    return results, sched


def _check_independent_of_cache_and_pressure(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int
) -> None:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    need = sum(len(p) + max_new_tokens for p in prompts)
    runs = {
        "cache": dict(max_total_tokens=need),
        "no-cache": dict(max_total_tokens=need, disable_radix_cache=True),
        "chunked-64": dict(max_total_tokens=need, chunked_prefill_size=64),
        "quarter-pool": dict(max_total_tokens=need // 4, schedule_conservativeness=0.0),
    }
    outputs = {}
    for name, settings in runs.items():
        results, sched = _run(model_dir, prompts, params, **settings)
        outputs[name] = [r["output_ids"] for r in results]
        cached = [r["meta_info"]["cached_tokens"] for r in results]
        if name == "no-cache":
            assert sched.stats.cached_tokens == 0 and not any(cached)
        else:
            assert sched.stats.cache_hit_rate > 0.0 and any(cached), name
        if name == "quarter-pool":
            assert sched.stats.retractions > 0
        else:
            assert sched.stats.retractions == 0, name
    for name, out in outputs.items():
        mismatched = [
            i for i, (a, b) in enumerate(zip(outputs["cache"], out, strict=True)) if a != b
        ]
        assert not mismatched, f"{name} differs from cache at requests {mismatched}"


QUESTIONS = [
    "When do you open on Sunday?",
    "Do you sell gluten-free bread?",
    "Can I order a birthday cake for Friday?",
    "Are you open on Monday?",
    "What time do you close?",
    "Do you have croissants in the afternoon?",
    "Can I bring my dog inside?",
    "Which cake is the most popular?",
]
SYSTEMS = [
    SYSTEM,
    "You are a travel agent. Suggest short trips by train from the city centre, mention the "
    "travel time and one sight worth seeing, and keep every answer under three sentences.",
    "You are a patient maths tutor for children. Explain each step in plain words, use small "
    "numbers in examples, and end every answer with one short practice question.",
    "You are a librarian. Recommend books by their genre and mood, name the author, and never "
    "reveal the ending of a story. Keep the tone warm and the answers short.",
]

# Appended to SYSTEMS for SmolLM2, whose tokenizer is far denser than the tiny model's.
HOUSE_RULES = [
    "If a customer asks about allergies, list the common allergens we use: wheat, milk, eggs, "
    "nuts and sesame. Orders for large cakes need two days of notice. We accept cash and "
    "cards, and we do not deliver. Our sourdough is baked twice a day.",
    "Always mention whether the train needs a reservation, whether bicycles are allowed on "
    "board, and the cheapest time of day to travel. Prefer trips that need no change of "
    "train. If the weather matters for the sight, say so in a few words.",
    "Never give the final answer to a practice question. If the child seems stuck, offer a "
    "hint with a picture in words, such as apples in a basket or steps on a staircase. Praise "
    "the effort, not the speed, and keep every sentence short and friendly.",
    "When a reader names a book they loved, suggest two similar ones and say why in a single "
    "line each. Mention if a book is part of a series and which volume to start with. Point "
    "out large-print and audio editions when a reader asks for them.",
]


def test_tiny_outputs_do_not_depend_on_cache_chunking_or_pressure(tiny_llama_dir: Path) -> None:
    prompts = _shared_prefix_chats(tiny_llama_dir, SYSTEMS, QUESTIONS)
    _check_independent_of_cache_and_pressure(tiny_llama_dir, prompts, max_new_tokens=16)


@pytest.mark.slow
def test_smollm2_outputs_do_not_depend_on_cache_chunking_or_pressure(smollm2_dir: Path) -> None:
    long_systems = [f"{s} {rules}" for s, rules in zip(SYSTEMS, HOUSE_RULES, strict=True)]
    # four system prompts x four questions: sixteen requests sharing four long prefixes
    prompts = _shared_prefix_chats(smollm2_dir, long_systems, QUESTIONS[:4])
    assert len(prompts) == 16
    assert all(100 <= len(p) <= 200 for p in prompts), sorted(len(p) for p in prompts)
    _check_independent_of_cache_and_pressure(smollm2_dir, prompts, max_new_tokens=12)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs", "random"])
def test_outputs_are_identical_across_policies(tiny_llama_dir: Path, policy: str) -> None:
    prompts = _shared_prefix_chats(tiny_llama_dir, SYSTEMS[:2], QUESTIONS[:5])
    params = {"temperature": 0.0, "max_new_tokens": 12}
    reference, _ = _run(tiny_llama_dir, prompts, params, max_total_tokens=8192)
    # A small running batch makes the admission order matter.
    results, sched = _run(
        tiny_llama_dir,
        prompts,
        params,
        max_total_tokens=8192,
        schedule_policy=policy,
        max_running_requests=3,
    )
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in reference]
    assert sched.stats.cached_tokens > 0
