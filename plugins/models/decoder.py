"""One decoder skeleton for the built-in model families (Llama, Qwen2/3, Gemma2, MoE).

A family is a ``DecoderForCausalLM`` subclass naming its ``DecoderLayer`` subclass; each overrides
only the pieces it changes. The extension points:

``DecoderLayer`` (class attributes and methods)
    ``norm_cls``          RMSNorm (``weight * x``) or GemmaRMSNorm (``(1 + weight) * x``)
    ``attention_biases``  (qkv bias, o_proj bias) from the config; Llama: ``attention_bias``
    ``qk_norm``           per-head RMSNorm of q and k before RoPE (Qwen3)
    ``attention_options`` per-layer keywords for the attention backend: ``sliding_window``,
                          ``logit_softcap``, ``scale`` (only non-default ones are passed)
    ``build_mlp`` / ``mlp``  the feed-forward block (dense gated MLP here, a MoE in ``moe.py``)
    ``mlp_input``         how the attention output joins the residual stream before the MLP
    ``mlp_output``        what happens to the MLP output (Gemma2: a post-feedforward norm)

``DecoderForCausalLM`` (class attributes and methods)
    ``layer_cls``                   the layer class
    ``default_tie_word_embeddings`` when ``config.json`` does not say
    ``embed``                       token embeddings (Gemma2 scales them by sqrt(hidden))
    ``logits``                      the LM head (Gemma2 soft-caps the final logits)
    ``weight_target``               HF weight name -> (our parameter, expert, row offset)

Projections are fused (qkv, gate_up) to cut per-step kernel launches; attention goes through the
selected attention plugin, which owns the paged KV access. The residual stream is carried beside
each layer's output so the residual add and the next RMSNorm can be one kernel: on CUDA/ROCm
devices add+RMSNorm, RoPE and SiLU-mul run as single Triton kernels (``fused_ops.py``), on the CPU
as C++ ones (``plugins/hardware/cpu_fused_ops.py``), elsewhere as eager torch code (same rounding
steps). The norms, RoPE and activations are ``blocks.py``'s; ``kernel_choice.py`` picks the
kernels at build time, ``weight_loading.py`` loads a checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.core.batch import ForwardBatch
from radixserve.core.config import ConfigError, ModelConfig
from radixserve.core.interfaces import AttentionBackend, CausalLM
from radixserve.core.parallel import (
    SINGLE,
    TensorParallel,
    split_heads,
    split_range,
    vocab_shard,
)
from radixserve.plugins.models.blocks import (
    RMSNorm,
    RotaryEmbedding,
    Unreduced,
    activation,
    reduced,
    rope_inv_freq,
)
from radixserve.plugins.models.decoder_config import check_supported, layer_window, required
from radixserve.plugins.models.kernel_choice import (
    attach_fused_ops,
    check_attention_options,
    fused_ops_for,
    takes_rotary,
    triton_gemv_config,
)
from radixserve.plugins.models.parallel_layers import (
    DECODER_TP_PLAN,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab,
)
from radixserve.plugins.models.weight_loading import Target, load_decoder_weights


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: RMSNorm -> attention -> residual -> RMSNorm -> MLP."""

    norm_cls: type[RMSNorm] = RMSNorm
    #: per-head RMSNorm of q and k (over head_dim) before RoPE, as Qwen3 does
    qk_norm: bool = False

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        attention: AttentionBackend,
        group: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        raw = config.raw
        self.config = config
        self.layer_id = layer_id
        #: this layer's index in the KV pool (its index within a pipeline stage's layers)
        self.kv_layer = layer_id
        self.attention = attention
        # Tensor parallelism: this rank's query heads and the KV heads they read.
        self.tp = tp = group
        heads = split_heads(config.num_heads, config.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        eps = float(raw.get("rms_norm_eps", 1e-6))
        qkv_bias, o_bias = self.attention_biases(raw)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, o_bias, tp)
        if self.qk_norm:
            self.q_norm = self.norm_cls(self.head_dim, eps)
            self.k_norm = self.norm_cls(self.head_dim, eps)
        self.build_mlp(config)
        self.input_layernorm = self.norm_cls(config.hidden_size, eps)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, eps)
        self.attn_options = self.attention_options(config)
        self.fused: ModuleType | None = None
        # Under tensor parallelism o_proj's and down_proj's all-reduces join the add + RMSNorm
        # after them (TensorParallel.all_reduce_add_rms_norm): one kernel instead of two where
        # the platform fuses them. Only where those steps are the skeleton's own.
        cls, plain = type(self), self.norm_cls is RMSNorm and tp.size > 1
        self.defer_o_reduce = plain and not o_bias and cls.mlp_input is DecoderLayer.mlp_input
        self.defer_down_reduce = (
            plain and cls.mlp is DecoderLayer.mlp and cls.mlp_output is DecoderLayer.mlp_output
        )
        # the Triton GEMV for one-row steps (DecoderForCausalLM sets it on CUDA)
        self.gemv_cfg: tuple[int, int, int] | None = None
        self.gemv_silu = False  # SiLU(gate) * up inside down_proj's GEMV
        # q and k go to the attention backend unrotated, its K/V store applies RoPE
        self.rope_in_attention = False

    # ---- extension points ----

    def attention_biases(self, raw: dict[str, Any]) -> tuple[bool, bool]:
        bias = bool(raw.get("attention_bias", False))
        return bias, bias

    def attention_options(self, config: ModelConfig) -> dict[str, Any]:
        """Keywords for ``attention.forward`` (none: the plain AttentionBackend call)."""
        window = layer_window(config.raw, self.layer_id)
        return {"sliding_window": window} if window else {}

    def build_mlp(self, config: ModelConfig) -> None:
        inter = split_range(int(required(config.raw, "intermediate_size")), self.tp).size
        self.intermediate_size = inter
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, self.tp)
        act = config.raw.get("hidden_activation") or config.raw.get("hidden_act") or "silu"
        self.act_name = act
        self.act = activation(act)

    def product(self, module: nn.Module, x: torch.Tensor, silu: bool = False) -> Any:
        """``module``'s product (no bias, no all-reduce) through the Triton GEMV on CUDA
        (plugins/hardware/gemv.py; RADIXSERVE_TRITON_GEMV=0 turns it off) where the kernel
        takes ``x`` (one row), else None.
        ``silu``: x is [gate | up] and the product's input SiLU(gate) * up."""
        cfg = self.gemv_cfg
        if cfg is None or not isinstance(module, nn.Linear) or module.bias is not None:
            return None
        from radixserve.plugins.hardware import gemv

        if not gemv.takes(x, module.weight, cfg, silu):
            return None
        return gemv.gemv(x, module.weight, cfg, silu)

    def mlp(self, x: torch.Tensor) -> Any:
        gate_up = self.product(self.gate_up_proj, x)
        if gate_up is None:
            gate_up = self.gate_up_proj(x)
        silu = self.fused is not None and self.act_name in ("silu", "swish")
        part = self.product(self.down_proj, gate_up, silu=True) if silu and self.gemv_silu else None
        if part is None:  # else the activation is inside the product
            if silu:
                act = self.fused.silu_mul(gate_up)  # type: ignore[union-attr]
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = self.act(gate) * up
        # the next layer's input add + RMSNorm all-reduces it (a quantized one: itself)
        if self.defer_down_reduce and isinstance(self.down_proj, RowParallelLinear):
            down: Any = Unreduced(part if part is not None else self.down_proj.partial(act))
        elif part is not None:
            down = self.tp.all_reduce(part)
        else:
            down = self.down_proj(act)
        return down

    def mlp_input(self, attn: Any, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's input, the residual stream) from the attention block's output."""
        if isinstance(attn, Unreduced):
            return self.reduce_add_norm(attn, residual, self.post_attention_layernorm, 0)
        return self.post_attention_layernorm.add_forward(attn, residual)

    def reduce_add_norm(
        self, h: Unreduced, residual: torch.Tensor, norm: RMSNorm, site: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(all_reduce(h) + residual), all_reduce(h) + residual): one fused collective
        where the platform has it, else the all-reduce and then the add + RMSNorm."""
        fused = self.tp.all_reduce_add_rms_norm(h.partial, residual, norm.weight, norm.eps, site)
        if fused is not None:
            return fused
        return norm.add_forward(self.tp.all_reduce(h.partial), residual)

    def mlp_output(self, out: torch.Tensor) -> torch.Tensor:
        return out

    # ---- the fixed part ----

    def self_attention(self, x: torch.Tensor, rope: RotaryEmbedding, batch: ForwardBatch) -> Any:
        qkv = self.product(self.qkv_proj, x)
        if qkv is None:
            qkv = self.qkv_proj(x)
        t, qk_size = x.shape[0], self.q_size + self.kv_size
        # q and k heads rotate alike: one RoPE over both (one kernel launch on a GPU)
        qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(qk[:, : self.num_heads].reshape(-1, self.head_dim))
            k = self.k_norm(qk[:, self.num_heads :].reshape(-1, self.head_dim))
            qk = torch.cat((q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim)), dim=1)
        options = self.attn_options
        if self.rope_in_attention:
            options = {**options, "rotary": (batch.positions, rope.cos, rope.sin)}
        else:
            qk = rope.apply(qk, batch.positions)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(q, k, v, self.kv_layer, batch, **options)
        # mlp_input's add + RMSNorm all-reduces it (a quantized o_proj reduces its own)
        part = self.product(self.o_proj, out)
        if self.defer_o_reduce and isinstance(self.o_proj, RowParallelLinear):
            o: Any = Unreduced(part if part is not None else self.o_proj.partial(out))
        elif part is not None:
            o = self.tp.all_reduce(part)
        else:
            o = self.o_proj(out)
        return o

    def forward(
        self, h: Any, residual: torch.Tensor | None, rope: RotaryEmbedding,
        batch: ForwardBatch,
    ) -> tuple[Any, torch.Tensor]:  # fmt: skip
        """h: the previous layer's output (the embeddings for layer 0), residual: the stream it
        adds to (None for layer 0). Returns (this layer's MLP output, the stream before it);
        under tensor parallelism the output may be ``Unreduced`` (``reduced`` resolves it)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        elif isinstance(h, Unreduced):
            x, residual = self.reduce_add_norm(h, residual, self.input_layernorm, 1)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        attn = self.self_attention(x, rope, batch)
        x, residual = self.mlp_input(attn, residual)
        return self.mlp_output(self.mlp(x)), residual


#: (HF leaf, our fused leaf, which third/half) for the fused projections
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_LAYER = re.compile(r"^layers\.(\d+)\.")


class DecoderForCausalLM(nn.Module, CausalLM):
    layer_cls: type[DecoderLayer] = DecoderLayer
    default_tie_word_embeddings: bool = False
    #: how the checkpoint's tensors shard under tensor parallelism (None: not supported)
    tp_plan: dict[str, str] | None = DECODER_TP_PLAN
    #: the forward waits for each layer's KV loaded from host memory (WaitsForKVLayers)
    waits_for_kv_layers: bool = True

    def __init__(
        self,
        config: ModelConfig,
        attention: AttentionBackend,
        dtype: torch.dtype,
        device: str,
        group: TensorParallel = SINGLE,
    ) -> None:
        """``group``: the tensor-parallel group this rank's share of the model is built for
        (its layers hold this rank's heads, features and vocabulary rows)."""
        super().__init__()
        self.config = config
        raw = config.raw
        self.tie_word_embeddings = bool(
            raw.get("tie_word_embeddings", self.default_tie_word_embeddings)
        )
        check_supported(raw)
        rope_inv_freq(config)  # an unsupported rope_scaling stops here, before any allocation
        norm_cls = self.layer_cls.norm_cls
        self.tp = tp = group
        # Pipeline parallelism: this stage's run of layers; the embedding where it is read
        # (the first stage; the last too when the LM head is tied to it), the final norm and
        # the LM head on the last stage.
        self.stage = stage = tp.stage
        first, last = stage is None or stage.first, stage is None or stage.last
        self.first_layer, n_layers = (0, config.num_layers) if stage is None else stage.layers
        self.computes_logits = last
        with torch.device("meta"):
            if first or (last and self.tie_word_embeddings):
                self.embed_tokens = VocabParallelEmbedding(
                    config.vocab_size, config.hidden_size, tp
                )
            self.layers = nn.ModuleList(
                self.layer_cls(config, self.first_layer + i, attention, tp) for i in range(n_layers)
            )
            if last:
                self.norm = norm_cls(config.hidden_size, float(raw.get("rms_norm_eps", 1e-6)))
            if last and not self.tie_word_embeddings:
                shard = vocab_shard(config.vocab_size, tp)[1]
                self.lm_head = nn.Linear(config.hidden_size, shard, bias=False)
        for i, layer in enumerate(self.layers):
            layer.kv_layer = i
        # NOTE: cast on the meta device first: allocating in float32 and casting after would
        # need twice a bfloat16 model's memory at start-up (the KV pool already holds the rest).
        check_attention_options(attention, [layer.attn_options for layer in self.layers])
        self.to(dtype)
        self.to_empty(device=device)
        self.rope = RotaryEmbedding(config, device, dtype)
        #: a module computing the LM head's logits in place of ``F.linear`` over its weight
        #: (set by weight-only quantization, plugins/models/quant.py)
        self.head: nn.Module | None = None
        fused = fused_ops_for(device)
        attach_fused_ops(self, fused)
        rope_in_attention = takes_rotary(attention, fused is not None)
        for layer in self.layers:
            layer.rope_in_attention = rope_in_attention
        gemv_cfg = triton_gemv_config(device)
        if gemv_cfg is not None:
            from radixserve.plugins.hardware.gemv import fuse_silu

            for layer in self.layers:
                layer.gemv_cfg, layer.gemv_silu = gemv_cfg, fuse_silu()

    # ---- extension points ----

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits from the final-normed hidden states of the rows that need them."""
        if self.head is not None:
            return gather_vocab(self.head(h), self.config.vocab_size, self.tp).float()
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return gather_vocab(F.linear(h, weight), self.config.vocab_size, self.tp).float()

    def weight_target(self, name: str) -> Target | None:
        """Where the HF tensor ``name`` (without the ``model.`` prefix) goes; None skips it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        m = _LAYER.match(name)
        if m is None:
            return name, None, None
        layer = self.layers[int(m.group(1))]
        prefix, rest = m.group(0), name[m.end() :]
        block, _, leaf = rest.partition(".")
        proj, _, kind = leaf.partition(".")
        if block == "self_attn":
            if proj in _QKV:
                offset = (0, layer.q_size, layer.q_size + layer.kv_size)[_QKV[proj]]
                return f"{prefix}qkv_proj.{kind}", None, offset
            return f"{prefix}{leaf}", None, None
        if block == "mlp" and proj in _GATE_UP:
            return f"{prefix}gate_up_proj.{kind}", None, _GATE_UP[proj] * layer.intermediate_size
        if block == "mlp" and proj == "down_proj":
            return f"{prefix}down_proj.{kind}", None, None
        return name, None, None

    def set_batch_invariant(self) -> None:
        """--enable-deterministic-inference (core/deterministic.py): every linear and the LM
        head in fixed row blocks (invariant_ops.py) unless its kernel is batch-invariant
        already (the CPU's AVX2 panels), no one-row Triton GEMV (another kernel than the
        blocks'). RMSNorm, RoPE and SiLU-mul are per-row already (eager, the CPU's
        C++ kernels, the Triton ones: one program a row)."""
        from radixserve.plugins.models.invariant_ops import (
            BlockHead,
            block_linears,
            keeps_rows_apart,
            row_block_for,
        )

        if any(type(layer).mlp is not DecoderLayer.mlp for layer in self.layers):
            raise ConfigError(
                "--enable-deterministic-inference does not run MoE models: their expert "
                "kernels group the step's tokens by expert"
            )
        block = row_block_for(next(self.parameters()).device)
        for layer in self.layers:
            layer.gemv_cfg = None
            block_linears(layer, block)
        if self.computes_logits and (self.head is None or not keeps_rows_apart(self.head)):
            weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
            self.head = BlockHead(weight.data, block)

    def attach_lora(self, config: Any, device: str) -> Any:
        """Wrap the projections for LoRA adapters (core/lora.py's AdapterWeights)."""
        from radixserve.plugins.models.lora_layers import attach_lora

        return attach_lora(self, config, device)

    # ---- the fixed part ----

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.stage_input is None:
            h, residual = self.embed(batch.input_ids), None
        else:  # a later pipeline stage: the residual stream as the stage before left it
            h, residual = batch.stage_input, None
        self.rope.new_step()
        capture = batch.capture_hidden_layers
        if capture:
            batch.hidden_states = {}
        pool = batch.kv_pool
        loading = pool.layer_loads is not None  # HiCache: KV still copying in, per layer
        for i, layer in enumerate(self.layers):
            if loading:
                pool.wait_layer(layer.kv_layer)
            h, residual = layer(h, residual, self.rope, batch)
            if i in capture:
                h = reduced(h, self.tp)
                batch.hidden_states[i] = h + residual  # type: ignore[index]
        h = reduced(h, self.tp)
        if not self.computes_logits:  # the next stage goes on from the residual stream
            return h if residual is None else h + residual
        if batch.hidden_rows is not None:
            batch.final_hidden = self._final_norm(h, residual, batch.hidden_rows)
        return self.logits(self._final_norm(h, residual, batch.logits_indices))

    def _final_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor
    ) -> torch.Tensor:
        if residual is None:  # a model without layers
            return self.norm(h[rows])
        return self.norm.add_forward(h[rows], residual[rows])[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_decoder_weights(self, weights)

    def stage_name(self, name: str) -> str | None:
        """A checkpoint name (without ``model.``) as this pipeline stage's parameters name it
        (its layers counted from 0), or None for a tensor another stage holds."""
        if self.stage is None:
            return name
        m = _LAYER.match(name)
        if m is None:
            owned = {p.split(".", 1)[0] for p, _ in self.named_parameters()}
            return name if name.split(".", 1)[0] in owned else None
        local = int(m.group(1)) - self.first_layer
        if not 0 <= local < len(self.layers):
            return None
        return f"layers.{local}.{name[m.end() :]}"
