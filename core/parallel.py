"""Tensor parallelism: the group a model's collectives go through, how a model's heads, MLP and
vocabulary split across the ranks, and the weight shard plan the loader applies.

One engine process per rank, each driving one device (``HardwarePlatform.bind_rank``); the
hardware plugin chooses the torch.distributed backend (nccl on CUDA, gloo on the host). Joining
the group is ``core/distributed.py``'s; rank 0 runs the scheduler and broadcasts each step's
forward inputs (``core/tp_step.py``); every rank runs the model on its share of the weights, in
lockstep.

How a model splits (``split_heads``, ``split_range``, ``vocab_shard``):
- query heads follow their KV heads. With at least as many KV heads as ranks, the KV heads are
  cut into contiguous runs as even as they come (3 KV heads on 2 ranks: 1 and 2, the smaller
  share on rank 0, which also schedules and samples), and each rank takes the query heads of
  its KV heads, so every rank keeps the model's group size and holds exactly the KV heads its
  query heads read. With fewer KV heads than ranks each KV head is
  replicated on ``size / num_kv_heads`` ranks, which split its query heads;
- the MLP's intermediate features (and any other "column"/"row" dimension) are cut evenly;
- the vocabulary is cut into equal shards of ``ceil(vocab / size)`` rows, the last one padded
  with zero rows, so the logits gather is one fixed-size all-gather.

A model plugin declares how its checkpoint tensors shard with a ``tp_plan`` (HF tensor name
patterns -> one of ``SHARD_KINDS``; see docs/plugins.md) and builds its layers at this rank's
sizes from the ``group`` (a ``TensorParallel``) its factory is given; ``shard_weights`` cuts each
tensor to this rank's slice as it is read. Nothing here is process-wide state: the group is
passed, never looked up.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from radixserve.core.config import ConfigError, ModelConfig

#: What a ``tp_plan`` entry may say about a checkpoint tensor (rows = dim 0, columns = dim 1).
#: Tensors no pattern matches are replicated on every rank.
SHARD_KINDS = {
    "q_heads": "rows of this rank's query heads (q_proj weight and bias)",
    "kv_heads": "rows of this rank's KV heads (k_proj, v_proj weight and bias)",
    "q_heads_in": "columns of this rank's query heads (o_proj weight; a 1-D bias is replicated)",
    "column": "an even cut of the rows (gate_proj, up_proj)",
    "row": "an even cut of the columns (down_proj weight; a 1-D bias is replicated)",
    "vocab": "this rank's vocabulary shard of the rows, zero-padded (embeddings, LM head)",
}


class FastAllReduce(Protocol):
    """A platform's all-reduce for the messages it does better than the backend (e.g. small
    ones over NVLink peer-to-peer; ``HardwarePlatform.fast_all_reduce``)."""

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum ``x`` over the ranks in place and return True, or return False without touching
        ``x`` when it does not take ``x``. The choice may depend only on ``x``'s shape and
        dtype, so that every rank makes the same one."""
        ...

    def close(self) -> None:
        """Free its buffers (before the group is left)."""
        ...


@runtime_checkable
class FusedAllReduceNorm(Protocol):
    """A FastAllReduce that can also add the residual and RMS-normalize in the same
    collective (``TensorParallel.all_reduce_add_rms_norm``)."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, site: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...


class TensorParallel:
    """This process's place in the tensor-parallel group and the collectives a model needs.
    With ``size == 1`` every collective is the identity and nothing is initialised."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: Any = None,
        cpu_group: Any = None,
        fast_all_reduce: FastAllReduce | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        #: this rank's pipeline stage (its run of layers), None without pipeline parallelism
        self.stage = stage
        self.group = group  # the device backend's group (nccl on CUDA, gloo on CPU)
        self.cpu_group = cpu_group  # gloo, for host-side step metadata
        self.fast_all_reduce = fast_all_reduce  # tried first; the backend's otherwise
        #: ranks a MoE's experts are spread over (1, or ``size``: --ep-size); with 1 each
        #: expert's intermediate features are cut like a dense MLP's
        self.ep_size = 1

    @property
    def fast_all_reduce(self) -> FastAllReduce | None:
        return self._fast

    @fast_all_reduce.setter
    def fast_all_reduce(self, fast: FastAllReduce | None) -> None:
        self._fast = fast
        # the fused form, resolved here once: it is called twice per layer and step
        self._fused_norm = fast if isinstance(fast, FusedAllReduceNorm) else None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (row-parallel outputs, vocab-parallel lookups)."""
        if self.size > 1:
            fast = self.fast_all_reduce
            if fast is None or not fast(x):
                torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, site: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(sum(x) + residual) * weight, sum(x) + residual) in one fused collective,
        where the platform's fast all-reduce has one (``add_rms_norm``) and takes ``x``; None
        otherwise (then the caller all-reduces and normalizes itself). ``site`` names the call
        site (0 or 1), so two calls in a row may use different buffers."""
        fused = self._fused_norm if self.size > 1 else None
        return None if fused is None else fused.add_rms_norm(x, residual, weight, eps, site)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on each rank -> [rows, size * n] on every rank, rank r's columns r-th."""
        if self.size == 1:
            return x
        rows, n = x.shape
        out = torch.empty((self.size * rows, n), dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous(), self.group)
        return out.view(self.size, rows, n).permute(1, 0, 2).reshape(rows, self.size * n)

    def all_to_all(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """Rows of ``x``, ``send[r]`` of them to rank r in rank order, exchanged for
        ``receive[r]`` rows from each rank r (expert-parallel dispatch and combine)."""
        out = x.new_empty((sum(receive), *x.shape[1:]))
        torch.distributed.all_to_all_single(out, x.contiguous(), receive, send, group=self.group)
        return out

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` any rank has (e.g. the KV pool size every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def _all_gather(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    dist = torch.distributed
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


#: the group of an engine of one rank: every collective is the identity
SINGLE = TensorParallel()


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """One pipeline stage: which contiguous run of the decoder's layers it holds (global
    layer ids ``layers.start`` .. ``layers.stop - 1``). The first stage also embeds the
    tokens, the last one applies the final norm and the LM head."""

    rank: int
    size: int
    layers: Span

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


def pipeline_stage(num_layers: int, rank: int, size: int) -> PipelineStage:
    """Stage ``rank`` of ``size``: contiguous runs of layers differing by at most one, the
    larger ones on the later stages (stage 0 also schedules, samples and embeds)."""
    if num_layers < size:
        raise ConfigError(
            f"pp_size={size} needs at least one decoder layer per stage; the model has "
            f"{num_layers}: a pp_size of at most {num_layers} works"
        )
    start, stop = num_layers * rank // size, num_layers * (rank + 1) // size
    return PipelineStage(rank, size, Span(start, stop - start))


# ---- how a model splits ----------------------------------------------------------------------


class Span(NamedTuple):
    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


class HeadSplit(NamedTuple):
    """This rank's query heads and the KV heads they read (both contiguous runs)."""

    q: Span
    kv: Span

    @property
    def num_heads(self) -> int:
        return self.q.size

    @property
    def num_kv_heads(self) -> int:
        return self.kv.size


def split_range(n: int, tp: TensorParallel) -> Span:
    """Rank ``tp.rank``'s contiguous share of ``n`` items; shares differ by at most one."""
    start, stop = n * tp.rank // tp.size, n * (tp.rank + 1) // tp.size
    return Span(start, stop - start)


def split_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
    """See the module docstring. Raises ConfigError for a layout no rule covers."""
    if tp.size == 1:
        return HeadSplit(Span(0, num_heads), Span(0, num_kv_heads))
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv = split_range(num_kv_heads, tp)
        return HeadSplit(Span(kv.start * group, kv.size * group), kv)
    copies = tp.size // num_kv_heads
    if tp.size % num_kv_heads or group % copies:
        why = (
            f"a tp_size above the KV heads must be a multiple of them ({num_kv_heads})"
            if tp.size % num_kv_heads
            else f"each KV head's {group} query heads do not divide among {copies} ranks"
        )
        raise ConfigError(
            f"tp_size={tp.size} cannot split {num_heads} query heads over {num_kv_heads} KV "
            f"heads: {why}; a tp_size of at most {num_kv_heads} works"
        )
    per = group // copies
    kv_head = tp.rank // copies
    return HeadSplit(Span(kv_head * group + (tp.rank % copies) * per, per), Span(kv_head, 1))


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[Span, int]:
    """(this rank's real vocabulary rows, the padded shard size every rank allocates)."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return Span(start, min(per, vocab_size - start)), per


def local_model_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """``config`` with this rank's head counts: what the attention backend and the KV pool
    see (each rank's pool holds only its KV heads, and only its pipeline stage's layers)."""
    if tp.stage is not None:
        config = replace(config, num_layers=tp.stage.layers.size)
    if tp.size == 1:
        return config
    split = split_heads(config.num_heads, config.num_kv_heads, tp)
    return replace(config, num_heads=split.num_heads, num_kv_heads=split.num_kv_heads)


# ---- sharding checkpoint tensors -------------------------------------------------------------


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    plan: Mapping[str, str],
    config: ModelConfig,
    tp: TensorParallel,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield each (HF name, tensor) cut to this rank's slice by the first ``plan`` pattern
    (``fnmatch`` over the name without its ``model.`` prefix) that matches it; tensors no
    pattern matches pass whole."""
    unknown = sorted(set(plan.values()) - set(SHARD_KINDS))
    if unknown:
        raise ConfigError(
            f"tp_plan kind '{unknown[0]}' is unknown; choose one of {', '.join(SHARD_KINDS)}"
        )
    if tp.size == 1:
        yield from weights
        return
    heads = split_heads(config.num_heads, config.num_kv_heads, tp)
    for name, tensor in weights:
        short = name.removeprefix("model.")
        kind = next((k for p, k in plan.items() if fnmatch.fnmatchcase(short, p)), None)
        yield name, (tensor if kind is None else _shard(tensor, kind, heads, config, tp))


def _shard(
    t: torch.Tensor, kind: str, heads: HeadSplit, config: ModelConfig, tp: TensorParallel
) -> torch.Tensor:
    hd = config.head_dim
    if kind in ("q_heads_in", "row"):
        if t.dim() == 1:
            return t  # the bias of a row-parallel layer: added once, after the all-reduce
        span = Span(heads.q.start * hd, heads.q.size * hd) if kind == "q_heads_in" else None
        span = span or split_range(t.shape[1], tp)
        return t[:, span.start : span.stop].contiguous()
    if kind == "vocab":
        rows, per = vocab_shard(t.shape[0], tp)
        out = t.new_zeros((per, *t.shape[1:]))
        out[: rows.size] = t[rows.start : rows.stop]
        return out
    if kind == "q_heads":
        span = Span(heads.q.start * hd, heads.q.size * hd)
    elif kind == "kv_heads":
        span = Span(heads.kv.start * hd, heads.kv.size * hd)
    else:  # column
        span = split_range(t.shape[0], tp)
    return t[span.start : span.stop].contiguous()
