"""Pipeline parallelism's step: each step's requests go through the stages as micro-batches in
flight at once, so the stages overlap.

Every rank gets the whole step from rank 0 first (``core/tp_step.py``'s broadcast, over all
ranks), then cuts it the same way into up to ``pp_size`` micro-batches of disjoint requests
(contiguous runs of the step's requests, even in new tokens; ``split_batch``). A stage runs its
layers over micro-batch i and sends the residual stream [tokens, hidden] to the same
tensor-parallel rank of the next stage (``torch.distributed`` send/recv: gloo on the CPU, NCCL
on GPUs), then goes on with micro-batch i + 1 while the next stage works on i. The last stage's
tensor-parallel rank 0 sends each micro-batch's logits rows back to rank 0, which samples. A
request's next decode is only scheduled once its tokens came back, so the micro-batches of one
step are exactly the batches that can be in flight together.

The stages are idle while rank 0 samples and schedules, and for the ``pp_size - 1`` micro-batch
slots at the start and end of each step (the pipeline's bubble): ``PipelineStep.stats`` counts
each stage's busy time and the wall time over its steps.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ModelConfig
from radixserve.core.parallel import PipelineStage

Step = Callable[[ForwardBatch], torch.Tensor]


def split_batch(batch: ForwardBatch, parts: int) -> list[tuple[ForwardBatch, int]]:
    """``batch`` cut into up to ``parts`` micro-batches of contiguous requests, as even in new
    tokens as the requests allow; each with its number of logits rows (their rows of the
    step's logits follow each other in order). One part where the logits rows are not in
    token order."""
    extend = batch.extend_lens
    rows = batch.logits_indices.tolist()
    parts = min(parts, len(extend))
    if parts <= 1 or any(a > b for a, b in zip(rows, rows[1:], strict=False)):
        return [(batch, len(rows))]
    total, bounds, acc = sum(extend), [0], 0
    for r, n in enumerate(extend[:-1]):
        acc += n
        if len(bounds) < parts and acc * parts >= total * len(bounds):
            bounds.append(r + 1)
    bounds.append(len(extend))
    out = []
    t0 = 0
    for r0, r1 in zip(bounds, bounds[1:], strict=False):
        t1 = t0 + sum(extend[r0:r1])
        a, b = bisect.bisect_left(rows, t0), bisect.bisect_left(rows, t1)
        part = replace(
            batch,
            input_ids=batch.input_ids[t0:t1],
            positions=batch.positions[t0:t1],
            out_cache_loc=batch.out_cache_loc[t0:t1],
            req_pool_indices=batch.req_pool_indices[r0:r1],
            seq_lens=batch.seq_lens[r0:r1],
            extend_lens=extend[r0:r1],
            num_decode=max(0, min(batch.num_decode, r1) - r0),
            logits_indices=batch.logits_indices[a:b] - t0,
        )
        out.append((part, b - a))
        t0 = t1
    return out


class PipelineStep:
    """One stage's step executor (every rank of the stage runs one): the stage's own eager
    step (``run``: attention prepared, this stage's layers) over each micro-batch, between
    receiving it from the stage before and sending it on. On rank 0 it returns the step's
    logits, received from the last stage; elsewhere what this stage computed last."""

    def __init__(
        self,
        run: Step,
        stage: PipelineStage,
        rank: int,
        tp_size: int,
        config: ModelConfig,
        dtype: torch.dtype,
        device: str,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        """``synchronize``: waits for the device (an asynchronous one), so that the stage's
        busy time is the device's, not the host's time to queue the work."""
        self.run = run
        self.synchronize = synchronize
        self.stage = stage
        self.rank = rank
        self.prev = None if stage.first else rank - tp_size
        self.next = None if stage.last else rank + tp_size
        self.last_stage_rank0 = (stage.size - 1) * tp_size  # sends the logits to rank 0
        self.hidden = (config.hidden_size, dtype)
        self.vocab = config.vocab_size
        self.device = device
        self.busy_s = 0.0  # time in this stage's layers
        self.first_at: float | None = None  # when this stage's first step began
        self.last_at = 0.0  # when its last step ended

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.hidden_rows is not None or batch.capture_hidden_layers:
            raise RuntimeError(
                f"pooled hidden states (embeddings) are not served with pp_size={self.stage.size}"
            )
        began = time.perf_counter()
        if self.first_at is None:
            self.first_at = began
        parts = split_batch(batch, self.stage.size)
        sends: list[Any] = []  # (work, tensor): a tensor stays alive until its send is done
        out = torch.empty(0)
        for part, n_rows in parts:
            if self.prev is not None:
                hidden, dtype = self.hidden
                x = torch.empty((part.num_tokens, hidden), dtype=dtype, device=self.device)
                torch.distributed.recv(x, src=self.prev)
                part.stage_input = x
            start = time.perf_counter()
            out = self.run(part)
            if self.synchronize is not None:
                self.synchronize()
            self.busy_s += time.perf_counter() - start
            if self.next is not None:
                sends.append(self._send(out, self.next))
            elif self.rank == self.last_stage_rank0 and n_rows and self.rank != 0:
                sends.append(self._send(out, 0))
        if self.rank == 0:
            out = self._logits(parts)
        for work, _ in sends:
            work.wait()
        self.last_at = time.perf_counter()
        return out

    def _send(self, t: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
        t = t.contiguous()
        return torch.distributed.isend(t, dst), t

    def _logits(self, parts: list[tuple[ForwardBatch, int]]) -> torch.Tensor:
        """Rank 0: each micro-batch's logits rows from the last stage, in the step's order."""
        chunks = []
        for _, n_rows in parts:
            if n_rows:
                x = torch.empty((n_rows, self.vocab), dtype=torch.float32, device=self.device)
                torch.distributed.recv(x, src=self.last_stage_rank0)
                chunks.append(x)
        if not chunks:
            return torch.empty((0, self.vocab), dtype=torch.float32, device=self.device)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def stats(self) -> dict[str, float]:
        """This stage's busy time in its layers and the wall time from its first step's start
        to its last step's end (the bubble: 1 - busy / wall)."""
        wall = 0.0 if self.first_at is None else self.last_at - self.first_at
        return {"stage": float(self.stage.rank), "busy_s": self.busy_s, "wall_s": wall}


def gather_stats(world: Any, step: PipelineStep) -> list[dict[str, float]]:
    """Every rank's ``stats()``, in rank order (a collective over all ranks: each calls it once,
    after the last step)."""
    mine = step.stats()
    t = torch.tensor([mine["stage"], mine["busy_s"], mine["wall_s"]], dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(world.size)]
    torch.distributed.all_gather(out, t, group=world.cpu_group)
    return [{"stage": x[0].item(), "busy_s": x[1].item(), "wall_s": x[2].item()} for x in out]


def model_dtype(model: Any) -> torch.dtype:
    """The dtype of ``model``'s first floating-point parameter (its residual stream's)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype  # type: ignore[no-any-return]
    return torch.float32
