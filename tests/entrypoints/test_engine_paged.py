"""``--page-size 16`` end to end on the tiny random Llama: greedy outputs equal page size 1 with
shared prefixes and the radix cache on, with unaligned prefill chunks, without the cache, and
with a pool small enough to force retractions; cache hits are whole pages; nothing leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from platform_choice import CPU, on_cpu

from radixserve import Engine
from radixserve.core.config import ConfigError, EngineConfig
from radixserve.core.tokenizer import Tokenizer

PAGE = 16
NEW_TOKENS = 16
SYSTEMS = [
    "You are a helpful assistant for a small bakery. Answer questions about opening hours, "
    "bread, cakes and pastries politely and briefly. The bakery opens at seven.",
    "You are a travel agent. Suggest short trips by train from the city centre and mention "
    "the travel time and one sight worth seeing.",
]
QUESTIONS = [
    "When do you open on Sunday?",
    "Do you sell gluten-free bread?",
    "Can I order a birthday cake for Friday?",
    "What time do you close?",
]


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    tokenizer = Tokenizer(tiny_llama_dir)
    out = [
        tokenizer.encode_chat([{"role": "system", "content": s}, {"role": "user", "content": q}])
        for s in SYSTEMS
        for q in QUESTIONS
    ]
    assert all(len(p) % PAGE for p in out[:2]), "want prompts that end inside a page"
    return out


def _run(model_dir: Path, prompts: list[list[int]], **settings: Any) -> tuple[list[Any], Any]:
    """Greedy outputs of a fresh engine, after checking it is idle and leak-free."""
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with Engine(str(model_dir), **on_cpu(settings)) as eng:
        results = eng.generate(input_ids=prompts, sampling_params=params)
        sched = eng.core.scheduler
        assert not sched.has_work()
        sched.check_no_leak()
        assert eng.core.cache.locked_size == 0
        assert eng.core.runner.allocator.page_size == settings.get("page_size", 1)
    return results, sched


def test_page_size_16_gives_the_greedy_outputs_of_page_size_1(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    need = sum(len(p) + NEW_TOKENS for p in prompts) + 2 * len(prompts) * PAGE
    reference, ref_sched = _run(tiny_llama_dir, prompts, max_total_tokens=need)
    want = [r["output_ids"] for r in reference]
    assert ref_sched.stats.retractions == 0
    runs = {
        "paged": dict(max_total_tokens=need),
        "paged-chunked-40": dict(max_total_tokens=need, chunked_prefill_size=40),
        "paged-no-cache": dict(max_total_tokens=need, disable_radix_cache=True),
        # Room for one request and two more pages: the others must wait or be retracted.
        # (admission keeps no room back, so retraction does the work)
        "paged-tight-pool": dict(
            max_total_tokens=max(map(len, prompts)) + NEW_TOKENS + 3 * PAGE,
            schedule_conservativeness=0.0,
        ),
        "paged-overlap": dict(max_total_tokens=need, enable_overlap_schedule=True),
        "paged-tight-pool-overlap": dict(
            max_total_tokens=max(map(len, prompts)) + NEW_TOKENS + 3 * PAGE,
            schedule_conservativeness=0.0,
            enable_overlap_schedule=True,
        ),
    }
    for name, settings in runs.items():
        results, sched = _run(tiny_llama_dir, prompts, page_size=PAGE, **settings)
        assert [r["output_ids"] for r in results] == want, name
        cached = [r["meta_info"]["cached_tokens"] for r in results]
        assert all(c % PAGE == 0 for c in cached), (name, cached)
        if name == "paged-no-cache":
            assert not any(cached)
        else:
            # Requests after the first of each system prompt reuse its whole pages.
            assert sched.stats.cached_tokens >= (len(prompts) - len(SYSTEMS)) * PAGE, name
        if name.startswith("paged-tight-pool"):
            assert sched.stats.retractions > 0
        else:
            assert sched.stats.retractions == 0, name


def test_repeated_prompt_reuses_its_whole_pages(tiny_llama_dir: Path) -> None:
    prompt = list(range(5, 5 + 3 * PAGE + 7))
    params = {"temperature": 0.0, "max_new_tokens": 4}
    with Engine(str(tiny_llama_dir), plugins=[CPU], max_total_tokens=1024, page_size=PAGE) as eng:
        first = eng.generate(input_ids=prompt, sampling_params=params)
        second = eng.generate(input_ids=prompt, sampling_params=params)
        # The prompt and first outputs are cached in whole pages: 3 of the prompt's pages.
        assert second["meta_info"]["cached_tokens"] == 3 * PAGE
        assert second["output_ids"] == first["output_ids"]
        assert eng.flush_cache()
        runner = eng.core.runner
        # Rows 0..1024 of the KV pool hold pages 0..63; page 0 is reserved.
        assert runner.allocator.available() == runner.allocator.size == 63 * PAGE
        eng.core.scheduler.check_no_leak()


@pytest.mark.parametrize("bad", [0, 3, 12, 512, -16])
def test_page_size_must_be_a_power_of_two_up_to_256(bad: int) -> None:
    with pytest.raises(ConfigError, match="page_size must be a power of two from 1 to 256"):
        EngineConfig(page_size=bad)
    assert EngineConfig(page_size=256, max_total_tokens=4096).page_size == 256


def test_page_size_is_a_command_line_flag() -> None:
    import argparse

    from radixserve.entrypoints.cli import add_engine_config_args, engine_settings

    parser = argparse.ArgumentParser()
    add_engine_config_args(parser)
    assert "--page-size" in parser.format_help()
    assert engine_settings(parser.parse_args(["--page-size", "16"])) == {"page_size": 16}


def test_a_pool_with_no_page_besides_the_reserved_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="max_total_tokens=16 holds no page"):
        EngineConfig(page_size=16, max_total_tokens=16)
