"""Mutation testing of the core with mutmut, one module at a time, each against only the tests
that cover it (``make mutation``; not part of ``make test``).

mutmut names a mutated module after its path, so each run happens in a staging folder outside
the checkout, ``<stage>/radixserve/`` (a copy of the working tree's tracked and unignored
files), where the path ``radixserve/core/stop.py`` is the module ``radixserve.core.stop`` the
tests import. The checkout itself is never mutated.

    python tests/support/mutation.py [core/stop.py ...] [--stage DIR] [--max-children N]

Prints one line per module: killed / total and the score, then the surviving mutants (see one
with ``cd <stage>/<module> && mutmut show NAME``; mutmut's log: ``<stage>/<module>/mutmut.log``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each module and the pytest arguments that select the tests covering it (fast CPU ones; none
# needs SmolLM2).
MODULES: dict[str, list[str]] = {
    "core/schedule_policy.py": [
        "tests/core/test_schedule_policy.py",
        "tests/core/test_scheduler.py",
        "tests/core/test_scheduler_unit.py",  # prefill_budget through the scheduler
        "-k",
        "schedule_policy or lpm or fcfs or dfs_weight or random or chunk_size or budget or shrink",
    ],
    "core/stop.py": ["tests/core/test_stop.py", "tests/core/test_stop_regex.py"],
    "core/sampling.py": ["tests/core/test_sampling.py"],
    "core/memory.py": [
        "tests/core/test_memory.py",
        "tests/core/test_memory_journal.py",
        "tests/core/test_hicache_layer_loads.py::test_the_device_pool_waits_per_layer_or_for_all",
    ],
    # + the hierarchical cache's hooks into RadixCache.insert (one engine-free test)
    "core/radix_cache.py": [
        "tests/core/test_radix_cache.py",
        "tests/core/test_hicache.py::test_an_insert_over_a_host_only_prefix_adopts_the_callers_slots",
    ],
    # The Scheduler driven by hand, without a model (milliseconds a test; the engine-level
    # test_scheduler*.py files take ~100 s together, too long to run once per mutant).
    "core/scheduler.py": ["tests/core/test_scheduler_unit.py"],
    # The scheduler's admission and commit halves, same tests.
    "core/admission.py": ["tests/core/test_scheduler_unit.py"],
    "core/step_commit.py": ["tests/core/test_scheduler_unit.py"],
    # The plan's data and step statistics, through the scheduler driven by hand.
    "core/step_plan.py": ["tests/core/test_scheduler_unit.py"],
    # The ForwardBatch's rows and their packing, on a real slot table (no model runner).
    "core/step_rows.py": ["tests/core/test_step_rows.py"],
    # A base of the Scheduler: its unit tests, + prompts whose KV arrives from elsewhere
    # (reserve_prompt, free_reserved: the in-process disaggregation tests, ~4 s)
    "core/kv_slots.py": [
        "tests/core/test_scheduler_unit.py",
        "tests/core/test_disaggregation.py",
    ],
    # The policy alone and on a Scheduler driven by hand (test_priority.py runs the tiny
    # Llama: ~30 s)
    "core/priority.py": ["tests/core/test_priority_policy.py"],
    # The host pool alone on a CPU device pool (test_hicache.py runs the tiny Llama: ~30 s)
    "core/hicache_pool.py": [
        "tests/core/test_hicache_pool.py",
        "tests/core/test_hicache_layer_loads.py::test_a_steps_loads_go_out_together_a_layer_at_a_time",
        "tests/core/test_hicache_layer_loads.py::test_evicting_a_node_whose_load_is_queued_issues_it_first",
        "tests/core/test_hicache_layer_loads.py::test_evicting_a_node_whose_load_went_out_leaves_the_queue_alone",
    ],
    "core/validation.py": ["tests/core/test_validation.py"],
    # Adaptive drafting's policy on synthetic acceptances and step times (no engine, no clock).
    "core/spec_adaptive.py": ["tests/core/test_spec_adaptive.py"],
    # Verifying drafts against hand-made logits, engine-free (the engine-level speculation
    # tests take minutes); test_speculative_policy reads pending drafts through verify_drafts.
    "core/spec_verify.py": [
        "tests/core/test_spec_verify.py",
        "tests/core/test_speculative_policy.py",
    ],
    # Draft trees' shape, checks and acceptance, and the Speculator's check of a plugin's tree.
    "core/spec_tree.py": ["tests/core/test_spec_tree.py"],
    # The hooks' strategy lists on plain StepStrategy subclasses (no engine).
    "core/strategy_list.py": ["tests/core/test_strategy_list.py"],
    # Sampling params' checks, finish reasons, Req's state and token_slice, engine-free (the
    # server-level validation tests start a model, too slow once per mutant)
    "core/request.py": ["tests/core/test_request.py", "tests/core/test_validation.py"],
    # A SessionTable on a real RadixCache, turns fed by hand (test_sessions.py runs the tiny
    # Llama: ~30 s)
    "core/sessions.py": ["tests/core/test_sessions_unit.py"],
    # Every check through EngineConfig(...) alone: exact messages, values on each bound
    "core/config_checks.py": ["tests/core/test_config_checks.py"],
    # PEFT directories written by the test, the slot pool on recorded weights (no model)
    "core/lora.py": ["tests/core/test_lora.py", "tests/core/test_lora_loading.py"],
    # A fake backend on the real worker threads, a split clock for the deadlines
    "core/grammar_queue.py": ["tests/core/test_grammar_queue.py"],
    # The tiered tree on a CPU device pool, a host pool and an in-memory storage backend
    # (test_hicache.py runs the tiny Llama: ~30 s).
    "core/hicache.py": [
        "tests/core/test_hicache_tree.py",
        "tests/core/test_hicache_layer_loads.py::test_evicting_a_node_whose_load_is_queued_issues_it_first",
        "tests/core/test_hicache_layer_loads.py::test_a_cache_flush_issues_queued_loads_first",
    ],
    # The page keys and the guard, engine-free (the file backend for a real one; NIXL and
    # Mooncake start their own servers: left out).
    "core/hicache_storage.py": [
        "tests/plugins/test_hicache_storage.py",
        "-k",
        "guard or page_keys or file_backend",
    ],
    # Hashes, pad ids, the encoder cache and the registration's image processor, engine-free
    # (the vision tests run the tiny VLMs).
    "core/multimodal.py": ["tests/core/test_multimodal.py"],
    # Our renderer against transformers' apply_chat_template, through the Tokenizer (~2 s).
    "core/chat_template.py": ["tests/core/test_chat_template.py"],
    # Prompt positions to score and logprobs from hand-made logits rows (no model).
    "core/logprobs.py": ["tests/core/test_logprobs.py"],
    # Reload checks on a tiny random Llama's files (built once per run: ~3 s).
    "core/checkpoint.py": ["tests/core/test_checkpoint.py"],
    # The strategy on a real registry, PEFT directories and recorded slot loads (the LoRA
    # engine tests run the tiny Llama: too slow once per mutant).
    "core/lora_strategy.py": ["tests/core/test_lora_strategy.py", "tests/core/test_lora.py"],
    # Spans, slices and M-RoPE positions with a stand-in encoder (the vision tests run the tiny
    # VLMs: too slow once per mutant).
    "core/multimodal_strategy.py": ["tests/core/test_multimodal_strategy.py"],
    # Masks, verify chains and jump-forward with a fixed-sequence matcher on a tiny BPE
    # tokenizer (the structured-output tests run a model).
    "core/grammar.py": ["tests/core/test_grammar.py"],
    # A tiny BPE tokenizer alone, + the chat renderer through it (test_chat_template.py, ~2 s).
    "core/tokenizer.py": ["tests/core/test_tokenizer.py", "tests/core/test_chat_template.py"],
    # Plans and pooled vectors on hand-made hidden states (the embedding tests run a model).
    "core/pooling.py": ["tests/core/test_pooling.py"],
    # ForwardBatch's sizes and prepare_from_device with a recording attention backend.
    "core/batch.py": ["tests/core/test_batch.py"],
    # mutF: the prefetch on a real HiRadixCache (CPU device pool, host pool, in-memory storage),
    # reads awaited through their events (test_hicache_prefetch.py runs the tiny Llama: ~30 s).
    "core/hicache_prefetch.py": ["tests/core/test_hicache_prefetch_unit.py"],
    # mutF: ModelConfig from dicts and config.json files written by the test (no model).
    "core/model_config.py": ["tests/core/test_model_config.py"],
    # mutF: weight files written by the test, a small torch module for the reload (no model).
    "core/weights.py": ["tests/core/test_weights.py"],
    # mutF: the default seed and the batch-invariant switch on plain objects (no engine).
    "core/deterministic.py": ["tests/core/test_deterministic_unit.py"],
    # mutF: CORE_DEFAULTS and PlatformSettings.describe, same file (no engine).
    "core/platform_settings.py": ["tests/core/test_deterministic_unit.py"],
    # mutF: the three engine setup modules on real pools, plugin hosts and strategy classes,
    # with namespaces standing for the runner and the core (no model).
    "core/cache_setup.py": ["tests/core/test_cache_setup.py"],
    "core/engine_views.py": ["tests/core/test_engine_views.py"],
    "core/spec_setup.py": ["tests/core/test_spec_setup.py"],
    # mutG: the strategies' reservation and model preparation on a real plugin host (no engine).
    "core/strategies.py": ["tests/core/test_strategies.py"],
    # The broadcast step against a one-rank gloo group (threads, no model).
    "core/tp_step.py": ["tests/core/test_tp_collectives.py"],
    # Stage splits and micro-batches on hand-made ForwardBatches (no model, no process group).
    "core/pp_step.py": ["tests/core/test_pp_split.py"],
    # A real sandbox child with the test plugin's grammar backend (no model, no engine).
    "core/grammar_sandbox.py": ["tests/core/test_grammar_sandbox.py"],
    # Registries and hosts built from entry points and in-test plugins.
    "core/plugins.py": ["tests/core/test_plugins.py"],
    # The Speculator's payoff policy, draft checks and step times on hand-made requests (the
    # engine-level speculation tests take minutes).
    "core/speculative.py": [
        "tests/core/test_speculator.py",
        "tests/core/test_speculative_policy.py",
        "tests/core/test_spec_loop_policy.py",
        "tests/core/test_speculative_step_times.py",
        "tests/core/test_spec_tree.py",
    ],
    # Head, vocabulary and layer splits and the collectives on one-rank gloo groups.
    "core/parallel.py": [
        "tests/core/test_tp_split.py",
        "tests/core/test_distributed.py",
        "tests/core/test_tp_collectives.py",
        "tests/core/test_pp_split.py",
    ],
    # EngineConfig's own merging and derived sizes through EngineConfig(...) alone.
    "core/config.py": ["tests/core/test_config_checks.py", "tests/core/test_config.py"],
    # mutI: the device loop with a scripted DeviceCycle on a Scheduler driven by hand, and its
    # policy on measured step times (test_spec_loop.py runs SmolLM2 and the tiny Llama).
    "core/spec_loop.py": [
        "tests/core/test_spec_loop_unit.py",
        "tests/core/test_spec_loop_policy.py",
    ],
    # mutI: Speculation's hooks on a Scheduler driven by hand and on hand-made rows and logits
    # (the engine-level speculation tests take minutes).
    "core/spec_strategy.py": [
        "tests/core/test_spec_strategy.py",
        "tests/core/test_scheduler_unit.py",
        "tests/core/test_speculative_policy.py",
        "tests/core/test_spec_setup.py",
        "tests/core/test_engine_views.py",
    ],
    # mutJ: both sides on a real Scheduler driven by hand and a recording connector (the
    # in-process engine pairs of test_disaggregation.py run the tiny Llama: too slow per mutant).
    "core/disaggregation.py": ["tests/core/test_disaggregation_unit.py"],
    # mutJ: Ranks and join on fake collectives and a recording platform, + the fast
    # all-reduce's agreement and the stuck teardown (test_tp_collectives.py), no process group.
    "core/distributed.py": ["tests/core/test_distributed.py", "tests/core/test_tp_collectives.py"],
    # mutJ: the contracts' executable defaults (optional hooks, the default step executor, the
    # bitmask operations, Draft.decode_rows, StepCapabilities.of) on minimal subclasses.
    "core/interfaces.py": ["tests/core/test_interfaces_defaults.py"],
    "core/interfaces_speculative.py": ["tests/core/test_interfaces_defaults.py"],
    "core/interfaces_capabilities.py": ["tests/core/test_interfaces_defaults.py"],
    # (not here: interfaces_kv_transfer.py and hookspecs.py, declarations only: mutmut makes
    # no mutant of either)
    # mutH: the loop's fixed points driven by test strategies and plugins on the tiny random
    # Llama (a core in ~0.2 s; test_scheduler*.py take ~100 s, too long once per mutant); + a
    # grammar's mask applied by the runner (the grammar masker the core gives it).
    "core/engine_core.py": [
        "tests/core/test_engine_core_unit.py",
        "tests/core/test_model_runner_unit.py::test_logprobs_under_a_grammar_are_the_models_unmasked_ones",
    ],
    # mutH: the runner built on the tiny random Llama (a platform with a fixed KV budget, test
    # plugins), its steps launched by hand and checked against transformers' forward; + the
    # loop's tests, which step it with overlap, logprobs and failing strategies.
    "core/model_runner.py": [
        "tests/core/test_model_runner_unit.py",
        "tests/core/test_engine_core_unit.py",
    ],
}


def stage(module: str, base: Path) -> Path:
    """A fresh staging folder for ``module``: the tree under radixserve/, mutmut's config."""
    folder = base / Path(module).stem
    shutil.rmtree(folder, ignore_errors=True)
    tree = folder / "radixserve"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / name)
    args = [f"radixserve/{a}" if a.startswith("tests/") else a for a in MODULES[module]]
    tests = ", ".join(json.dumps(a) for a in args)
    (folder / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        'source_paths = ["radixserve"]\n'
        f'only_mutate = ["radixserve/{module}"]\n'
        f"pytest_add_cli_args_test_selection = [{tests}]\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:randomly"]\n'
        # torch is not fork-safe after use: fork each mutant from a clean server process.
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
    )
    return folder


def run(module: str, base: Path, max_children: int) -> dict[str, str]:
    folder = stage(module, base)
    mutmut = [str(Path(sys.executable).with_name("mutmut"))]
    with open(folder / "mutmut.log", "w") as log:  # progress spinners: keep them out of the way
        subprocess.run(
            [*mutmut, "run", "--max-children", str(max_children)],
            cwd=folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    out = subprocess.run(
        [*mutmut, "results", "--all", "true"],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    results: dict[str, str] = {}
    for line in out.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            results[name] = status
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=list(MODULES))
    parser.add_argument("--stage", type=Path, default=Path("/tmp/radixserve-mutation"))
    parser.add_argument("--max-children", type=int, default=2)
    args = parser.parse_args()
    summary = []
    for module in args.modules:
        results = run(module, args.stage, args.max_children)
        total = len(results)
        killed = sum(s in ("killed", "timeout", "caught by type check") for s in results.values())
        score = 100.0 * killed / total if total else 0.0
        survivors = sorted(n for n, s in results.items() if s == "survived")
        other = sorted(f"{n} ({s})" for n, s in results.items() if s not in ("killed", "survived"))
        summary.append(f"{module}: {killed}/{total} killed, {score:.1f}%")
        print(summary[-1], *(f"  survived: {n}" for n in survivors), sep="\n")
        print(*(f"  other: {n}" for n in other), sep="\n")
    print("\n".join(["", "summary:", *summary]))


if __name__ == "__main__":
    main()
