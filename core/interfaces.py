"""The abstract contract of each plugin kind.

The core talks to plugins only through these bases. Each docstring states the rules an
implementation must keep. Torch appears here only as a tensor type; device-specific code lives in
the plugins.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from radixserve.core.batch import ForwardBatch
    from radixserve.core.memory import KVPool

PLUGIN_KINDS = ("hardware", "attention", "model", "grammar", "speculative", "kv_transfer")


class HardwarePlatform(ABC):
    """A device family (cpu, cuda, rocm, ...). Chooses defaults for the other plugin kinds."""

    name: str
    #: torch device string, e.g. "cpu" or "cuda:0"
    device: str

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """Weights and KV dtype when the user does not choose one."""

    @abstractmethod
    def default_plugins(self) -> dict[str, str]:
        """Default implementation name per plugin kind (e.g. {"attention": "torch_native"})."""

    @abstractmethod
    def kv_cache_bytes(self, weight_bytes: int, mem_fraction: float) -> int:
        """Bytes to give the KV pool after ``weight_bytes`` of weights are loaded."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous devices)."""

    def seed_everything(self, seed: int) -> None:
        """Seed the device's random generators."""


class AttentionBackend(ABC):
    """Paged attention over the shared KV pool.

    Rules: ``prepare`` runs once per step before the model and may build index tensors that all
    layers reuse; ``forward`` first writes the new tokens' K/V into the pool at
    ``batch.out_cache_loc`` and then attends, causally, each new token to its request's cached
    prefix and to the new tokens before it (and itself).
    """

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-step metadata (KV index lists, masks) shared by all layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens.

        Returns [T, num_heads * head_dim].
        """


class CausalLM(ABC):
    """A model architecture written for batched, paged inference."""

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; return logits [len(batch.logits_indices), vocab] in float32."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume (HF-style name, tensor) pairs; raise on a missing or unexpected tensor."""


class Grammar(ABC):
    """A compiled grammar's matcher for one request (state lives on the control side).

    Rules: ``rollback(k)`` undoes exactly the last k accepted tokens; ``fill_bitmask`` writes
    only row ``index`` of the batch bitmask.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False if the token breaks the grammar (state unchanged)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed-token mask of the current state into ``bitmask[index]``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar accepted a complete output."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def forced_string(self) -> str | None:
        """The unique continuation the grammar forces now (jump-forward), if any."""


class GrammarBackend(ABC):
    """Compiles grammar specs into matchers for one tokenizer."""

    @abstractmethod
    def compile(self, kind: str, spec: str) -> Grammar:
        """kind: json_schema | regex | ebnf | choices | structural_tag. Raise ValueError on a bad
        spec, naming the problem."""


class SpeculativeAlgorithm(ABC):
    """Proposes draft tokens that the target model verifies in one extend step."""

    @abstractmethod
    def propose(self, token_ids: list[list[int]], num_draft: int) -> list[list[int]]:
        """Draft up to ``num_draft`` next tokens per request given its tokens so far."""


class KVConnector(ABC):
    """Moves KV pages between engines (prefill/decode disaggregation)."""

    @abstractmethod
    def register_buffers(self, kv_pool: KVPool) -> None:
        """Make the pool's per-layer buffers addressable for transfer."""

    @abstractmethod
    def send(self, request_id: str, kv_indices: Any, peer: str) -> None:
        """Send the KV slots ``kv_indices`` of ``request_id`` to ``peer``."""

    @abstractmethod
    def receive(self, request_id: str, kv_indices: Any) -> bool:
        """Poll for ``request_id``'s KV into ``kv_indices``; True once complete."""
