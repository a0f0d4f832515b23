"""Mixture-of-Experts decoders: ``Qwen3MoeForCausalLM`` and ``MixtralForCausalLM``.

Both are the decoder skeleton (``decoder.py``) whose MLP is a sparse MoE block: a linear router,
softmax over the experts in float32, the top-k experts per token, their weights renormalised to
sum to 1 (Mixtral always, Qwen3 when ``norm_topk_prob``), and each expert a gated SiLU MLP.
Qwen3-MoE's attention is Qwen3's (q/k RMSNorm); Mixtral's is Llama's.

Expert weights live stacked: ``w13`` [E, 2 * I, H] (gate rows then up rows) and ``w2`` [E, H, I].
They load from per-expert HF tensors (``mlp.experts.{e}.gate_proj`` etc.; Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2``) or from transformers 5's stacked
``mlp.experts.gate_up_proj``/``down_proj``.

On a CUDA/ROCm device with Triton (and a SiLU-gated expert MLP), the experts run fused
(``fused_moe.py``): the (token, expert) pairs sorted by expert and two grouped GEMMs, one for
gate/up with SiLU-and-mul, one for down with the router weights applied; fixed shapes, so CUDA
graphs capture it. Elsewhere they run as the reference: tokens grouped by expert, one gated MLP
per expert that received tokens, outputs weighted and summed in expert order (as transformers
does, so float32 results match it closely). Should the reference run while a CUDA graph is being
captured (no Triton), every expert runs on every token with zero weights for the unchosen ones:
the same sums, at E times the FLOPs.
"""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.hookspecs import hookimpl
from radixserve.core.interfaces import AttentionBackend
from radixserve.core.parallel import SINGLE, TensorParallel, split_range
from radixserve.plugins.models.blocks import activation
from radixserve.plugins.models.decoder import DecoderForCausalLM, DecoderLayer
from radixserve.plugins.models.decoder_config import required
from radixserve.plugins.models.parallel_layers import DECODER_TP_PLAN
from radixserve.plugins.models.weight_loading import Target


class SparseMoE(nn.Module):
    def __init__(
        self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool, act: str,
        tp: TensorParallel = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp = tp
        #: this rank's experts: all of them, or under expert parallelism a contiguous run
        self.expert_parallel = tp.size > 1 and tp.ep_size > 1
        local = num_experts
        if self.expert_parallel:
            if num_experts % tp.size:
                raise ConfigError(
                    f"ep_size={tp.size} does not divide the model's {num_experts} experts; "
                    "choose an ep_size that does"
                )
            local = num_experts // tp.size
        else:  # tensor parallelism cuts each expert's intermediate features (or nothing)
            inter = split_range(inter, tp).size
        self.local_experts, self.first_expert = (
            local,
            (tp.rank * local if local < num_experts else 0),
        )
        self.intermediate_size = inter
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, inter))
        self.act = activation(act)
        self.act_name = act
        #: ``fused_moe`` where the fused path runs (set by the model on its device), else None
        self.kernels: ModuleType | None = None
        #: FP8 experts' scales per output row (w13 [E, 2I], w2 [E, H]); None: 16-bit experts
        self.fp8_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantize_fp8(self) -> None:
        """FP8 e4m3 experts with a scale per output row (``--quantization fp8``): half the
        bytes a decode step reads; the fused kernels widen them, the reference dequantizes."""
        from radixserve.plugins.models.fp8 import quantize_rows

        for name in ("w13", "w2"):
            w = getattr(self, name).data
            q, s = quantize_rows(w.reshape(-1, w.shape[-1]))
            delattr(self, name)
            self.register_buffer(name, q.view(w.shape))
            self.register_buffer(f"{name}_scale", s.view(w.shape[:2]))
        self.fp8_scales = (self.w13_scale, self.w2_scale)

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e``'s (w13, w2) as the reference multiplies them (FP8 ones dequantized)."""
        if self.fp8_scales is None:
            return self.w13[e], self.w2[e]
        s13, s2 = self.fp8_scales
        dtype = self.gate.weight.dtype
        w13 = (self.w13[e].float() * s13[e][:, None]).to(dtype)
        return w13, (self.w2[e].float() * s2[e][:, None]).to(dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = self._weights(e)
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.expert_parallel and not capturing:
            return self.tp.all_reduce(expert_parallel(self, x))
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids, capturing)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    def experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, capturing: bool
    ) -> torch.Tensor:
        """This rank's experts' share of the weighted sum (the whole of it with one rank):
        experts outside this rank's run (ids counted from ``first_expert``) add nothing."""
        if self.kernels is not None and self.act_name in ("silu", "swish"):
            if self.local_experts < self.num_experts:  # expert parallelism, in a CUDA graph
                ids, weights = self._local_ids(ids, weights)
            return self.kernels.fused_experts(
                x, self.w13, self.w2, weights, ids, scales=self.fp8_scales
            )
        out = torch.zeros_like(x)
        first, local = self.first_expert, self.local_experts
        if capturing:
            dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
            dense.scatter_(1, ids, weights)
            for e in range(local):
                out += self.expert(e, x) * dense[:, first + e : first + e + 1]
            return out
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // ids.shape[1]
        start = sum(counts[:first])
        for e, n in enumerate(counts[first : first + local]):
            if not n:
                continue
            picked = order[start : start + n]
            rows = tokens[start : start + n]
            start += n
            y = self.expert(e, x[rows]) * weights.flatten()[picked, None]
            out.index_add_(0, rows, y)
        return out

    def _local_ids(
        self, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids counted from this rank's first expert; other ranks' experts point at
        expert 0 with weight 0 (fixed shapes, for a CUDA graph)."""
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.local_experts)
        return local.masked_fill(~mine, 0), weights.masked_fill(~mine, 0.0)


def expert_parallel(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE block under expert parallelism, before its all-reduce. ``x`` [T, H] is the same
    on every rank (attention is tensor-parallel): each rank routes its contiguous share of the
    tokens, sends each (token, expert) pair's row to the rank holding the expert (all-to-all,
    pairs in expert order), runs its experts on what it received, sends the outputs back (the
    reverse all-to-all) and sums them, weighted, in expert order. The result is [T, H] with
    only this rank's tokens filled; the all-reduce after it makes every token whole."""
    tp, top_k = moe.tp, moe.top_k
    span = split_range(x.shape[0], tp)
    mine = x[span.start : span.stop]
    weights, ids = moe.route(mine)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    owner = experts // moe.local_experts
    send = torch.bincount(owner, minlength=tp.size)
    receive = tp.all_to_all(send, [1] * tp.size, [1] * tp.size)
    send_n, receive_n = send.tolist(), receive.tolist()
    rows = tp.all_to_all(mine[order // top_k], send_n, receive_n)
    local_ids = tp.all_to_all(experts - owner * moe.local_experts, send_n, receive_n)
    done = _run_received(moe, rows, local_ids)
    back = tp.all_to_all(done, receive_n, send_n)
    out = torch.zeros_like(x)
    out[span.start : span.stop].index_add_(0, order // top_k, back * weights.flatten()[order, None])
    return out


def _run_received(moe: SparseMoE, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
    """Each received row through its (local) expert, unweighted."""
    if not rows.shape[0]:
        return rows
    if moe.kernels is not None and moe.act_name in ("silu", "swish"):
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return moe.kernels.fused_experts(
            rows, moe.w13, moe.w2, ones, local_ids[:, None], scales=moe.fp8_scales
        )
    out = torch.empty_like(rows)
    counts = torch.bincount(local_ids, minlength=moe.local_experts).tolist()
    start = 0  # the rows from each rank come in expert order, but not across ranks
    order = torch.argsort(local_ids, stable=True)
    for e, n in enumerate(counts):
        if n:
            picked = order[start : start + n]
            out[picked] = moe.expert(e, rows[picked])
            start += n
    return out


class MoELayer(DecoderLayer):
    """A decoder layer whose MLP is a ``SparseMoE`` (or dense, where the config says so)."""

    def is_sparse(self, raw: dict[str, Any]) -> bool:
        return True

    def moe_settings(self, raw: dict[str, Any]) -> tuple[int, int, int, bool]:
        """(experts, top_k, expert intermediate size, renormalise top-k weights)."""
        raise NotImplementedError

    def build_mlp(self, config: ModelConfig) -> None:
        raw = config.raw
        self.moe: SparseMoE | None = None
        if not self.is_sparse(raw):
            super().build_mlp(config)
            return
        experts, top_k, inter, renorm = self.moe_settings(raw)
        act = raw.get("hidden_act") or "silu"
        self.moe = SparseMoE(config.hidden_size, inter, experts, top_k, renorm, act, self.tp)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is None:
            return super().mlp(x)
        return self.moe(x)


def _num_experts(raw: dict[str, Any]) -> int:
    """Qwen3-MoE checkpoints say ``num_experts``; transformers 5 writes ``num_local_experts``."""
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


class Qwen3MoeLayer(MoELayer):
    qk_norm = True

    def is_sparse(self, raw: dict[str, Any]) -> bool:
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        return (
            self.layer_id not in (raw.get("mlp_only_layers") or [])
            and _num_experts(raw) > 0
            and (self.layer_id + 1) % step == 0
        )

    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        # transformers' Qwen3-MoE slides every layer (no layer_types, max_window_layers unused)
        raw = config.raw
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        return {"sliding_window": int(window)} if window else {}

    def moe_settings(self, raw: dict[str, Any]) -> tuple[int, int, int, bool]:
        return (
            _num_experts(raw),
            int(required(raw, "num_experts_per_tok")),
            int(required(raw, "moe_intermediate_size")),
            bool(raw.get("norm_topk_prob", False)),
        )


class MixtralLayer(MoELayer):
    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        window = config.raw.get("sliding_window")
        return {"sliding_window": int(window)} if window else {}

    def moe_settings(self, raw: dict[str, Any]) -> tuple[int, int, int, bool]:
        return (
            int(required(raw, "num_local_experts")),
            int(required(raw, "num_experts_per_tok")),
            int(required(raw, "intermediate_size")),
            True,
        )


_EXPERT = re.compile(r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
#: per-expert HF leaf -> (our stacked parameter, 0 gate / 1 up / None)
_EXPERT_LEAVES = {
    "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
    "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None),
}  # fmt: skip


#: under tensor parallelism without expert parallelism: each expert's intermediate features
#: are cut like a dense MLP's (under expert parallelism whole experts load on their rank)
EXPERT_TP_PLAN: dict[str, str] = {
    "layers.*.experts.*.gate_proj.weight": "column",
    "layers.*.experts.*.up_proj.weight": "column",
    "layers.*.experts.*.down_proj.weight": "row",
    "layers.*.block_sparse_moe.experts.*.w1.weight": "column",
    "layers.*.block_sparse_moe.experts.*.w3.weight": "column",
    "layers.*.block_sparse_moe.experts.*.w2.weight": "row",
}


class MoEForCausalLM(DecoderForCausalLM):
    #: its experts spread over the ranks with --ep-size (core/distributed.py asks)
    expert_parallel = True

    @property
    def tp_plan(self) -> dict[str, str]:  # type: ignore[override]
        if self.tp.ep_size > 1:
            return dict(DECODER_TP_PLAN)
        return {**EXPERT_TP_PLAN, **DECODER_TP_PLAN}

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: str,
        group: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(config, attention, dtype, device, group)
        kernels = fused_moe_for(device)
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.kernels = kernels

    def weight_target(self, name: str) -> Target | None:
        m = _EXPERT.match(name)
        if m:
            layer, e, leaf = int(m.group(1)), int(m.group(2)), m.group(3)
            if leaf not in _EXPERT_LEAVES:
                return name, None, None  # reported as unexpected
            param, half = _EXPERT_LEAVES[leaf]
            moe: SparseMoE | None = getattr(self.layers[layer], "moe", None)
            if moe is not None:
                e -= moe.first_expert
                if not 0 <= e < moe.local_experts:
                    return None  # another rank's expert (expert parallelism)
            offset = None if half is None or moe is None else half * moe.intermediate_size
            return f"layers.{layer}.moe.{param}", e, offset
        m = _STACKED.match(name)
        if m and self.tp.size > 1:
            raise ValueError(
                f"stacked expert tensors ('{name}') are not sharded yet: with tp_size > 1 "
                "use a checkpoint with per-expert tensors"
            )
        if m:
            param = "w13" if m.group(2) == "gate_up_proj" else "w2"
            return f"layers.{m.group(1)}.moe.{param}", None, None
        m = _ROUTER.match(name)
        if m:
            return f"layers.{m.group(1)}.moe.gate.weight", None, None
        return super().weight_target(name)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen3MoeLayer


class MixtralForCausalLM(MoEForCausalLM):
    layer_cls = MixtralLayer


def fused_moe_for(device: str) -> ModuleType | None:
    """The fused MoE kernels on a CUDA/ROCm device with Triton installed, else None."""
    if torch.device(device).type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from radixserve.plugins.models import fused_moe

    return fused_moe


def build_qwen3_moe(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> Qwen3MoeForCausalLM:
    return Qwen3MoeForCausalLM(config, attention, dtype, device, group)


def build_mixtral(
    config: ModelConfig,
    attention: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    group: TensorParallel = SINGLE,
) -> MixtralForCausalLM:
    return MixtralForCausalLM(config, attention, dtype, device, group)


@hookimpl
def register_models(register) -> None:  # type: ignore[no-untyped-def]
    register(
        "Qwen3MoeForCausalLM", build_qwen3_moe, description="Qwen3 MoE (top-k router, experts)"
    )
    register("MixtralForCausalLM", build_mixtral, description="Mixtral MoE (top-2 router)")
