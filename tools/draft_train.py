"""What the draft trainers (tools/train_draft.py, tools/train_dflash.py) share around their
training loops: the dtypes they take, the work directory and the optimizer's schedule."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_training_options(p: argparse.ArgumentParser) -> None:
    """The options ``optimizer`` and the training loops read alike, and the saved dtype."""
    p.add_argument("--batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=0, help="training steps (overrides --epochs)")
    p.add_argument("--max-train-seconds", type=float, default=0, help="stop training after")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-dtype", default="bfloat16", choices=sorted(DTYPES))


def work_dir(args: argparse.Namespace) -> Path:
    """``--work``, else OUT/../OUT-name.work next to ``--out``; created."""
    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / f"{out.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    return work


def optimizer(
    params: Iterable[torch.nn.Parameter], args: argparse.Namespace, num_sequences: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR, int]:
    """AdamW at ``--lr``, its schedule (a 20-step warm-up, then linear decay to a tenth at the
    last step) and the number of steps: ``--steps``, else ``--epochs`` over ``num_sequences``
    in batches of ``--batch``."""
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps = args.steps or math.ceil(args.epochs * num_sequences / args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 20) * max(0.1, 1 - i / max(1, steps))
    )
    return opt, sched, steps
