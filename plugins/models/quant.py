"""Quantization at load (``--quantization``), on torch's own CPU kernels and radixserve's.

After the checkpoint is loaded, every ``nn.Linear`` of the decoder layers is replaced by a
quantized one, and the LM head becomes a ``ScreenedHead`` (below; the embedding lookup keeps its
float weights):

``int8wo``  int8 weights, one symmetric scale per output row; ``aten._weight_int8pack_mm``.
``int4wo``  4-bit weights in groups of 32 input features, each with a scale and a zero point
            (asymmetric, min/max); ``aten._weight_int4pack_mm_for_cpu``. A GGUF file's Q4_1
            blocks are this layout (32 weights, ``d * q + m``): the default model's weights
            get back the file's own 4-bit codes, with d and the kernel's zero point (m + 8 d)
            rounded to bf16 (an error far below one code step).

``w8a8_int8``  int8 weights, one symmetric scale per output row, and int8 activations
            quantized per step with one scale per tensor (SGLang's name for the scheme);
            fbgemm's dynamic quantized linear (``quantized.linear_dynamic``), which on an
            AVX2 CPU multiplies int8 by int8 in integer arithmetic where the weight-only
            kernels convert every weight to float. Not weight-only: the activations' rounding
            (7 bits, fbgemm's reduced range) is an error of its own, reported beside the others
            in bench/HISTORY.md. It takes float32 activations; on the 2-core AVX2 VM it
            was not faster than ``int4wo`` end to end (bench/HISTORY.md).

``gguf``    GGUF's Q4_1 blocks (4-bit codes in groups of 32 with a float16 scale and minimum;
            the default model's file is Q4_1, and its codes come back), multiplied the way
            llama.cpp multiplies them: each step's activations are rounded to 8-bit blocks of
            32 with a scale each, and the products are summed in integers (radixserve's CPU
            kernels, ``cpu_kernels/q4_linear.cpp``). Like ``w8a8_int8`` it is not
            weight-only; its activation rounding (8 bits per 32 values) is llama.cpp's own.

The weight-only kernels run with bfloat16 activations (with float32 ones they fall back to slow
paths): such a layer casts its input to bfloat16 and its output back to the model's dtype.
Quantization happens once, on the loaded float weights; nothing is dequantized per step.

The kernels pay off where a step reads the weights for a few rows (decoding): they are
compute-bound on many rows, so a prefill chunk of 256 tokens took twice float32's time to its
first token. Each decoder layer also keeps its quantized weights dequantized (the same values),
and a step of ``DENSE_MIN_ROWS`` rows or more multiplies by those: in bfloat16 (twice the int4
bytes) where oneDNN has fast bfloat16 GEMM (AVX-512 or AMX), in float32 elsewhere, since on an
AVX2-only CPU a bfloat16 GEMM is emulated (256 x 576 -> 3,072 on one core of the AMD EPYC VM:
145 ms in bfloat16, 23 ms in float32, 40 ms with the int4 kernel).

The LM head is a decode step's largest single read (49,152 x 576 on the default model: 28 MB in
int8). ``ScreenedHead`` scores a decode step's rows with 4-bit weights (about 16 MB) and rescores
each row's ``SCREEN_TOP`` best candidates with the float weights (shared with the embedding when
tied), so the tokens greedy decoding and top-k sampling choose from carry float logits and only
the tail of the distribution carries 4-bit error. Prefill-sized steps multiply by the float
weights in full.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from functools import cache
from typing import Any

import torch
from torch import nn

from radixserve.core.config import ConfigError
from radixserve.plugins.models.parallel_layers import RowParallelLinear

INT4_GROUP = 32
_ACT = torch.bfloat16  # the activation dtype both kernels are fast with
#: rows from which a step multiplies by the dequantized copy instead of the quantized kernel
DENSE_MIN_ROWS = 16
#: candidates per row that ``ScreenedHead`` rescores with the float weights
SCREEN_TOP = 64


class QuantizedLinear(nn.Module):
    """A linear layer over quantized weights; the bias (if any) stays in the model's dtype.
    Row-parallel layers (tensor parallelism) all-reduce their partial outputs as before."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.tp = linear.tp if isinstance(linear, RowParallelLinear) else None
        #: the quantized weights dequantized [out, in], for steps of many rows (None: none kept)
        self.dense: torch.Tensor | None = None

    def keep_dense(self) -> None:
        """Keep a dequantized copy of the quantized weights for prefill-sized steps."""
        self.dense = self.dequantized().to(dense_dtype())

    def dequantized(self) -> torch.Tensor:
        """The weights the kernel multiplies by, as float32 [out, in]."""
        raise NotImplementedError

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """Whether the kernel takes this layer's shape (one that does not stays in float)."""
        return True

    #: the activation dtype the kernel is fast with
    activation_dtype = _ACT

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _plain_rows(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes to the kernel as it is: rows of the kernel's activation dtype,
        fewer than take the dense copy, and nothing to add or reduce after the product."""
        return (
            x.dim() == 2
            and x.shape[0] < DENSE_MIN_ROWS
            and x.dtype == self.activation_dtype
            and self.bias is None
            and (self.tp is None or self.tp.size == 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._plain_rows(x):  # a decode step's rows: the kernel alone (~10 us less a call)
            return self.matmul(x)
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.dense is not None and rows.shape[0] >= DENSE_MIN_ROWS:
            out = torch.nn.functional.linear(rows.to(self.dense.dtype), self.dense).to(x.dtype)
        else:
            out = self.matmul(rows.to(self.activation_dtype)).to(x.dtype)
        out = out.view(*shape[:-1], self.out_features)
        if self.tp is not None and self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class Int8Linear(QuantizedLinear):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q, scales = quantize_int8(linear.weight.data)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


class Int8DynamicLinear(QuantizedLinear):
    """int8 weights and dynamically quantized int8 activations on fbgemm (torch's own CPU
    quantized backend). fbgemm packs the weights once, for its own blocked layout."""

    activation_dtype = torch.float32

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q, scales = quantize_int8(linear.weight.data)
        self.scales = scales.float()
        with warnings.catch_warnings():  # quantized tensors are deprecated, fbgemm is not
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                q, self.scales.double(), torch.zeros_like(self.scales, dtype=torch.long), 0
            )
        self._codes: torch.Tensor | None = q  # for keep_dense, then dropped
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self._key = _register_packed(self.packed)

    def dequantized(self) -> torch.Tensor:
        assert self._codes is not None, "the int8 codes are kept only until keep_dense"
        return self._codes.float() * self.scales[:, None]

    def keep_dense(self) -> None:
        super().keep_dense()
        self._codes = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.radixserve.w8a8_int8_linear(x, self._key, self.out_features)


# torch.compile cannot trace fbgemm's packed weights (a TorchScript object), so the product is
# an opaque custom op that finds them by a key: compiled graphs call it like any extern kernel.
# The layer owns its weights; the registry only finds them, and forgets them with the layer.
_PACKED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_PACKED_KEYS = itertools.count()


def _register_packed(packed: Any) -> int:
    key = next(_PACKED_KEYS)
    _PACKED[key] = packed
    return key


@torch.library.custom_op("radixserve::w8a8_int8_linear", mutates_args=())
def _w8a8_int8_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    # reduce_range: 7-bit activations, so AVX2's 16-bit pairwise sums cannot saturate
    return torch.ops.quantized.linear_dynamic(x, _PACKED[key], True)


@_w8a8_int8_linear.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class Int4Linear(QuantizedLinear):
    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        # whole groups of inputs; the kernel's packing takes outputs in sixteens
        return linear.in_features % INT4_GROUP == 0 and linear.out_features % 16 == 0

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__(linear)
        self.group = group
        q, scale_zero = quantize_int4(linear.weight.data, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("qweight", packed)
        self.register_buffer("scale_zero", scale_zero)
        self._codes: torch.Tensor | None = q.to(torch.uint8)  # for keep_dense, then dropped

    def dequantized(self) -> torch.Tensor:
        assert self._codes is not None, "the 4-bit codes are kept only until keep_dense"
        out_f, in_f = self._codes.shape
        scale = self.scale_zero[..., 0].float().t()[..., None]  # [out, groups, 1]
        zero = self.scale_zero[..., 1].float().t()[..., None]
        codes = self._codes.view(out_f, in_f // self.group, self.group).float()
        return ((codes - 8.0) * scale + zero).view(out_f, in_f)

    def keep_dense(self) -> None:
        super().keep_dense()
        self._codes = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.qweight, self.group, self.scale_zero
        )


class Q4BlockLinear(QuantizedLinear):
    """GGUF's Q4_1 blocks (``gguf``): 4-bit codes in groups of 32 input features with a
    float16 scale d and minimum m each (w = d * q + m), multiplied as llama.cpp does, with the
    activations rounded per step to 8-bit blocks of 32 (``cpu_kernels/q4_linear.cpp``). The
    default model's file is Q4_1: its codes, d and m come back exactly from its dequantized
    weights wherever a group uses codes 0 and 15 (min/max rounding, d and m in float16)."""

    activation_dtype = torch.float32

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        return linear.in_features % INT4_GROUP == 0

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        # the op (and its shape rule), or why the kernels cannot be built here; the overload
        # itself, since calling through the op's packet costs a few us more a call
        self._op = q4_kernels().q4_1_linear.default
        self.register_buffer("blocks", quantize_q4_1(linear.weight.data))

    def dequantized(self) -> torch.Tensor:
        return dequantize_q4_1(self.blocks, self.in_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.blocks)


Q4_BLOCK_BYTES = 20  # float16 d, float16 m, 16 bytes of paired 4-bit codes


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float -> uint8 [out, in / 32 * 20], GGUF's block_q4_1 per 32 inputs: float16
    d and m (w ~= d * q + m, q in 0..15), then byte j = q[j] | q[j + 16] << 4."""
    out_f, in_f = weight.shape
    w = weight.float().view(out_f, in_f // INT4_GROUP, INT4_GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    # d and m are rounded to float16 first, so each code is the nearest under the stored ones
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    step = d.float().clamp(min=1e-12)[..., None]
    q = torch.round((w - m.float()[..., None]) / step).clamp(0, 15).to(torch.uint8)
    half = INT4_GROUP // 2
    codes = q[..., :half] | (q[..., half:] << 4)
    scales = torch.stack([d, m], dim=-1).view(torch.uint8)  # [out, groups, 4]
    return torch.cat([scales, codes], dim=-1).reshape(out_f, -1).contiguous()


def dequantize_q4_1(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 [out, in] weights ``quantize_q4_1``'s blocks stand for."""
    out_f = blocks.shape[0]
    b = blocks.view(out_f, in_features // INT4_GROUP, Q4_BLOCK_BYTES)
    d, m = b[..., :4].contiguous().view(torch.float16).float().unbind(-1)
    codes = b[..., 4:]
    q = torch.cat([codes & 0x0F, codes >> 4], dim=-1).float()
    return (q * d[..., None] + m[..., None]).view(out_f, in_features)


def q4_kernels() -> Any:
    """``torch.ops.radixserve_cpu`` with the 4-bit block linear (and its shape rule for
    torch.compile), or a ConfigError saying why the CPU kernels cannot be built here."""
    from radixserve.plugins.hardware import cpu_kernels

    reason = cpu_kernels.unavailable_reason()
    if reason is not None:
        raise ConfigError(f"--quantization gguf needs radixserve's CPU kernels: {reason}")
    return _q4_ops()


@cache
def _q4_ops() -> Any:
    from radixserve.plugins.hardware import cpu_kernels

    ops = cpu_kernels.load()

    @torch.library.register_fake("radixserve_cpu::q4_1_linear")
    def _(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], blocks.shape[0])

    return ops


class ScreenedHead(nn.Module):
    """The LM head under weight-only quantization: float logits for each row's ``SCREEN_TOP``
    best candidates as 4-bit weights score them, 4-bit ones for the rest of the vocabulary.

    On the default model, one thread of the 2-core AMD VM (AVX2), the head alone with its
    weights read from memory: 4.6 ms (4-bit screen in groups of 64, then rescoring) against
    7.4 ms for the per-row int8 head it replaces; a compiled int4wo decode step 29.9 against
    32.3 ms. Greedy tokens come closer to float32's (the head picks float32's best token
    whenever it is among the candidates): 69% against 44% identical over 16 prompts x 64."""

    def __init__(self, weight: torch.Tensor, blocks: bool = False) -> None:
        """``blocks``: screen with ``Q4BlockLinear`` (``gguf``) instead of torch's int4 kernel."""
        super().__init__()
        #: [vocab, hidden] in the model's dtype (the embedding's own tensor when tied)
        self.weight = weight
        out_f, in_f = weight.shape
        linear = nn.Linear(in_f, out_f, bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        self.screen: QuantizedLinear
        if blocks:
            self.screen = Q4BlockLinear(linear)
        else:
            # groups of 64: half the scales of 32 and 15% faster here; the candidates get float
            # logits anyway, so the screen's coarser rounding only has to keep the best of them
            self.screen = Int4Linear(linear, 64 if in_f % 64 == 0 else INT4_GROUP)
            self.screen._codes = None  # no bfloat16 copy: many rows multiply by ``weight``
        self.top = min(SCREEN_TOP, out_f)

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        out_f, in_f = weight.shape
        return Int4Linear.supports(nn.Linear(in_f, out_f, bias=False, device="meta"))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = h.reshape(-1, h.shape[-1])
        if rows.shape[0] >= DENSE_MIN_ROWS:  # prefill-sized: one float GEMM, as fast here
            return torch.nn.functional.linear(rows, self.weight)
        approx = self.screen(rows)
        top = approx.topk(self.top, dim=-1).indices  # [rows, top]
        exact = torch.bmm(self.weight[top], rows.unsqueeze(-1)).squeeze(-1)
        return approx.scatter(-1, top, exact)


def dense_dtype() -> torch.dtype:
    """The dtype of the quantized layers' dequantized copies: bfloat16 where oneDNN multiplies
    it natively, else float32 (twice the memory, six times faster on AVX2)."""
    return _ACT if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], bf16 scales [out]): w ~= q * scale per row."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(_ACT)
    q = torch.round(w / scales.float()[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int32 codes 0..15 [out, in], bf16 [in / group, out, 2] scale and
    zero), with w ~= (q - 8) * scale + zero inside each group of ``group`` input features
    (the kernel's convention)."""
    out_f, in_f = weight.shape
    w = weight.float().view(out_f, in_f // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12).to(_ACT)
    # The zero point is rounded to bf16 before the codes are chosen, so each code is the
    # nearest one under the scale and zero the kernel will use.
    zero = (lo + 8.0 * scale.float()).to(_ACT)
    base = zero.float() - 8.0 * scale.float()  # the value of code 0
    q = torch.round((w - base[..., None]) / scale.float()[..., None]).clamp(0, 15)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q.view(out_f, in_f).to(torch.int32), scale_zero


_METHODS: dict[str, type[QuantizedLinear]] = {
    "int8wo": Int8Linear,
    "int4wo": Int4Linear,
    "w8a8_int8": Int8DynamicLinear,
    "gguf": Q4BlockLinear,
}


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace the linear layers of ``model.layers`` by ``method``'s quantized ones and give
    the model a screened LM head (``model.head``; int8 where the 4-bit kernel cannot take the
    head's shape). Returns the layers replaced."""
    cls = _METHODS.get(method)
    if cls is None:
        raise ConfigError(f"unknown quantization '{method}'; choose one of {', '.join(_METHODS)}")
    layers = getattr(model, "layers", None)
    if layers is None or not hasattr(model, "head"):
        raise ConfigError(
            f"model {type(model).__name__} does not support --quantization (it needs the "
            "decoder skeleton's layers and LM head)"
        )
    replaced = 0
    for layer in layers:
        for name, child in list(layer.named_modules()):
            if type(child) not in (nn.Linear, RowParallelLinear):
                continue
            if not cls.supports(child):
                continue
            parent_name, _, leaf = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            quantized = cls(child)
            quantized.keep_dense()
            setattr(parent, leaf, quantized)
            replaced += 1
    weight = model.lm_head.weight if hasattr(model, "lm_head") else model.embed_tokens.weight
    if ScreenedHead.supports(weight.data):
        # an untied lm_head's float weights stay: they rescore the candidates
        model.head = ScreenedHead(weight.data, blocks=cls is Q4BlockLinear)
        return replaced
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight.data, requires_grad=False)
    model.head = Int8Linear(head)
    if hasattr(model, "lm_head"):
        del model.lm_head  # its float copy is no longer read
    return replaced
