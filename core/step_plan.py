"""The step plan: what the scheduler decides for one step, as plain data, and the step
statistics it keeps.

A plan names the requests that advance and by how many tokens (their KV slots are already
in the slot table when the plan is returned). A step strategy (core/interfaces.py,
``StepStrategy``) may give a decode entry extra rows: the entry then extends over its last
token and those rows, and its step emits a list of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.core.interfaces import Draft
from radixserve.core.stop import TopLogprobs

#: One sampled token: (token id, its logprob or None, top logprobs or None).
SampledToken = tuple[int, float | None, TopLogprobs | None]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running_requests: int
    chunked_prefill_size: int  # -1: no chunking
    schedule_policy: str
    max_context: int
    random_seed: int = 0
    # Admission reserves room for the running requests' future tokens: this share of what each
    # may still generate. It starts at init, decays to min while nothing is retracted, and jumps
    # back up after a retraction (SGLang's new_token_ratio).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.098
    new_token_ratio_decay_steps: int = 600
    # False: a step with prefill work runs it alone and the decodes wait a step (SGLang's
    # default; a decode-only step can replay a CUDA graph, a mixed one runs eagerly).
    mixed_chunk: bool = True
    # Past this many decodes in a step, its prefill tokens shrink in proportion (0: never;
    # schedule_policy.prefill_budget).
    prefill_shrink_after_decodes: int = 0
    # While decodes run and the waiting prompts would fill under the step's prefill budget,
    # admission waits up to this many steps (0: never) and at most prefill_gather_max_wait_s
    # after the oldest waiting request arrived, so that arrivals trickling in one by one share
    # one mixed step instead of making each step mixed (a decode-only step replays a CUDA
    # graph; a mixed one runs eagerly).
    prefill_gather_steps: int = 0
    prefill_gather_max_wait_s: float = 0.05
    # Requests whose uncached prompt shares at least this many tokens with one being prefilled
    # wait for that prefill to reach the cache instead of computing the same KV again.
    shared_prefill_min_tokens: int = 32
    # core/priority.py: the waiting queue in priority order, lower ranks retracted for a
    # higher one that waits; larger values first unless low_values_first; aging: one level
    # per this many steps waited
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_aging_steps: int = 100


#: What a strategy adds to a decode entry: tokens the step runs after the entry's last token
#: (a chain, or rows that attend as decodes, ``Extra.decode_rows``).
Extra = Draft


class RetractionNeeded(Exception):
    """The KV pool is too full for the running decodes; retracting needs every pending token
    committed first."""


@dataclass(slots=True)
class StepPlan:
    """The requests of one step, decodes (extend 1) first, with their new-token counts."""

    reqs: list
    extend_lens: list[int]
    num_decode: int
    # batch index -> the extra rows a strategy gave that decode entry: it extends over its
    # last token and them (1 + len(extra.tokens) new tokens) and its step emits 1 or more
    # tokens (a list)
    extra: dict[int, Extra] = field(default_factory=dict)
    kind: str = "decode"  # step_kind() of its decodes and prefill tokens


STEP_KINDS = ("decode", "mixed", "prefill")


def step_kind(num_decodes: int, prefill_tokens: int) -> str:
    """A step's kind: "decode", decodes only (what a CUDA graph can replay); "prefill",
    prefill chunks only; "mixed", both (runs eagerly)."""
    if not prefill_tokens:
        return "decode"
    return "mixed" if num_decodes else "prefill"


@dataclass(slots=True)
class StepKindStats:
    """Steps of one kind: how many, their decodes and prefill tokens, and their wall time
    (timed by the engine core: each step from its launch, or the previous step's result if
    that came later, to its own result)."""

    steps: int = 0
    decodes: int = 0
    prefill_tokens: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "decodes": self.decodes,
            "prefill_tokens": self.prefill_tokens,
            "seconds": round(self.seconds, 6),
        }


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retractions: int = 0
    preemptions: int = 0  # of the retractions, those for a higher priority (core/priority.py)
    deferred_admissions: int = 0  # times a request waited for a shared prefill (per step)
    gathering_steps: int = 0  # steps whose admission waited for more arrivals (gather)
    step_trace: list[tuple[int, int]] = field(default_factory=list)  # (decodes, prefill tokens)
    by_kind: dict[str, StepKindStats] = field(
        default_factory=lambda: {k: StepKindStats() for k in STEP_KINDS}
    )

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
