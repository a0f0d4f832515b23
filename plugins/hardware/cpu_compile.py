"""Decode steps through ``torch.compile`` on CPU (``--enable-torch-compile``).

A batch-1 decode of the default model on CPU spends more of its time in ~6,000 small eager ops
and their Python than in its weight-only int4 products (bench/HISTORY.md, issue 19). Inductor
fuses those ops into a few C++ loops and, with its C++ wrapper, runs the step without Python
between them.

The compiled graph is the model's own ``forward`` on a decode-only batch of one of a few sizes.
Attention stays eager and opaque: each layer's attention backend is wrapped so that, while
dynamo traces, its call becomes one custom op (``radixserve::opaque_attention``) that looks the
backend and the step's batch up here; the backend keeps owning the paged KV (its ``prepare``
runs eagerly before every compiled step, as for an eager one). So any attention plugin works,
and a step's KV lengths, which change every step, never reach the graph's shapes.

Each size is compiled at start-up on a dummy batch that reads and writes only the KV pool's
padding slot; a batch of another size, a prefill, a verify step or one that keeps hidden states
runs eagerly. The compiled step gives the eager step's tokens in our tests, not its exact bits:
inductor may fuse float reductions in another order (``bench/cpu_formats.py`` reports the
agreement).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.memory import ReqToTokenPool

logger = logging.getLogger(__name__)

#: owner id -> the executor whose backends and batch the custom op reads (weak: an engine's
#: step executor lives as long as its model runner)
_EXECUTORS: weakref.WeakValueDictionary[int, CompiledDecode] = weakref.WeakValueDictionary()
_owner_ids = itertools.count()

# Inductor options: a C++ wrapper instead of Python between the kernels. Weights stay graph
# inputs (no freezing), so a weight reload reaches the compiled steps.
COMPILE_OPTIONS = {"cpp_wrapper": True}


# NOTE: a plain ``torch.library.Library`` op, not ``torch.library.custom_op``: the compiled
# step calls it 30 times (once a layer) and custom_op's Python autograd and alias-check layers
# cost ~5 us a call on top of a ~30 us attention. Its output must not alias an input (the
# compiled graph may reuse an input's buffer): ``CompiledDecode.attend`` checks that.
_LIB = torch.library.Library("radixserve", "FRAGMENT")
_LIB.define("opaque_attention(Tensor q, Tensor k, Tensor v, int owner, int layer_id) -> Tensor")


def opaque_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int, layer_id: int
) -> torch.Tensor:
    return _EXECUTORS[owner].attend(q, k, v, layer_id)


_LIB.impl("opaque_attention", opaque_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("radixserve::opaque_attention", lib=_LIB)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int, layer_id: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class OpaqueAttention:
    """Stands in for a layer's attention backend: the backend itself when eager, the custom
    op while dynamo traces. Every other attribute is the backend's."""

    def __init__(self, backend: Any, owner: int) -> None:
        self.backend, self.owner = backend, owner

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
        batch: ForwardBatch, **options: Any,
    ) -> torch.Tensor:  # fmt: skip
        if torch.compiler.is_compiling():
            return torch.ops.radixserve.opaque_attention(q, k, v, self.owner, layer_id)
        return self.backend.forward(q, k, v, layer_id, batch, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def compile_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, ... below ``max_bs``, and ``max_bs`` itself."""
    sizes = {max_bs}
    size = 1
    while size < max_bs:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


class CompiledDecode:
    """The step executor: compiled decode steps for ``sizes``, eager for every other batch."""

    def __init__(
        self, model: Any, attention: Any, kv_pool: Any, req_to_token: ReqToTokenPool,
        max_bs: int,
    ) -> None:  # fmt: skip
        self.model, self.attention = model, attention
        self.owner = next(_owner_ids)
        _EXECUTORS[self.owner] = self
        layers = getattr(model, "layers", None)
        if layers is None or not all(hasattr(layer, "attention") for layer in layers):
            raise RuntimeError(
                f"model {type(model).__name__} has no layers[i].attention to compile around"
            )
        self.options: dict[int, dict[str, Any]] = {}
        for i, layer in enumerate(layers):
            self.options[getattr(layer, "layer_id", i)] = dict(getattr(layer, "attn_options", {}))
            layer.attention = OpaqueAttention(layer.attention, self.owner)
        self._forward = attention.forward  # bound once: attend runs once a layer
        self.batch: ForwardBatch | None = None
        # Each size (and each engine in this process) is its own graph of the same function:
        # make room in dynamo's per-function cache, or a miss would end compiled steps.
        self.sizes = compile_sizes(min(max_bs, 64))
        torch._dynamo.config.cache_size_limit += len(self.sizes)
        self.compiled: Callable[[ForwardBatch], torch.Tensor] = torch.compile(
            model.forward, fullgraph=True, dynamic=False, options=COMPILE_OPTIONS
        )
        self.failed = False  # a compiled step raised: every later step runs eagerly
        self.warming_up = False
        self.compiled_steps = 0  # steps served compiled (tests read it)
        self.kv_pool, self.req_to_token = kv_pool, req_to_token
        self._warm_up(kv_pool, req_to_token)

    def recompile(self) -> None:
        """Compile every size again (e.g. after the torch thread count changed). Drops every
        graph dynamo holds in this process: a server's engine process has this engine only."""
        torch._dynamo.reset()
        self._warm_up(self.kv_pool, self.req_to_token)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> Any:
        assert self.batch is not None
        options = self.options.get(layer_id)
        if options:
            out = self._forward(q, k, v, layer_id, self.batch, **options)
        else:
            out = self._forward(q, k, v, layer_id, self.batch)
        # the op may not return (a view of) one of its inputs
        ptr = out.untyped_storage().data_ptr()
        if ptr in (
            q.untyped_storage().data_ptr(),
            k.untyped_storage().data_ptr(),
            v.untyped_storage().data_ptr(),
        ):
            return out.clone()
        return out

    def _warm_up(self, kv_pool: Any, req_to_token: ReqToTokenPool) -> None:
        """Compile every size now, on requests that point at the KV pool's padding slot."""
        self.warming_up = True
        row = req_to_token.alloc()
        if row is None:
            raise RuntimeError("no request row free to compile decode steps with")
        try:
            for bs in self.sizes:
                start = time.perf_counter()
                # distinct tensors: dynamo guards on which inputs alias each other
                batch = ForwardBatch(
                    input_ids=torch.zeros(bs, dtype=torch.int64),
                    positions=torch.zeros(bs, dtype=torch.int64),
                    out_cache_loc=torch.zeros(bs, dtype=torch.int64),  # the padding slot
                    req_pool_indices=torch.full((bs,), row, dtype=torch.int64),
                    req_to_token=req_to_token.table,
                    seq_lens=[1] * bs,
                    extend_lens=[1] * bs,
                    num_decode=bs,
                    logits_indices=torch.arange(bs),
                    kv_pool=kv_pool,
                    req_to_token_pool=req_to_token,
                )
                self(batch)
                spent = time.perf_counter() - start
                logger.info("compiled decode steps of %d requests in %.1f s", bs, spent)
        finally:
            req_to_token.free(row)
            self.warming_up = False
        self.compiled_steps = 0

    def takes(self, batch: ForwardBatch) -> bool:
        bs = batch.batch_size
        return (
            batch.num_decode == bs
            and bs in self.sizes
            and batch.logits_indices.numel() == bs
            and batch.hidden_rows is None
            and not batch.capture_hidden_layers
        )

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        self.attention.prepare(batch)
        if self.failed or not self.takes(batch):
            return self.model.forward(batch)
        self.batch = batch
        try:
            # Past the warm-up, dynamo checks only the guards that tell our graphs apart (the
            # batch size): ``takes`` already fixed the rest, and a full check costs ~0.7 ms of
            # a ~20 ms step on the default model.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=not self.warming_up):
                logits = self.compiled(batch)
        except Exception as e:  # noqa: BLE001 - e.g. a recompile past dynamo's limit
            if self.warming_up:
                raise RuntimeError(f"--enable-torch-compile: compiling failed: {e}") from e
            # The same step again, eagerly, rewrites the same KV slots: no request fails.
            logger.warning("a compiled decode step failed (%s); decode steps run eagerly now", e)
            self.failed = True
            self.attention.prepare(batch)
            return self.model.forward(batch)
        finally:
            self.batch = None
        self.compiled_steps += 1
        return logits
