"""The worked example of docs/plugins.md (``device_cycle``): a drafter that proposes its
request's last token k times, from the host and as a cycle on the device. A small random model
that starts repeating itself accepts them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import DeviceCycle, Draft, SpeculativeAlgorithm, TargetVerify


class Repeat(SpeculativeAlgorithm):
    def setup(self, context: Any) -> None:
        self.context = context

    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        pairs = zip(reqs, max_drafts, strict=True)
        return [Draft([(r.output_ids or r.input_ids)[-1]] * m) for r, m in pairs]

    def device_cycle(self, verify: TargetVerify, max_batch: int) -> DeviceCycle:
        return RepeatCycle(self.context, verify, max_batch)


class RepeatCycle(DeviceCycle):
    def __init__(self, context: Any, verify: TargetVerify, max_batch: int) -> None:
        self.context, self.verify = context, verify
        self.k, self.max_batch = context.config.draft_depth, max_batch
        self.table = context.req_to_token.device_table(context.device)  # slots by position
        # The state the cycles advance on the device: table row, KV length, last token.
        self.rows = torch.zeros(max_batch, dtype=torch.int32, device=context.device)
        self.kv_lens = torch.zeros(max_batch, dtype=torch.int32, device=context.device)
        self.last = torch.zeros(max_batch, dtype=torch.int64, device=context.device)
        self.steps = torch.arange(self.k + 1, device=context.device)

    def begin(self, reqs: Sequence[Any]) -> None:
        self.bs = len(reqs)
        state = [[r.req_pool_idx, r.kv_len, (r.output_ids or r.input_ids)[-1]] for r in reqs]
        state_t = torch.tensor(state, device=self.last.device).T
        self.rows[: self.bs] = state_t[0]
        self.kv_lens[: self.bs] = state_t[1]
        self.last[: self.bs] = state_t[2]

    def launch(self) -> Callable[[], list[list[int]]]:
        bs, q = self.bs, self.k + 1
        rows, lens, last = self.rows[:bs], self.kv_lens[:bs], self.last[:bs]
        positions = lens.long()[:, None] + self.steps  # kv_len .. kv_len + k
        ids = last[:, None].expand(bs, q)  # the last token, then k drafts of it
        slots = self.table[rows.long()[:, None], positions].long()
        flat = (ids.reshape(-1), positions.reshape(-1), slots.reshape(-1))
        logits = self.verify(*flat, rows, lens + q, q)
        target = logits.argmax(dim=-1).view(bs, q)  # t0..tk
        accepted = (target[:, :-1] == last[:, None]).int().cumprod(dim=1).sum(dim=1)
        last.copy_(target.gather(1, accepted[:, None]).squeeze(1))  # t[a], the next input
        lens.add_(accepted.to(lens.dtype) + 1)
        out = torch.cat([target, accepted[:, None]], dim=1)
        return self.context.platform.copy_to_host_async(out)

    def end(self, reqs: Sequence[Any], trusted: Sequence[int]) -> None:
        pass  # no state of its own beside the cycle's


class RepeatPlugin:
    @hookimpl
    def register_speculative_algorithms(self, register: Any) -> None:
        register("repeat", Repeat, description="drafts the last token k times")
