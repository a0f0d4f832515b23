"""What the ``eagle`` and ``eagle3`` plugins share: a one-layer draft head (``head_layer.py``)
that drafts a chain of k tokens from the target's own hidden states (or, with
``--speculative-eagle-topk`` > 1, a tree: ``head_tree.py``).

Target features: the plugin asks the target to keep some layers' outputs
(``capture_hidden_layers``) on every forward, turns them into the head's feature (``feature``:
EAGLE-3 concatenates three layers, EAGLE normalises the last one) and writes it into a feature
pool indexed by KV slot, beside the target's KV (``target_hidden``). A slot's feature is a
function of the tokens up to its position, exactly like its KV, so the prefix cache shares
features with the KV for free: a request that reuses a cached prefix, or comes back after
retraction, finds the features of every cached position at the slots its row points to.

Draft KV: one layer, in a pool with one slot per target slot, written at the target's slots.
Row p of the head reads token x(p+1) with the target feature of position p, so when a request
proposes (its target KV covering ``[0, kv_len)``, its last token x(kv_len) not yet verified)
the head can be complete up to position kv_len - 1, and that row drafts d1. Steps 2..k feed
the previous draft token and the head's own output hidden state at the next position. Per
request the plugin remembers how far its draft KV holds target features (kv_len at the last
proposal: the positions drafted from the head's own states are never trusted later) and the
slots it wrote; what is no longer trusted (rejected positions, slots the prefix cache
re-pointed, a new or retracted request: everything) is recomputed from the feature pool by a
catch-up extend, which is also the first draft step.

Drafts are greedy (the head's argmax, mapped to target ids) for every request, also sampled
ones: the core then accepts a draft token while it equals the target's own sample, which keeps
sampling exact at a lower acceptance than rejection sampling would.

Not covered: KV that arrives without a target forward (the decode side of prefill/decode
disaggregation) has no features, so its drafts are poor (never wrong: the target verifies).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from radixserve.core import spec_tree
from radixserve.core.batch import ForwardBatch, to_device
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.interfaces import (
    DeviceCycle,
    Draft,
    SpeculativeAlgorithm,
    SpeculativeContext,
    TargetVerify,
)
from radixserve.core.memory import KVPool
from radixserve.core.request import Req, token_slice
from radixserve.core.weights import count_parameters
from radixserve.plugins.speculative.draft_kv import (
    DraftKV,
    catch_up_spans,
    draft_batch,
    rows_by_request,
    trusted_length,
)
from radixserve.plugins.speculative.head_layer import DraftHead, HeadConfig
from radixserve.plugins.speculative.head_tree import TreeDrafter

#: Heads shipped with radixserve, each for the target shape it was trained on.
HEADS_DIR = Path(__file__).parent / "heads"


class HeadDraft(SpeculativeAlgorithm):
    """A speculative plugin around a draft head; subclasses give its kind's edges."""

    #: the plugin's name and the head's kind, as errors name them
    name = ""
    kind = ""
    #: (hidden_size, num_layers, vocab_size) of a target: its head directory under HEADS_DIR
    default_heads: dict[tuple[int, int, int], str] = {}
    #: the feature write is one indexed copy: CUDA graphs run it inside (no launch of its own)
    target_hidden_capturable = True
    drafts_trees = True

    def __init__(self) -> None:
        self._kv: dict[str, DraftKV] = {}
        self.capture_hidden_layers: tuple[int, ...] = ()

    # ---- what a kind defines ----

    def feature_width(self, hc: HeadConfig) -> int:
        """Values a slot of the feature pool holds."""
        raise NotImplementedError

    def check_fits(self, hc: HeadConfig, target: ModelConfig) -> list[str]:
        """What keeps the head from serving ``target`` (empty: it fits)."""
        raise NotImplementedError

    def load(self, path: str, context: SpeculativeContext) -> DraftHead:
        """The head from ``path`` on the device, bound to the target; sets
        ``capture_hidden_layers``."""
        raise NotImplementedError

    def feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The feature of each new token from the captured layers' outputs [T, hidden]."""
        raise NotImplementedError

    # ---- the plugin ----

    def memory_needs(self, config: Any, host: Any, dtype: torch.dtype) -> tuple[int, int]:
        path = self.head_dir(config, host)
        hc = HeadConfig.from_dir(path)
        weights = count_parameters(path) * dtype.itemsize
        kv = KVPool.bytes_per_token(1, hc.num_kv_heads, hc.head_dim, dtype)
        return weights, kv + self.feature_width(hc) * dtype.itemsize

    def setup(self, context: SpeculativeContext) -> None:
        path = self.head_dir(context.config, context.host, context.model_config)
        hc = HeadConfig.from_dir(path)
        problems = self.check_fits(hc, context.model_config)
        if problems:
            raise ConfigError(
                f"{self.kind} head '{path}' does not fit the target: {'; '.join(problems)}"
            )
        if context.target_model is None or not hasattr(context.target_model, "embed"):
            raise ConfigError(f"speculative algorithm '{self.name}' needs the target's embed()")
        self.embed = context.target_model.embed
        self.device = context.device
        self.config = context.config
        self.platform = context.platform
        self.req_to_token = context.req_to_token
        self.head = self.load(path, context)
        self.head.eval()
        context.platform.prepare_draft_head(self.head, context.config)
        self.features = torch.zeros(
            context.kv_size + 1, self.feature_width(hc), dtype=context.dtype, device=context.device
        )
        config = context.config
        topk, depth = config.speculative_eagle_topk, config.draft_depth
        # draft trees' head rows take scratch slots past the target's (head_tree.py)
        scratch = spec_tree.TREE_BATCH * topk * depth if topk > 1 else 0
        self.kv_pool = KVPool(
            context.kv_size + scratch, 1, hc.num_kv_heads, hc.head_dim, context.dtype,
            context.device, page_size=context.page_size,
        )  # fmt: skip
        self.trees = None
        if topk > 1:
            trees = spec_tree.TREE_BATCH
            rows = context.req_to_token.reserve(trees * topk)
            first_slot = context.kv_size + 1
            self.trees = TreeDrafter(
                self, topk, context.req_to_token, rows, first_slot, trees, depth
            )  # fmt: skip
        max_context = context.model_config.max_context
        self.attention = (
            context.host.registries["attention"]
            .get(context.attention)
            .factory(self.kv_pool, hc.model_config(max_context), context.device)
        )
        self.chain = _chain_graphs(self, context)

    def target_hidden(self, batch: ForwardBatch) -> None:
        assert batch.hidden_states is not None
        self.features[batch.out_cache_loc] = self.feature(batch.hidden_states).to(
            self.features.dtype
        )

    def release(self, rid: str) -> None:
        self._kv.pop(rid, None)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], max_drafts: Sequence[int]) -> list[Draft]:
        """Step 1 catches each request's draft KV up to position kv_len - 1 (from the feature
        pool) and drafts d1 there; step s > 1 drafts d(s) at position kv_len + s - 2 from
        d(s-1) and the head's own hidden state. The tokens stay on the device
        (``Draft.pending``). Where the proposal graph fits the step, draft KV that lags behind
        its fixed catch-up is written first (one eager forward) and the graph drafts."""
        if self.chain is not None and self.chain.fits(reqs, max_drafts):
            self.catch_up_to_span(reqs, self.chain.span)
            chained = self.chain.launch(reqs)
            for req in reqs:
                self.record_draft_kv(req, req.kv_len)
            return [Draft([0] * self.chain.k, None, chained[i]) for i in range(len(reqs))]
        trusted = [trusted_length(self._kv.get(r.rid), r, self.req_to_token) for r in reqs]
        steps: list[tuple[list[int], torch.Tensor]] = []  # (request indices, their tokens)
        hidden: torch.Tensor | None = None
        for step in range(max(max_drafts)):
            if step == 0:
                batch = catch_up_spans(reqs, trusted)
                order = [i for i, _, _ in batch]
                input_ids, feature = self._catch_up_inputs(reqs, batch)
            else:
                prev_order, prev_ids = steps[-1]
                active = [j for j, i in enumerate(prev_order) if max_drafts[i] > step]
                if not active:
                    break
                pick = to_device(torch.tensor(active), self.device)
                order = [prev_order[j] for j in active]
                batch = [(i, reqs[i].kv_len + step - 1, 1) for i in order]
                input_ids = prev_ids[pick]
                assert hidden is not None
                feature = hidden[pick]
            token_ids, hidden = self._forward(reqs, batch, input_ids, feature)
            steps.append((order, token_ids))
        for req in reqs:  # positions [0, kv_len) hold KV from target features
            self._kv[req.rid] = DraftKV.written(req, req.kv_len, self.req_to_token)
        where = rows_by_request(steps, len(reqs))
        flat = torch.cat([ids for _, ids in steps])
        gather = to_device(torch.tensor([j for w in where for j in w]), self.device)
        by_req = flat[gather].split([len(w) for w in where])
        return [Draft([0] * len(w), None, t) for w, t in zip(where, by_req, strict=True)]

    def catch_up_to_span(self, reqs: Sequence[Req], span: int) -> None:
        """Write the draft KV of the positions a fixed catch-up of ``span`` does not cover
        (``[trusted, kv_len - span)``: a new request's prompt, the decodes of a pause) in one
        eager head forward, so that a graph serves the proposal (or the device cycle). Eager
        proposals cost k head forwards: on the H200 a proposal after a pause took ~6 ms, a
        graph replay ~0.3."""
        trusted = [trusted_length(self._kv.get(r.rid), r, self.req_to_token) for r in reqs]
        lagging = [
            (i, t, r.kv_len - span - t)
            for i, (r, t) in enumerate(zip(reqs, trusted, strict=True))
            if t < r.kv_len - span
        ]
        if lagging:
            lagging.sort(key=lambda e: e[2] != 1)  # decodes first
            self._forward(reqs, lagging, *self._catch_up_inputs(reqs, lagging))

    def warm_catch_up(self, max_batch: int) -> None:
        """Run the eager catch-up once for each mix it meets at up to ``max_batch`` requests
        (0 to all of them decodes, beside extends over no prefix and over one), at the KV pool's
        padding slot, so that Triton compiles its kernels' variants now. Met first inside the
        loop, each compile stalled it ~0.5 s on the H200: code edits at batch 4, whose pauses
        end in catch-ups of every mix, ran at 0.21x of speculation off."""
        pool = self.req_to_token
        row = pool.alloc()
        if row is None:
            return
        try:
            if bool(pool.table[row].any()):
                return  # a row a request used (only a fresh pool's rows all read slot 0)
            fake = [SimpleNamespace(req_pool_idx=row)]
            for bs in range(1, max_batch + 1):
                for decodes in range(bs + 1):
                    for prefix, n in ((0, 20), (40, 7)):
                        spans = [(0, prefix + n, 1)] * decodes + [(0, prefix, n)] * (bs - decodes)
                        rows = sum(span[2] for span in spans)
                        ids = torch.zeros(rows, dtype=torch.int64, device=self.device)
                        self._forward(fake, spans, ids, self.features[ids])
        finally:
            pool.free(row)

    def record_draft_kv(self, req: Req, length: int) -> None:
        """``req``'s draft KV holds positions [0, length), written from target features."""
        self._kv[req.rid] = DraftKV.written(req, length, self.req_to_token)

    def device_cycle(self, verify: TargetVerify, max_batch: int) -> DeviceCycle | None:
        """Chains only (a tree's nodes take scratch rows a cycle does not)."""
        from radixserve.plugins.speculative.head_chain import HeadChainGraphs
        from radixserve.plugins.speculative.head_cycle import HeadCycle

        if self.trees is not None:
            return None
        k = self.config.draft_depth
        chain = HeadChainGraphs(self, self.req_to_token, k, [max_batch], self.device, capture=False)
        capture = self.device.startswith("cuda") and not self.config.disable_cuda_graph
        return HeadCycle(self, chain, verify, self.req_to_token, max_batch, self.device, capture)

    def _catch_up_inputs(
        self, reqs: Sequence[Req], spans: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's inputs over ``spans`` (request index, first position p, rows n): row p
        reads token x(p + 1) and the target feature of position p."""
        table = self.req_to_token.table
        ids = [token_slice(reqs[i].input_ids, reqs[i].output_ids, s + 1, n) for i, s, n in spans]
        input_ids = to_device(torch.tensor([t for x in ids for t in x]), self.device)
        rows = torch.cat([table[reqs[i].req_pool_idx, s : s + n] for i, s, n in spans])  # type: ignore[misc]
        return input_ids, self.features[to_device(rows, self.device)]

    def _forward(
        self,
        reqs: Sequence[Req],
        batch: list[tuple[int, int, int]],
        input_ids: torch.Tensor,
        feature: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over ``batch`` entries (request index, first position, tokens), decodes
        first; return each entry's drafted target token id and its last row's hidden state."""
        h = self.head_hidden(reqs, batch, input_ids, feature)
        return self.head.to_target(self.head.draft_logits(h).argmax(dim=-1)), h

    def head_hidden(
        self,
        reqs: Sequence[Any],
        batch: list[tuple[int, int, int]],
        input_ids: torch.Tensor,
        feature: torch.Tensor,
    ) -> torch.Tensor:
        """The head's output at the last row of each ``batch`` entry (see ``_forward``);
        ``reqs`` need only a ``req_pool_idx``."""
        fb = draft_batch(reqs, batch, input_ids, self.req_to_token, self.kv_pool, self.device)
        self.attention.prepare(fb)
        head = self.head
        q, k, v, residual = head.qkv(self.embed(input_ids), feature, fb.positions)
        out = self.attention.forward(q, k, v, 0, fb)
        return head.finish(out, residual)[fb.logits_indices]

    def propose_trees(
        self, reqs: Sequence[Req], max_depths: Sequence[int], max_nodes: Sequence[int]
    ) -> list[Draft]:
        """Trees where ``max_nodes`` allows (plugins/speculative/head_tree.py), chains for
        the rest."""
        assert self.trees is not None
        chains = [i for i, n in enumerate(max_nodes) if not n]
        trees = [i for i, n in enumerate(max_nodes) if n]
        out: dict[int, Draft] = {}
        if chains:
            drafts = self.propose([reqs[i] for i in chains], [max_depths[i] for i in chains])
            out.update(zip(chains, drafts, strict=True))
        if trees:
            picked = [reqs[i] for i in trees]
            spans, hidden = self._catch_up(picked)
            depths, nodes = [max_depths[i] for i in trees], [max_nodes[i] for i in trees]
            drafts = self.trees.draft(picked, spans, hidden, depths, nodes)
            out.update(zip(trees, drafts, strict=True))
        return [out[i] for i in range(len(reqs))]

    def _catch_up(self, reqs: Sequence[Req]) -> tuple[list[tuple[int, int, int]], torch.Tensor]:
        """A proposal's first head step, eagerly (``catch_up_spans``): the spans and the head's
        output at each span's last row, the one that reads the request's last token. The
        requests' draft KV is then trusted up to kv_len - 1."""
        trusted = [trusted_length(self._kv.get(r.rid), r, self.req_to_token) for r in reqs]
        spans = catch_up_spans(reqs, trusted)
        hidden = self.head_hidden(reqs, spans, *self._catch_up_inputs(reqs, spans))
        for req in reqs:  # positions [0, kv_len) hold KV from target features
            self._kv[req.rid] = DraftKV.written(req, req.kv_len, self.req_to_token)
        return spans, hidden

    def head_dir(self, config: Any, host: Any, target: ModelConfig | None = None) -> str:
        """--speculative-draft-model-path, or the shipped head for the target's shape."""
        path = config.speculative_draft_model_path
        if path:
            resolved = Path(path).expanduser()
            if not (resolved / "config.json").is_file():
                raise ConfigError(
                    f"{self.kind} head path '{path}' is not a directory with config.json and "
                    "model.safetensors (tools/train_draft.py writes one)"
                )
            return str(resolved)
        if target is None:
            model = config.model_path
            target = ModelConfig.from_dir(host.hook.resolve_model_dir(model_path=model) or model)
        name = self.default_heads.get((target.hidden_size, target.num_layers, target.vocab_size))
        if name is None or not (HEADS_DIR / name / "config.json").is_file():
            raise ConfigError(
                f"speculative algorithm '{self.name}' needs --speculative-draft-model-path (an "
                f"{self.kind} head directory; tools/train_draft.py trains one): no head ships "
                "for this target"
            )
        return str(HEADS_DIR / name)


def _chain_graphs(drafter: HeadDraft, context: SpeculativeContext) -> Any:
    """The head's proposal as one CUDA graph per batch size up to FULL_DRAFT_BATCH (above it
    the core shortens drafts, which the graph does not take), where the platform and the
    attention backend can capture it (plugins/speculative/head_chain.py)."""
    from radixserve.core.speculative import FULL_DRAFT_BATCH
    from radixserve.plugins.hardware.cuda_graph import capture_sizes
    from radixserve.plugins.speculative.draft_chain import graphs_capturable
    from radixserve.plugins.speculative.head_chain import HeadChainGraphs

    if not graphs_capturable(context, drafter.attention, decode=True, verify=True):
        return None
    config = context.config
    limit = min(FULL_DRAFT_BATCH, config.speculative_disable_batch_size)
    return HeadChainGraphs(
        drafter, context.req_to_token, config.draft_depth, capture_sizes(limit),
        context.device,
    )  # fmt: skip
