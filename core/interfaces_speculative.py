"""The contract of speculative plugins (re-exported by core/interfaces.py, where every plugin
kind's contract is found): drafts, the context given at setup, the algorithm, and the
device-side cycle."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixserve.core.batch import ForwardBatch
    from radixserve.core.config import EngineConfig, ModelConfig
    from radixserve.core.memory import ReqToTokenPool


@dataclass
class Draft:
    """One request's proposed continuation: a chain of draft tokens, in order."""

    tokens: list[int]
    #: [len(tokens), vocab] float32: the distribution each token was drawn from, for rejection
    #: sampling. None when the tokens were chosen without sampling (greedy drafts, n-gram
    #: lookups); verification then treats each as certain (probability 1).
    probs: torch.Tensor | None = None
    #: [len(tokens)] int64 on the device: the tokens not yet read back (a draft model's output
    #: left where it was computed, so the verify step can start without a host sync). Until
    #: the core reads them (``core.spec_verify.read_pending``, together with the verify
    #: result), ``tokens`` holds as many placeholders: only its length counts.
    pending: torch.Tensor | None = None
    #: a tree draft (``--speculative-eagle-topk`` > 1): each token's parent, an index into
    #: ``tokens`` or -1 for the request's last token; tokens breadth-first, siblings distinct
    #: (``core/spec_tree.py``). None: a chain.
    parents: list[int] | None = None

    @property
    def decode_rows(self) -> bool:
        """A tree: each of its rows attends as a decode (a node sees its ancestors only)."""
        return self.parents is not None


@dataclass(frozen=True)
class SpeculativeContext:
    """What a speculative algorithm may use, given once by ``setup`` before the first step."""

    config: EngineConfig
    model_config: ModelConfig
    model_path: str  # the target model's directory
    host: Any  # core.plugins.PluginHost: to build a draft model from the model plugins
    platform: Any  # the HardwarePlatform (core/interfaces.py re-exports this module)
    dtype: torch.dtype
    device: str
    attention: str  # the target's attention plugin name
    kv_size: int  # slots in the target's KV pool (a draft's own pool mirrors them)
    page_size: int
    req_to_token: ReqToTokenPool  # the target's slot table; a draft writes at the same slots
    eos_token_ids: tuple[int, ...]
    #: the target CausalLM itself, for drafters that share its modules (a draft head reads the
    #: target's token embedding); None where no model is at hand
    target_model: Any = None
    #: how often the pages of the given slots were freed (TokenAllocator.free_counts): a
    #: drafter whose KV at a position depends only on the tokens up to it may reuse what it
    #: wrote at a slot for another request sharing the prefix (the radix cache), while the
    #: count has not moved since; None where not available
    free_counts: Callable[[torch.Tensor], torch.Tensor] | None = None


class SpeculativeAlgorithm(ABC):
    """Proposes draft tokens that the target model verifies in one extend-like step.

    Per step, for the decoding requests that speculate (each with nothing pending, in DECODE):
    ``propose`` returns each one's draft; the core checks drafts against the request's grammar
    and budget, runs the target once over [last token, *draft] per request, accepts the longest
    verified prefix (greedy) or by rejection sampling, commits the accepted tokens plus one
    from the target, frees the KV of rejected positions and calls ``verified``.

    KV: when ``propose`` runs, a request's target KV covers positions ``[0, req.kv_len)``; its
    last token (``req.output_ids[-1]`` or the prompt's last) sits at position ``req.kv_len``,
    and the slots of positions ``req.kv_len .. req.kv_len + max_drafts[i]`` are allocated in
    ``context.req_to_token.table[req.req_pool_idx]``. A drafter with its own KV pool (same
    size as the target's, indexed by the same slots) may write at any allocated position and
    must not write elsewhere. Slots of positions at or past the new ``req.kv_len`` after
    verification are freed and may go to other requests; slots below it can be replaced when
    the prefix cache merges duplicates, so a drafter that keeps KV should check that the slots
    it wrote are still the row's before it trusts them.

    Target features: a drafter that reads the target's hidden states names the layers in
    ``capture_hidden_layers``; every target forward then keeps those layers' outputs for every
    new token and hands the batch to ``target_hidden`` right after the forward (prefill
    chunks, decodes and verify steps alike, rejected draft positions included: their slots
    are freed after verification and rewritten by the next forward that takes them).
    """

    #: target layers whose outputs (the residual stream after the layer) ``target_hidden``
    #: receives; empty: none are kept, at no cost
    capture_hidden_layers: tuple[int, ...] = ()
    #: ``target_hidden`` is device work only (no host sync, no host-side state, rows written
    #: at ``batch.out_cache_loc``), so a step executor that replays CUDA graphs may capture it
    #: inside them, where padding rows write slot 0 (the pools' padding row)
    target_hidden_capturable: bool = False

    def memory_needs(self, config: EngineConfig, host: Any, dtype: torch.dtype) -> tuple[int, int]:
        """(bytes of weights, KV bytes per KV-pool slot) that ``setup`` will allocate on the
        device, asked before the target's KV pool is sized so the pool leaves room for them
        (e.g. a draft model and its own pool with one slot per target slot)."""
        return 0, 0

    def setup(self, context: SpeculativeContext) -> None:  # noqa: B027 - optional hook
        """Called once before the first step (build a draft model here)."""

    @abstractmethod
    def propose(self, reqs: Sequence[Any], max_drafts: Sequence[int]) -> list[Draft]:
        """Up to ``max_drafts[i]`` draft tokens for ``reqs[i]`` (a ``core.request.Req``: read
        ``input_ids``, ``output_ids``, ``sampling``, ``rid``, ``req_pool_idx``, ``kv_len``).
        An empty draft means "decode normally"."""

    #: ``propose_trees`` drafts trees (``Draft.parents``) for ``--speculative-eagle-topk`` > 1
    drafts_trees: bool = False

    def propose_trees(
        self, reqs: Sequence[Any], max_depths: Sequence[int], max_nodes: Sequence[int]
    ) -> list[Draft]:
        """``propose`` where some requests may draft trees: ``reqs[i]`` gets a tree of at most
        ``max_nodes[i]`` tokens and depth ``max_depths[i]`` (or a chain of at most that
        length), or, where ``max_nodes[i]`` is 0, a chain as ``propose`` drafts. The slots of
        positions ``req.kv_len .. req.kv_len + max(max_nodes[i], max_depths[i])`` are
        allocated; node j of a tree will take the slot of position ``req.kv_len + 1 + j``.
        Only plugins with ``drafts_trees`` are asked."""
        raise NotImplementedError

    def verified(self, reqs: Sequence[Any], num_accepted: Sequence[int]) -> None:  # noqa: B027
        """After the step: ``num_accepted[i]`` of ``reqs[i]``'s draft tokens were kept (its
        output grew by that plus one; ``req.kv_len`` is updated)."""

    def target_hidden(self, batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """After each target forward, when ``capture_hidden_layers`` is not empty:
        ``batch.hidden_states[layer]`` is [T, hidden] for the T new tokens, which were written
        at ``batch.out_cache_loc`` (their positions in ``batch.positions``)."""

    def release(self, rid: str) -> None:  # noqa: B027 - optional hook
        """Request ``rid`` finished, was aborted or retracted: drop its state (a retracted
        request comes back with no KV and is proposed for afresh)."""

    def device_cycle(self, verify: TargetVerify, max_batch: int) -> DeviceCycle | None:
        """A whole speculative cycle that runs from state on the device (core/spec_loop.py),
        for greedy requests, at most ``max_batch`` of them; None (the default): not offered.
        ``verify`` runs the target over verify rows given as device tensors."""
        return None


class TargetVerify(ABC):
    """The target's forward over ``q_len`` verify rows per request, from device tensors only:
    token ids, positions and KV slots [bs * q_len], table rows and sequence lengths after the
    rows [bs] (int32). Returns every row's logits; capturable in a CUDA graph where the
    attention backend prepares from device tensors."""

    @abstractmethod
    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        q_len: int,
    ) -> torch.Tensor: ...


class DeviceCycle(ABC):
    """Speculation whose cycle (propose k drafts, verify them with the target, accept the
    greedy prefix, advance) runs from state kept on the device, so the host may queue the next
    cycle before it reads this one's tokens (core/spec_loop.py drives it)."""

    k: int  # drafts a cycle proposes per request
    max_batch: int  # requests a cycle takes at most

    @abstractmethod
    def begin(self, reqs: Sequence[Any]) -> None:
        """Load ``reqs``' state (lengths, recent tokens) onto the device; their last tokens
        are on the host and positions kv_len .. kv_len + 2(k + 1) - 1 have slots."""

    @abstractmethod
    def launch(self) -> Callable[[], list[list[int]]]:
        """Queue one cycle; return what waits for its result: per request, the k + 1 target
        tokens t0..tk and then the number a of drafts accepted (t0..ta are its new tokens)."""

    @abstractmethod
    def end(self, reqs: Sequence[Any], trusted: Sequence[int]) -> None:
        """The loop is over for ``reqs`` (their ``kv_len`` is committed): the drafter's own
        record of them must hold again; ``trusted[i]``: positions of draft KV written from the
        target's features by the last cycle committed."""
