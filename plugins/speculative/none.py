"""Speculative algorithm ``none``: plain one-token-per-step decoding."""

from __future__ import annotations

from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import SpeculativeAlgorithm


class NoSpeculation(SpeculativeAlgorithm):
    def propose(self, token_ids: list[list[int]], num_draft: int) -> list[list[int]]:
        return [[] for _ in token_ids]


@hookimpl
def register_speculative_algorithms(register) -> None:  # type: ignore[no-untyped-def]
    register("none", NoSpeculation, description="speculative decoding off")
