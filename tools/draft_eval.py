"""tools/train_draft.py's eval and speed phases: the engine with a trained head on the
held-out prompts."""

from __future__ import annotations

import argparse
import time
from typing import Any

from radixserve.tools.draft_data import WORKLOADS

# -- eval: acceptance on held-out prompts -------------------------------------------------------


def evaluate(
    args: argparse.Namespace, records: list[dict[str, Any]], head_dir: str, algorithm: str
) -> dict:
    """Acceptance length per workload over the held-out prompts (greedy), with every step
    drafting the configured length: at most ``FULL_DRAFT_BATCH`` requests run at once, since
    the core shortens drafts above it (at 20 running, 3 drafts became 1 and the accept length
    read 1.5-1.9 where 8 at once gave the head's own); with ``--eagle-topk`` > 1, trees of
    ``--num-draft-tokens`` - 1 nodes and depth ``--num-steps``, at most ``TREE_BATCH`` at
    once."""
    from radixserve import Engine
    from radixserve.core.spec_tree import TREE_BATCH
    from radixserve.core.speculative import FULL_DRAFT_BATCH

    held = [r for r in records if r["split"] == "heldout" and r["greedy"]]
    result: dict[str, Any] = {}
    running = min(args.gen_batch, FULL_DRAFT_BATCH)
    shape: dict[str, Any] = {"speculative_num_draft_tokens": args.num_draft_tokens}
    if args.eagle_topk > 1:  # trees: while at most TREE_BATCH requests draft
        running = min(running, TREE_BATCH)
        shape.update(speculative_eagle_topk=args.eagle_topk, speculative_num_steps=args.num_steps)
    with Engine(
        args.model, dtype=args.engine_dtype, max_running_requests=running,
        speculative_algorithm=algorithm, speculative_draft_model_path=head_dir,
        speculative_disable_pause=True, speculative_disable_batch_size=FULL_DRAFT_BATCH, **shape,
    ) as eng:  # fmt: skip
        for workload in WORKLOADS:
            part = [r for r in held if r["workload"] == workload][: args.eval_prompts]
            if not part:
                continue
            outs = eng.generate(
                input_ids=[r["prompt_ids"] for r in part],
                sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens},
            )
            verifies = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
            accepted = sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs)
            # (over the common length: the answers may have been generated longer or shorter)
            same = sum(
                o["output_ids"][: len(r["answer_ids"])] == r["answer_ids"][: len(o["output_ids"])]
                for o, r in zip(outs, part, strict=True)
            )
            result[workload] = {
                "prompts": len(part),
                "verify_steps": verifies,
                "accepted_drafts": accepted,
                "accept_length": round((verifies + accepted) / max(1, verifies), 3),
                "outputs_equal_speculation_off": f"{same}/{len(part)}",
            }
            print(f"eval {workload}: {result[workload]}", flush=True)
    return result


def speed(args: argparse.Namespace, records: list[dict[str, Any]], head_dir: str) -> dict:
    """Batch-1 tokens/s over the first held-out prompt of each workload (``--speed-tokens``
    each, ignoring EOS): speculation off, the head (EAGLE3 or EAGLE) with the core's pause, and
    without it."""
    from radixserve import Engine

    first: dict[str, dict[str, Any]] = {}
    for r in records:
        if r["split"] == "heldout" and r["greedy"]:
            first.setdefault(r["workload"], r)
    name = args.algorithm
    spec = {"speculative_algorithm": name.upper(), "speculative_draft_model_path": head_dir,
            "speculative_num_draft_tokens": args.num_draft_tokens}  # fmt: skip
    configs = {
        "off": {},
        name: spec,
        f"{name}_no_pause": {**spec, "speculative_disable_pause": True},
    }
    params = {"temperature": 0, "max_new_tokens": args.speed_tokens, "ignore_eos": True}
    result: dict[str, Any] = {}
    for name, kw in configs.items():
        with Engine(args.model, dtype=args.engine_dtype, **kw) as eng:
            warm = {"temperature": 0, "max_new_tokens": 8}
            eng.generate(input_ids=[next(iter(first.values()))["prompt_ids"]], sampling_params=warm)
            row = {}
            for workload, r in first.items():
                t0 = time.perf_counter()
                out = eng.generate(input_ids=[r["prompt_ids"]], sampling_params=params)[0]
                seconds = time.perf_counter() - t0
                meta = out["meta_info"]
                row[workload] = {
                    "tokens_per_s": round(len(out["output_ids"]) / seconds, 2),
                    "verify_steps": meta.get("spec_verify_ct", 0),
                    "accepted_drafts": meta.get("spec_accepted_tokens", 0),
                }
            result[name] = row
            print(f"speed {name}: {row}", flush=True)
    return result
