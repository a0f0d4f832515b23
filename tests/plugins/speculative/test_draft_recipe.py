"""The draft-head recipe's data and resumption (tools/draft_data.py, tools/train_draft.py):
the ``varied`` prompt set adds multi-turn and long-answer workloads without changing the
others' prompts (so held-out sets stay held out), and training stopped after some steps and
resumed from its checkpoint ends with the same head as training straight through."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from radixserve.tools.draft_data import build_prompts, messages_of


def test_varied_prompts_add_multiturn_and_long_answers() -> None:
    large = build_prompts(12, seed=0, large=True)
    varied = build_prompts(12, seed=0, varied=True)
    assert varied[: len(large)] == large  # the four workloads as before
    workloads = {i["workload"] for i in varied}
    assert workloads == {"chat", "code", "summary", "json", "multiturn", "long"}
    multi = [i for i in varied if i["workload"] == "multiturn"]
    assert len(multi) == 12 and all(i["follow_up"] for i in multi)
    assert {i["split"] for i in varied if i["workload"] in ("multiturn", "long")} == {
        "train", "heldout",
    }  # fmt: skip
    roles = [m["role"] for m in messages_of(multi[0], "An answer.")]
    assert roles == ["user", "assistant", "user"]
    assert messages_of(multi[0], None) == [{"role": "user", "content": multi[0]["prompt"]}]


def _records(vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    return [
        {"workload": "chat", "key": f"k{i}", "split": "train", "prompt": "", "greedy": True,
         "prompt_ids": [rng.randrange(3, vocab) for _ in range(12)],
         "answer_ids": [rng.randrange(3, vocab) for _ in range(20)]}
        for i in range(8)
    ]  # fmt: skip


def test_training_resumed_from_its_checkpoint_equals_training_straight(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    import radixserve.tools.train_draft as train_draft

    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    lines = "".join(json.dumps(r) + "\n" for r in _records(vocab))

    def run(name: str, steps: int, *extra: str) -> dict[str, torch.Tensor]:
        work = tmp_path / f"{name}.work"
        work.mkdir(exist_ok=True)
        data = work / "data.jsonl"
        if not data.exists():
            data.write_text(lines)
        out = tmp_path / name
        argv = ["--out", str(out), "--work", str(work), "--model", str(tiny_llama_dir),
                "--phases", "train", "--tiny", "--steps", str(steps), "--batch", "2",
                "--draft-vocab", "64", "--save-dtype", "float32", "--aux-layers", "0,1,1",
                *extra]  # fmt: skip
        assert train_draft.main(argv) == 0
        return load_file(str(out / "model.safetensors"))

    straight = run("straight", 6)
    run("resumed", 6, "--run-steps", "3")  # stopped halfway (as by --max-train-seconds)
    ckpt = torch.load(tmp_path / "resumed.work" / "train-eagle3.ckpt.pt", weights_only=False)
    assert ckpt["step"] == 3
    resumed = run("resumed", 6, "--resume")
    assert set(resumed) == set(straight)
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name
    # without --resume a run starts over, whatever checkpoint the work directory holds
    run("again", 6, "--run-steps", "2")
    fresh = run("again", 6)
    assert all(torch.equal(fresh[n], t) for n, t in straight.items())
