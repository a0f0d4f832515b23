"""A third-party speculative plugin for tests, installed through its entry point like any
package (``model_gate.install_plugin(site, "radixserve_test_drafters")``), so the server's
engine process loads it the real way; in-process Engine tests can pass the module itself to
``PluginHost(extra_plugins=[...])``.

``test_lookback`` drafts without a model, so that a tiny random model accepts some drafts:
it finds the latest earlier occurrence of the request's last token in its history (prompt and
output) and proposes the tokens that followed it; with no earlier occurrence it proposes the
last token repeated. Greedy decoding of a small random model soon cycles, and then the drafts
are accepted. It always proposes a full draft (``max_drafts[i]`` tokens, padded with the last
token), so every decode step of a request that may speculate verifies a draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import radixserve
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm

NAME = "test_lookback"
DRAFT_TOKENS = 3  # the draft length tests run it with (tests/entrypoints/conftest.py)


def lookback_draft(history: Sequence[int], limit: int) -> list[int]:
    """What followed the latest earlier occurrence of ``history[-1]``, padded to ``limit`` with
    the last token."""
    last = history[-1]
    draft: list[int] = []
    for j in range(len(history) - 2, -1, -1):
        if history[j] == last:
            draft = list(history[j + 1 : j + 1 + limit])
            break
    return draft + [draft[-1] if draft else last] * (limit - len(draft))


class LookbackDrafter(SpeculativeAlgorithm):
    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        return [
            Draft(lookback_draft([*r.input_ids, *r.output_ids], k))
            for r, k in zip(reqs, max_drafts, strict=True)
        ]


@radixserve.hookimpl
def register_speculative_algorithms(register: Any) -> None:
    register(NAME, LookbackDrafter, description="test: drafts what followed the last token")
