"""Capabilities a plugin may offer beyond its base class (re-exported by core/interfaces.py,
where every plugin kind's contract is found): each a Protocol, checked once with isinstance
where the core needs it, never probed by attribute name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from radixserve.core.batch import ForwardBatch


@runtime_checkable
class KeepsHiddenLayers(Protocol):
    """A step executor (``HardwarePlatform.step_executor``) that can keep target layers'
    outputs on its fast path (captured graphs). Checked once when the runner starts."""

    def keep_hidden_layers(
        self, layers: tuple[int, ...], consumer: Callable[[ForwardBatch], None] | None = None
    ) -> None: ...


@runtime_checkable
class UniformRows(Protocol):
    """A step executor whose steps with extra rows are much faster when every request has as
    many (``uniform_verify``: it replays graphs of one length). Checked once at start-up."""

    uniform_verify: bool


@runtime_checkable
class ReleasesCapture(Protocol):
    """A step executor holding captured work (CUDA graphs with collectives) that must be let
    go before its process group is left: ``release()`` frees it. Checked at close."""

    def release(self) -> None: ...


@runtime_checkable
class ShardedModel(Protocol):
    """A model plugin that can run with several ranks declares how its checkpoint's tensors
    shard: ``tp_plan`` maps HF tensor-name patterns to a kind of ``core.parallel.SHARD_KINDS``
    (None: it cannot be sharded)."""

    tp_plan: dict[str, str] | None


@runtime_checkable
class KeepsWeightCopies(Protocol):
    """A module that keeps a copy of its weights (e.g. repacked for a kernel by the hardware
    platform): a weight reload calls ``weights_reloaded()`` to rebuild it."""

    def weights_reloaded(self) -> None: ...


@runtime_checkable
class BatchInvariant(Protocol):
    """An attention backend or a model that can compute each row independently of what else
    shares its step (--enable-deterministic-inference, core/deterministic.py): a row's result
    then depends on its own inputs only, not on the batch's size, the prefix cache or the
    prefill chunking. ``set_batch_invariant()`` switches it once, before the first step."""

    def set_batch_invariant(self) -> None: ...


@runtime_checkable
class WaitsForKVLayers(Protocol):
    """A model plugin whose eager forward calls ``batch.kv_pool.wait_layer(layer)`` before each
    layer's attention reads its KV (HiCache: the prefix loaded from host memory then overlaps
    the step's earlier layers; a model without it waits for the whole load first).
    ``waits_for_kv_layers`` True declares it. Checked once when the runner starts."""

    waits_for_kv_layers: bool


@runtime_checkable
class CopiesHostKVLayers(Protocol):
    """A hardware platform with a kernel that gathers KV rows of one layer from pinned host
    memory into the device pool (HiCache's per-layer loads): ``host_kv_layer_copy()`` returns
    ``copy(src_k, src_v, src_rows, dst_k, dst_v, dst_rows)`` (``dst_k[dst_rows] =
    src_k[src_rows]``, the same for V; rows as device int64 tensors; ``src_*`` host views with
    a row stride, ``dst_*`` contiguous device buffers), or None where it has none."""

    def host_kv_layer_copy(self) -> Callable[..., None] | None: ...


@dataclass(frozen=True, slots=True)
class StepCapabilities:
    """What the step executor offers (``KeepsHiddenLayers``, ``UniformRows``), read once."""

    uniform_rows: bool = False
    keep_hidden_layers: Callable[..., None] | None = None

    @staticmethod
    def of(step: object) -> StepCapabilities:
        keep = step.keep_hidden_layers if isinstance(step, KeepsHiddenLayers) else None
        uniform = isinstance(step, UniformRows) and bool(step.uniform_verify)
        return StepCapabilities(uniform, keep)
