"""The rows of one step's ForwardBatch, collected entry by entry (core/model_runner.py builds
plain decodes and prefill chunks; a step strategy adds the rows of entries it extended) and
packed into device tensors with one host->device copy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.logprobs import scored_positions
from radixserve.core.memory import KVPool, ReqToTokenPool
from radixserve.core.request import Req, token_slice

_NOTHING_SCORED = range(0)


class LogitsPlan(NamedTuple):
    scored: range  # positions scored for input logprobs
    first_row: int  # logits row of scored[0]
    sample_row: int  # logits row of the entry's last new token


@dataclass(slots=True)
class StepRows:
    """Per new token: its input id, position and slot-table row; per sequence: its table row
    and length after the step; the logits rows kept, and each entry's ``LogitsPlan``."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    pool_rows: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    plans: list[LogitsPlan] = field(default_factory=list)
    # input rows whose token is the previous step's sampled id (on the device), and its row
    # there
    future_dst: list[int] = field(default_factory=list)
    future_src: list[int] = field(default_factory=list)
    # input rows whose tokens are still on the device (one tensor per entry)
    device_dst: list[int] = field(default_factory=list)
    device_tokens: list[torch.Tensor] = field(default_factory=list)
    # batch index -> how many decode rows that entry became (an entry whose rows attend as
    # decodes; ForwardBatch counts each as a sequence)
    as_decodes: dict[int, int] = field(default_factory=dict)

    def add_decode(self, req: Req) -> None:
        """A plain decode: one token at position kv_len (the hot path)."""
        start = req.kv_len
        prompt_len = len(req.input_ids)
        if req.num_pending:
            self.future_dst.append(len(self.positions))
            self.future_src.append(req.pending_row)
            self.input_ids.append(0)
        elif start >= prompt_len:
            self.input_ids.append(req.output_ids[start - prompt_len])
        else:
            self.input_ids.append(req.input_ids[start])
        row = req.req_pool_idx
        assert row is not None
        # add_decode_row, inline (once per decode and step)
        self.logits_rows.append(len(self.positions))
        self.positions.append(start)
        self.rows.append(row)
        self.pool_rows.append(row)
        self.seq_lens.append(start + 1)
        last = len(self.logits_rows) - 1
        self.plans.append(LogitsPlan(_NOTHING_SCORED, last, last))

    def add_decode_row(self, row: int, position: int) -> None:
        """One row that attends as a decode ending at ``position`` of table row ``row``; its
        input id is appended by the caller; its logits are kept."""
        self.positions.append(position)
        self.rows.append(row)
        self.pool_rows.append(row)
        self.seq_lens.append(position + 1)
        self.logits_rows.append(len(self.positions) - 1)

    def add_extend(self, req: Req, n: int) -> None:
        """A prefill chunk of ``n`` tokens from position kv_len, its scored positions' logits
        and its last token's kept."""
        start = req.kv_len
        self.input_ids += token_slice(req.input_ids, req.output_ids, start, n)
        offset = self.add_sequence(req, n)
        first = len(self.logits_rows)
        scored = scored_positions(req, start, n)
        self.logits_rows += [offset + p for p in scored]
        self.logits_rows.append(offset + start + n - 1)
        self.plans.append(LogitsPlan(scored, first, len(self.logits_rows) - 1))

    def add_sequence(self, req: Req, n: int) -> int:
        """Positions kv_len .. kv_len + n - 1 of ``req`` as one sequence (input ids appended
        by the caller). Returns the flattened row of its sequence position 0."""
        assert req.req_pool_idx is not None
        start = req.kv_len
        self.positions += range(start, start + n)
        self.rows += [req.req_pool_idx] * n
        self.pool_rows.append(req.req_pool_idx)
        self.seq_lens.append(start + n)
        return len(self.positions) - n - start

    def forward_batch(
        self,
        extend_lens: list[int],
        num_decode: int,
        table: ReqToTokenPool,
        kv_pool: KVPool,
        device: str,
        prev_ids: torch.Tensor | None,
    ) -> ForwardBatch:
        """Pack the rows into a ForwardBatch on ``device``; ``prev_ids``: the previous step's
        sampled ids there, read by the rows whose token is pending."""
        t, n_logits = len(self.positions), len(self.logits_rows)
        positions_t = torch.tensor(self.positions, dtype=torch.int64)
        out_cache_loc = table.table[torch.tensor(self.rows), positions_t]
        # One host->device copy for every per-token index of the step.
        packed = torch.cat(
            [
                torch.tensor(self.input_ids, dtype=torch.int64),
                positions_t,
                out_cache_loc,
                torch.tensor(
                    self.logits_rows + self.future_dst + self.future_src, dtype=torch.int64
                ),
                torch.tensor(self.device_dst, dtype=torch.int64),
            ]
        )
        if self.as_decodes:  # each such entry is that many decode rows, after the decodes
            lens = extend_lens
            extend_lens = []
            for i, n in enumerate(lens):
                extend_lens += [1] * self.as_decodes[i] if i in self.as_decodes else [n]
            num_decode += sum(self.as_decodes.values())
        dev = to_device(packed, device)
        input_ids_t = dev[:t]
        n_future = len(self.future_dst)
        if n_future:
            assert prev_ids is not None, "a pending token needs the previous step's ids"
            at = 3 * t + n_logits
            dst, src = dev[at : at + 2 * n_future].view(2, -1)
            input_ids_t[dst] = prev_ids[src]
        if self.device_tokens:  # tokens go device to device: no host sync before the step
            at = 3 * t + n_logits + 2 * n_future
            tokens = self.device_tokens
            input_ids_t[dev[at:]] = torch.cat(tokens) if len(tokens) > 1 else tokens[0]
        return ForwardBatch(
            input_ids=input_ids_t,
            positions=dev[t : 2 * t],
            out_cache_loc=dev[2 * t : 3 * t],
            req_pool_indices=torch.tensor(self.pool_rows, dtype=torch.int64),
            req_to_token=table.table,
            seq_lens=self.seq_lens,
            extend_lens=extend_lens,
            num_decode=num_decode,
            logits_indices=dev[3 * t : 3 * t + n_logits],
            kv_pool=kv_pool,
            req_to_token_pool=table,
        )
