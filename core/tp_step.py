"""The per-step broadcast of tensor parallelism: rank 0 sends each step's forward inputs, the
other ranks run the same forward on their share of the weights.

Only rank 0 schedules (its decisions may depend on measured step times, e.g. speculation's
payoff pausing, so replaying the scheduler on every rank would not stay in step). What a
forward needs beyond the model is small and sent every step as flat int64 tensors:

- a fixed header of ``HEADER`` ints: kind (STEP/STOP), tokens, requests, logits rows, decodes,
  slot-table writes, pooled rows, whether the host metadata is inline;
- host metadata over the gloo group: request rows, sequence lengths, extend lengths, and the
  req->token table writes since the last step (positions and values), so every rank's copy of
  the table, which attention reads, stays the leader's;
- per-token tensors over the device group (input ids, positions, KV slots, logits rows, pooled
  rows), from the leader's device tensors as they are (on a CPU device they ride with the host
  metadata: one broadcast fewer).

The header travels in a fixed message of ``MESSAGE`` ints that also carries the host metadata
when it fits (every decode step of a usual batch): a gloo broadcast waits for the other ranks
to be ready to receive, so each message is a round trip between processes. No pickle: one
broadcast of host ints (two for large steps) and, off the CPU, one of device ints per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.interfaces import ReleasesCapture, UniformRows
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.core.parallel import TensorParallel

logger = logging.getLogger(__name__)

STEP, STOP = 1, 2
HEADER = 8
#: ints of the fixed first message: the header, then the host metadata when it fits
MESSAGE = 2048
_I64 = torch.int64


class StepBroadcaster:
    """Rank 0's step executor: broadcast the step's inputs, then run it here too."""

    def __init__(
        self,
        tp: TensorParallel,
        req_to_token: ReqToTokenPool,
        device: str,
        step: Callable[[ForwardBatch], torch.Tensor],
    ) -> None:
        self.tp = tp
        self.req_to_token = req_to_token
        self.on_host = torch.device(device).type == "cpu"
        self.run = step
        # what the step executor declares (UniformRows) holds for the broadcast step too
        self.uniform_verify = isinstance(step, UniformRows) and bool(step.uniform_verify)
        self.stopped = False
        req_to_token.record_writes()

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        self.send(batch)
        return self.run(batch)

    def send(self, batch: ForwardBatch) -> None:
        where, values = self.req_to_token.take_writes()
        hidden = batch.hidden_rows
        n_hidden = 0 if hidden is None else int(hidden.numel())
        t, n_logits = batch.num_tokens, int(batch.logits_indices.numel())
        header = [STEP, t, batch.batch_size, n_logits, batch.num_decode, len(where), n_hidden]
        host = [
            batch.req_pool_indices.to(_I64),
            torch.tensor(batch.seq_lens, dtype=_I64),
            torch.tensor(batch.extend_lens, dtype=_I64),
            where,
            values,
        ]
        dev = [batch.input_ids, batch.positions, batch.out_cache_loc, batch.logits_indices]
        if hidden is not None:
            dev.append(hidden)
        dev = [d.to(_I64) for d in dev]
        if self.on_host:
            host += dev
        payload = torch.cat(host)
        message = torch.zeros(MESSAGE, dtype=_I64)
        inline = HEADER + payload.numel() <= MESSAGE
        message[:HEADER] = torch.tensor(header + [int(inline)], dtype=_I64)
        if inline:
            message[HEADER : HEADER + payload.numel()] = payload
        self._broadcast(message, self.tp.cpu_group)
        if not inline:
            self._broadcast(payload, self.tp.cpu_group)
        if not self.on_host:
            self._broadcast(torch.cat(dev), self.tp.group)

    def stop(self) -> None:
        """Tell the other ranks to leave their step loop (once)."""
        if self.stopped:
            return
        self.stopped = True
        message = torch.zeros(MESSAGE, dtype=_I64)
        message[0] = STOP
        self._broadcast(message, self.tp.cpu_group)

    def _broadcast(self, t: torch.Tensor, group: Any) -> None:
        torch.distributed.broadcast(t, 0, group=group)


def release_step(step: Any) -> None:
    """Before the group is left: let the step executor (under rank 0's broadcaster) free what
    it captured, e.g. CUDA graphs holding collectives, if it has a ``release()``."""
    inner = step.run if isinstance(step, StepBroadcaster) else step
    if isinstance(inner, ReleasesCapture):
        inner.release()


def follow_steps(
    tp: TensorParallel,
    req_to_token: ReqToTokenPool,
    kv_pool: KVPool,
    device: str,
    step: Callable[[ForwardBatch], torch.Tensor],
) -> int:
    """A non-zero rank's loop: receive each step and run it, until rank 0 says STOP.
    Returns the number of steps run."""
    on_host = torch.device(device).type == "cpu"
    steps = 0
    while True:
        message = torch.empty(MESSAGE, dtype=_I64)
        torch.distributed.broadcast(message, 0, group=tp.cpu_group)
        kind, t, b, n_logits, num_decode, n_writes, n_hidden, inline = message[:HEADER].tolist()
        if kind == STOP:
            return steps
        n_dev = 3 * t + n_logits + n_hidden
        n_host = 3 * b + 2 * n_writes + (n_dev if on_host else 0)
        if inline:
            host = message[HEADER : HEADER + n_host]
        else:
            host = torch.empty(n_host, dtype=_I64)
            torch.distributed.broadcast(host, 0, group=tp.cpu_group)
        if on_host:
            dev = host[3 * b + 2 * n_writes :]
        else:
            dev = torch.empty(n_dev, dtype=_I64, device=device)
            torch.distributed.broadcast(dev, 0, group=tp.group)
        rows, seq_lens, extend_lens = host[: 3 * b].view(3, b)
        writes = host[3 * b : 3 * b + 2 * n_writes].view(2, n_writes)
        req_to_token.apply_writes(writes[0], writes[1])
        req_to_token.sync()
        batch = ForwardBatch(
            input_ids=dev[:t],
            positions=dev[t : 2 * t],
            out_cache_loc=dev[2 * t : 3 * t],
            req_pool_indices=rows.clone(),
            req_to_token=req_to_token.table,
            seq_lens=seq_lens.tolist(),
            extend_lens=extend_lens.tolist(),
            num_decode=num_decode,
            logits_indices=dev[3 * t : 3 * t + n_logits],
            kv_pool=kv_pool,
            req_to_token_pool=req_to_token,
            hidden_rows=dev[3 * t + n_logits :] if n_hidden else None,
        )
        try:
            step(batch)
        except Exception:  # noqa: BLE001 - rank 0 fails the same step's requests and goes on
            # (EngineCore._fail_batch); a rank that ended here would take the server down
            logger.exception("rank %d: a step failed; rank 0 fails its requests", tp.rank)
        steps += 1
