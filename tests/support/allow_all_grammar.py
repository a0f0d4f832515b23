"""A grammar matcher that allows every token and never ends: for tests that only need a row to
be constrained (the sampler, the grammar queue), not any real grammar."""

from __future__ import annotations

import torch

from radixserve.core.interfaces import Grammar


class AllowAllGrammar(Grammar):
    def accept_token(self, token_id: int) -> bool:
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].fill_(-1)

    def is_terminated(self) -> bool:
        return False

    def rollback(self, num_tokens: int) -> None:
        pass

    def forced_string(self) -> str:
        return ""

    def copy(self) -> Grammar:
        return type(self)()
