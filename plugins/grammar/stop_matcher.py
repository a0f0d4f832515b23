"""A Grammar base for libraries whose matcher does not count the final stop token as a step
(outlines-core, llguidance): the stop token, termination and exact rollback are kept here."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable

import torch

from radixserve.core.interfaces import Grammar


class StopTokenMatcher(Grammar):
    """Subclasses advance, undo, fill and answer "may the output end here?" natively."""

    def __init__(self, stop_token_ids: Iterable[int]) -> None:
        self.stop_token_ids = frozenset(stop_token_ids)
        self.terminated = False
        self._stops: list[bool] = []  # per accepted token: was it the terminating stop token?

    @abstractmethod
    def _advance(self, token_id: int) -> bool:
        """Consume a non-stop token natively; False (state unchanged) if it breaks the grammar."""

    @abstractmethod
    def _undo(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` natively consumed tokens."""

    @abstractmethod
    def _can_stop(self) -> bool:
        """True when the output so far is complete."""

    @abstractmethod
    def _fill_row(self, row: torch.Tensor) -> None:
        """Write the allowed non-stop tokens into ``row`` (stop bits are fixed afterwards)."""

    def accept_token(self, token_id: int) -> bool:
        if self.terminated:
            return False
        if token_id in self.stop_token_ids:
            if not self._can_stop():
                return False
            self.terminated = True
            self._stops.append(True)
            return True
        if not self._advance(token_id):
            return False
        self._stops.append(False)
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._stops):
            raise ValueError(f"cannot roll back {num_tokens} tokens; {len(self._stops)} accepted")
        if num_tokens == 0:
            return
        undone = self._stops[-num_tokens:]
        del self._stops[-num_tokens:]
        if undone[-1]:
            self.terminated = False
        native = undone.count(False)
        if native:
            self._undo(native)

    def is_terminated(self) -> bool:
        return self.terminated

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        if self.terminated:
            row.zero_()
            return
        self._fill_row(row)
        self.fix_stop_bits(row)

    def fix_stop_bits(self, row: torch.Tensor) -> None:
        """After the library filled ``row``: the stop tokens are allowed exactly when the output
        may end here (for backends that fill many rows in one library call)."""
        allow = self._can_stop()
        for token_id in self.stop_token_ids:
            if token_id < row.numel() * 32:
                _set_bit(row, token_id, allow)


def _set_bit(row: torch.Tensor, token_id: int, value: bool) -> None:
    word = int(row[token_id >> 5]) & 0xFFFFFFFF
    bit = 1 << (token_id & 31)
    word = word | bit if value else word & ~bit
    row[token_id >> 5] = word - (1 << 32) if word >= 1 << 31 else word
