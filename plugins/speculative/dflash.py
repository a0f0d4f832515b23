"""Speculative algorithm ``dflash``: a block drafter (``dflash_head.py``) predicts B - 1 tokens
in one parallel forward from the target's hidden features; the core verifies them as a chain.

Context KV by slot: the plugin asks the target to keep a few layers' outputs
(``capture_hidden_layers``) on every forward, and right after it (``target_hidden``) projects
each new token's features and writes every drafter layer's context K and V at the token's own
KV slot, in a pool mirroring the target's (SGLang's "append target hidden to draft KV"). A
slot's context K/V depends only on the target's feature of that position (no attention), so
it is final once written: the target's KV and the drafter's are written by the same forwards,
rejected draft positions included, and are rewritten together whenever a slot is reused. The
prefix cache shares them for free, and after a verify the accepted positions' context is
already in place: the catch-up is part of the verify forward, with no per-request state.

Drafting: when a request proposes (target KV covering ``[0, kv_len)``, its last token x(kv_len)
not yet verified), the block [x(kv_len), MASK x (B - 1)] at positions kv_len .. kv_len + B - 1
attends to the context K/V of positions 0 .. kv_len - 1 (read through the request's row of
the slot table) and bidirectionally to itself; rows 1..B-1 through the target's LM head give
the drafts, greedily (argmax). The block's own K/V are scratch and never written to the pool.
B is the drafter's trained block size; a step that allows fewer drafts takes the first ones.

Sampled requests get the same greedy drafts: the core accepts a draft token while it equals
the target's own sample, which keeps sampling exact.

The context projection runs inside the target's CUDA graphs (``target_hidden_capturable``); the
block forward replays graphs of its own (``dflash_graph.py``). Not covered: KV that arrives
without a target forward (the decode side of prefill/decode disaggregation: no features, poor
drafts, still correct).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import Draft, SpeculativeAlgorithm, SpeculativeContext
from radixserve.core.request import Req
from radixserve.core.weights import count_parameters
from radixserve.plugins.speculative.dflash_graph import DFlashBlockGraphs, block_inputs
from radixserve.plugins.speculative.dflash_head import (
    DFlashConfig,
    DFlashHead,
    block_attention_mask,
    load_head,
)

#: Drafters shipped with radixserve, each for the target shape it was trained on.
HEADS_DIR = Path(__file__).parent / "heads"
DEFAULT_HEADS = {
    # (hidden_size, num_layers, vocab_size): drafter directory under HEADS_DIR
    (576, 30, 49152): "smollm2-135m-instruct-dflash",
}


class DFlashDraft(SpeculativeAlgorithm):
    #: the context projection is device work only: CUDA graphs run it inside, so a decode step
    #: no longer pays its launches (~0.45 ms a step on the H200 at batch 1, eagerly)
    target_hidden_capturable = True

    def __init__(self) -> None:
        self.capture_hidden_layers: tuple[int, ...] = ()
        self.graphs: DFlashBlockGraphs | None = None

    def memory_needs(self, config: Any, host: Any, dtype: torch.dtype) -> tuple[int, int]:
        path = drafter_dir(config, host)
        c = DFlashConfig.from_dir(path)
        weights = count_parameters(path) * dtype.itemsize
        return weights, 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype.itemsize

    def setup(self, context: SpeculativeContext) -> None:
        path = drafter_dir(context.config, context.host, context.model_config)
        c = DFlashConfig.from_dir(path)
        _check_fits(c, context.model_config, path)
        target = context.target_model
        if target is None or not hasattr(target, "embed") or not hasattr(target, "logits"):
            raise ConfigError(
                "speculative algorithm 'dflash' needs the target's embed() and logits()"
            )
        self.embed = target.embed
        self.lm_head = target.logits  # final-normed hidden states -> float32 logits
        self.device = context.device
        self.req_to_token = context.req_to_token
        self.capture_hidden_layers = c.target_layers
        self.head: DFlashHead = load_head(
            path, context.model_config.max_context, context.dtype, context.device
        )
        self.head.eval()
        context.platform.prepare_draft_head(self.head, context.config)
        # Context K and V of every drafter layer, one row per target KV slot (row 0: padding).
        shape = (context.kv_size + 1, c.num_kv_heads, c.head_dim)
        self.k = [
            torch.zeros(shape, dtype=context.dtype, device=context.device)
            for _ in range(c.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=context.dtype, device=context.device)
            for _ in range(c.num_layers)
        ]
        self._block_offsets = torch.arange(c.block_size, device=context.device)
        self.graphs = _block_graphs(self, context)

    @torch.inference_mode()
    def target_hidden(self, batch: ForwardBatch) -> None:
        hidden = batch.hidden_states
        assert hidden is not None
        fused = torch.cat([hidden[i] for i in self.capture_hidden_layers], dim=-1)
        ctx = self.head.project(fused.to(self.k[0].dtype))
        slots = batch.out_cache_loc
        for layer, (k, v) in enumerate(self.head.context_kv(ctx, batch.positions)):
            self.k[layer][slots] = k
            self.v[layer][slots] = v

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[Draft]:
        """One block forward for all requests, from a CUDA graph where one takes them
        (``dflash_graph.py``); the drafts stay on the device (``Draft.pending``)."""
        shape = self.graphs.shape_for(reqs) if self.graphs is not None else None
        if shape is not None:
            drafts = self.graphs.launch(reqs, shape)  # type: ignore[union-attr]
        else:
            drafts = self._eager_block(reqs)
        bsz = self.head.config.block_size
        out = []
        for i, limit in enumerate(max_drafts):
            m = min(limit, bsz - 1)
            out.append(Draft([0] * m, None, drafts[i, :m]) if m > 0 else Draft([]))
        return out

    def _eager_block(self, reqs: Sequence[Req]) -> torch.Tensor:
        """The block forward at the batch's own context width (no graph takes it)."""
        rows, ctx_lens, last = block_inputs(reqs)
        table = self.req_to_token.table
        slots = torch.zeros(len(reqs), max(ctx_lens), dtype=torch.int64)  # padding: slot 0
        for i, (row, n) in enumerate(zip(rows, ctx_lens, strict=True)):
            slots[i, :n] = table[row, :n]
        lens_last = to_device(torch.tensor([ctx_lens, last], dtype=torch.int64), self.device)
        return self.block(to_device(slots, self.device), lens_last[0], lens_last[1])

    def block(
        self, slots: torch.Tensor, ctx_lens: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        """The drafts [n, B - 1] of n blocks, from device tensors alone (capturable): each
        request's context ``slots`` [n, W] (positions at or past its ``ctx_lens`` [n] are
        masked), and its ``last`` [n] verified token, at position ctx_lens."""
        bsz = self.head.config.block_size
        positions = ctx_lens[:, None] + self._block_offsets[None, :]
        ctx_kv = [(k[slots], v[slots]) for k, v in zip(self.k, self.v, strict=True)]
        mask = block_attention_mask(ctx_lens, slots.shape[1], bsz)
        x = self.head.block_inputs(self.embed(last))
        h = self.head.run_block(x, positions, ctx_kv, mask)
        logits = self.lm_head(self.head.norm(h[:, 1:]).flatten(0, 1))
        return logits.argmax(dim=-1).view(len(ctx_lens), bsz - 1)


def drafter_dir(config: Any, host: Any, target: ModelConfig | None = None) -> str:
    """--speculative-draft-model-path, or the drafter shipped for the target's shape."""
    path = config.speculative_draft_model_path
    if path:
        resolved = Path(path).expanduser()
        if not (resolved / "config.json").is_file():
            raise ConfigError(
                f"DFlash drafter path '{path}' is not a directory with config.json and "
                "model.safetensors (tools/train_dflash.py writes one)"
            )
        return str(resolved)
    if target is None:
        model = config.model_path
        target = ModelConfig.from_dir(host.hook.resolve_model_dir(model_path=model) or model)
    name = DEFAULT_HEADS.get((target.hidden_size, target.num_layers, target.vocab_size))
    if name is None or not (HEADS_DIR / name / "config.json").is_file():
        raise ConfigError(
            "speculative algorithm 'dflash' needs --speculative-draft-model-path (a DFlash "
            "drafter directory; tools/train_dflash.py trains one): none ships for this target"
        )
    return str(HEADS_DIR / name)


def _block_graphs(drafter: DFlashDraft, context: SpeculativeContext) -> DFlashBlockGraphs | None:
    """The block forward as CUDA graphs per batch size up to FULL_DRAFT_BATCH (the core
    shortens drafts past it; the graphs would still serve them, but bigger batches gain
    little from a graph) where the platform can capture them."""
    from radixserve.core.speculative import FULL_DRAFT_BATCH
    from radixserve.plugins.hardware.cuda_graph import capture_sizes
    from radixserve.plugins.speculative.draft_chain import graphs_capturable

    if not graphs_capturable(context):
        return None
    config = context.config
    limit = min(FULL_DRAFT_BATCH, config.speculative_disable_batch_size)
    pool = context.req_to_token
    return DFlashBlockGraphs(drafter, pool, capture_sizes(limit), pool.max_context, context.device)


def _check_fits(c: DFlashConfig, target: ModelConfig, path: str) -> None:
    problems = []
    if c.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} (target {target.vocab_size})")
    if c.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} (target {target.hidden_size})")
    if not c.target_layers or any(not 0 <= i < target.num_layers for i in c.target_layers):
        problems.append(
            f"target layers {list(c.target_layers)} (the target has {target.num_layers} layers)"
        )
    if c.block_size < 2:
        problems.append(f"block_size {c.block_size} (at least 2: the last token and one draft)")
    if problems:
        raise ConfigError(f"DFlash drafter '{path}' does not fit the target: {'; '.join(problems)}")


@hookimpl
def register_speculative_algorithms(register: Any) -> None:
    register(
        "dflash",
        DFlashDraft,
        description="a DFlash block drafter over the target's hidden states, B - 1 drafts in "
        "one forward (--speculative-draft-model-path, or the drafter shipped for SmolLM2)",
    )
