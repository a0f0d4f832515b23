"""FP8 weights (``--quantization fp8``, plugins/models/fp8.py and fp8_loading.py).

- the product's rounding: FP8 e4m3 weights and per-token FP8 activations against the float
  product, within 5% of its norm (each operand's 3-bit mantissa rounds by up to 1/16 of a
  value; measured ~3.7% on random matrices);
- the block-scaled Triton kernel (interpreted on a CPU machine, compiled on a GPU) equals the
  float32 reference of the same rounding; on a GPU ``torch._scaled_mm`` does too;
- checkpoints: per-tensor and block-scaled HF ``fp8`` ones and a compressed-tensors
  per-channel one, written here from a tiny Llama, load dequantized without --quantization,
  and quantize_model makes layers of the checkpoint's own codes whose logits stay near the
  dequantized model's;
- the CPU refuses ``--quantization fp8`` in one line naming what it supports.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton", reason="the 'triton' package is not installed")

from platform_choice import on_cpu  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from radixserve.core.config import ConfigError, EngineConfig  # noqa: E402
from radixserve.core.model_runner import ModelRunner  # noqa: E402
from radixserve.core.plugins import default_host  # noqa: E402
from radixserve.core.request import Req, SamplingParams  # noqa: E402
from radixserve.core.step_plan import StepPlan  # noqa: E402
from radixserve.plugins.hardware.cpu import CpuPlatform  # noqa: E402
from radixserve.plugins.models import fp8, fp8_loading  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
#: |fp8 product - float product| / |float product| (Frobenius) at most this
REL_TOL = 0.05


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_fp8_linear_is_within_its_rounding_of_the_float_product(kind: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 384)
    w = torch.randn(320, 384) * 0.05
    exact = x @ w.t()
    if kind == "channel":
        q, s = fp8.quantize_rows(w)
        layer = fp8.Fp8Linear(q, s)
    else:
        q, s = fp8.quantize_blocks(w)
        layer = fp8.Fp8Linear(q, s, block=(128, 128))
    out = layer(x)
    assert out.shape == (7, 320)
    assert _rel(out, exact) < REL_TOL
    # no closer than rounding allows: the layer really runs in FP8
    assert _rel(out, exact) > 1e-3
    # bf16 activations come back in bf16
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_dequantize_reads_every_scale_layout() -> None:
    torch.manual_seed(1)
    w = torch.randn(96, 80)
    q, s = fp8.quantize_rows(w)
    per_row = q.float() * s[:, None]
    assert torch.equal(fp8.dequantize(q, s), per_row)
    assert torch.equal(fp8.dequantize(q, s[:, None]), per_row)
    assert torch.equal(fp8.dequantize(q, torch.tensor(0.5)), q.float() * 0.5)
    qb, sb = fp8.quantize_blocks(w, (32, 32))
    assert sb.shape == (3, 3)  # 96 / 32 rows, ceil(80 / 32) columns
    assert _rel(fp8.dequantize(qb, sb, (32, 32)), w) < 0.04
    with pytest.raises(ValueError, match="blocks"):
        fp8.dequantize(qb, torch.ones(2, 2), (32, 32))


@pytest.mark.parametrize(("m", "k", "n"), [(1, 256, 96), (5, 384, 320), (19, 200, 130)])
def test_block_kernel_equals_the_reference(m: int, k: int, n: int) -> None:
    """The Triton block-FP8 GEMM (ragged K and N included) against the float32 product of
    the same FP8 operands and scales."""
    torch.manual_seed(m)
    x = torch.randn(m, k, device=DEVICE)
    q, s = fp8.quantize_blocks(torch.randn(n, k, device=DEVICE) * 0.05)
    out = fp8.block_fp8_matmul(x, q, s, (128, 128), torch.float32)
    ref = fp8.reference_matmul(x, q, s, (128, 128))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    out_bf16 = fp8.block_fp8_matmul(x.bfloat16(), q, s, (128, 128), torch.bfloat16)
    ref_bf16 = fp8.reference_matmul(x.bfloat16(), q, s, (128, 128))
    assert _rel(out_bf16, ref_bf16) < 0.005  # the output's bf16 rounding only


@pytest.mark.skipif(not CUDA, reason="torch._scaled_mm runs on FP8 tensor cores")
def test_scaled_mm_equals_the_reference() -> None:
    torch.manual_seed(2)
    for m in (1, 16, 300):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        q, s = fp8.quantize_rows(torch.randn(1024, 4096, device="cuda") * 0.02)
        ref = fp8.reference_matmul(x, q, s, None)
        assert _rel(fp8.scaled_mm(x, q, s), ref) < 0.01


# ---- checkpoints ----

PROJ = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
CONFIGS = {
    "tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]},
    "channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    },
}


def write_fp8_checkpoint(src: Path, dst: Path, form: str) -> dict[str, torch.Tensor]:
    """``src``'s checkpoint with every projection stored in FP8 in ``form``; returns the
    codes written, by tensor name."""
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    codes = {}
    for name in list(tensors):
        if not name.endswith(".weight") or not any(p in name for p in PROJ):
            continue
        w = tensors[name].float()
        if form == "tensor":
            s = w.abs().max() / fp8.FP8_MAX
            q = (w / s).to(fp8.FP8)
            tensors[name + "_scale"] = s.reshape(())
        elif form == "channel":
            q, s = fp8.quantize_rows(w)
            tensors[name + "_scale"] = s[:, None]
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor(1.0)  # unused
        else:
            q, s = fp8.quantize_blocks(w, (32, 32))
            tensors[name + "_scale_inv"] = s
        tensors[name] = codes[name] = q
    layer0 = "model.layers.0.self_attn."
    tensors[layer0 + "k_scale"], tensors[layer0 + "v_scale"] = torch.tensor(0.5), torch.tensor(2.0)
    save_file(tensors, path)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = CONFIGS[form]
    (dst / "config.json").write_text(json.dumps(config))
    return codes


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """All positions' logits of one prefill of ``ids`` (a fresh request each call)."""
    req = Req(f"r{len(ids)}", list(ids), SamplingParams())
    req.req_pool_idx = runner.req_to_token.alloc()
    slots = runner.allocator.alloc(len(ids))
    runner.req_to_token.write(req.req_pool_idx, 0, slots)
    fb, _ = runner.build_batch(StepPlan([req], [len(ids)], 0))
    fb.logits_indices = torch.arange(len(ids))
    runner.attention.prepare(fb)
    out = runner.model.forward(fb).float().cpu()
    runner.allocator.free(slots)
    runner.req_to_token.free(req.req_pool_idx)
    return out


@pytest.mark.parametrize("form", ["tensor", "channel", "block"])
def test_fp8_checkpoint_loads_and_keeps_its_codes(
    form: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    codes = write_fp8_checkpoint(tiny_llama_dir, tmp_path / form, form)
    scheme = fp8_loading.checkpoint_scheme(
        json.loads((tmp_path / form / "config.json").read_text())
    )
    assert scheme is not None and scheme.kind == form
    # the CPU platform: a CUDA one would serve the checkpoint as FP8 (its own test below)
    settings = on_cpu({"max_total_tokens": 256, "dtype": "bfloat16"})
    runner = ModelRunner(tmp_path / form, EngineConfig(**settings), default_host())
    model = runner.model
    # loaded dequantized: the bf16 model holds q * s (bf16 weights: the CPU packs no linears)
    originals = model.fp8_originals
    assert originals.kv_scales == {0: [0.5, 2.0]}
    assert runner.kv_pool.k_scales[0] == 0.5 and runner.kv_pool.v_scales == [2.0, 1.0]
    (_, q0, s0) = min(originals.pieces["layers.0.qkv_proj.weight"], key=lambda p: p[0])
    block = (32, 32) if form == "block" else (128, 128)
    q_rows = q0.shape[0]
    torch.testing.assert_close(
        model.layers[0].qkv_proj.weight[:q_rows],
        fp8.dequantize(q0, s0, block).bfloat16(),
        rtol=0,
        atol=0,
    )
    ids = list(range(3, 40))
    before = _logits(runner, ids)

    assert fp8_loading.quantize_model(model) == 2 * 4  # qkv, o, gate_up, down in each layer
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv, fp8.Fp8Linear)
    assert qkv.kind == ("block" if form == "block" else "channel")
    want = torch.cat([codes[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.qweight.view(torch.uint8), want.view(torch.uint8))
    down = model.layers[1].down_proj
    assert torch.equal(
        down.qweight.view(torch.uint8),
        codes["model.layers.1.mlp.down_proj.weight"].view(torch.uint8),
    )
    after = _logits(runner, ids)
    # The only new rounding is the activations' (FP8 per token, or per token and 32 inputs):
    # about 3% a product, compounded over 8 products of a random model whose layers amplify
    # (std 0.2 weights): measured 14-15% of the logits' norm and 68-86% of the argmaxes. A
    # layer with misplaced codes or scales moves the logits by their whole size.
    assert _rel(after, before) < 0.25
    agree = (after.argmax(-1) == before.argmax(-1)).float().mean()
    assert agree >= 0.6


def test_a_bf16_checkpoint_is_quantized_per_row_on_load(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(
        tiny_llama_dir, EngineConfig(max_total_tokens=256, dtype="bfloat16"), default_host()
    )
    w = runner.model.layers[0].gate_up_proj.weight.detach().clone()
    assert fp8_loading.quantize_model(runner.model) == 8
    layer = runner.model.layers[0].gate_up_proj
    assert layer.kind == "channel" and layer.scale.shape == (w.shape[0],)
    assert _rel(layer.dequantized(), w) < 0.04


def test_the_cpu_refuses_fp8_in_one_line(tiny_llama_dir: Path) -> None:
    config = EngineConfig(quantization="fp8")
    with pytest.raises(ConfigError) as e:
        CpuPlatform().resolve_config(config, str(tiny_llama_dir))
    message = str(e.value)
    assert "\n" not in message
    assert "--quantization fp8 is not supported on the cpu platform" in message
    assert "int8wo, int4wo, w8a8_int8 or gguf" in message


def test_checkpoint_schemes() -> None:
    assert fp8_loading.checkpoint_scheme({}) is None
    assert fp8_loading.checkpoint_scheme({"quantization_config": {"quant_method": "awq"}}) is None
    block = fp8_loading.checkpoint_scheme(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    assert block == fp8_loading.Fp8Scheme("block", (128, 128))
    ct = {"quantization_config": json.loads(json.dumps(CONFIGS["channel"]))}
    assert fp8_loading.checkpoint_scheme(ct) == fp8_loading.Fp8Scheme(
        "channel", ignore=("lm_head",)
    )
    ct["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(ConfigError, match="float-quantized 8-bit"):
        fp8_loading.checkpoint_scheme(ct)


@pytest.mark.parametrize("group", [None, 128])
def test_the_activation_kernel_rounds_as_torch_does(group: int | None) -> None:
    """One launch per product (Triton) for the per-token or per-group activation scales: the
    same codes and scales as the torch ops, ragged widths and zero rows included."""
    torch.manual_seed(3)
    rows = torch.tensor([1.0, 1e-3, 30.0, 0.0, 1.0], device=DEVICE)
    x = torch.randn(5, 300, device=DEVICE) * rows[:, None]
    x[4, :7] = 1e-4  # subnormal codes
    q, s = fp8.quantize_activations(x, group)
    want_q, want_s = fp8.quantize_rows(x) if group is None else fp8.quantize_groups(x, group)
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_the_cuda_platform_serves_an_fp8_checkpoint_as_fp8(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Its config choice alone (no device needed): an FP8 checkpoint with no --quantization
    runs as ``fp8``; a bf16 one is left alone; the CPU's methods stay refused on CUDA."""
    from radixserve.plugins.hardware.cuda import CudaPlatform

    platform = CudaPlatform.__new__(CudaPlatform)  # no device: __init__ would bind one
    write_fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", "block")
    chosen = platform.resolve_config(EngineConfig(), str(tmp_path / "fp8"))
    assert chosen.quantization == ("fp8" if torch.version.hip is None else None)
    assert platform.resolve_config(EngineConfig(), str(tiny_llama_dir)).quantization is None
    with pytest.raises(ConfigError, match="--quantization int8wo is not supported on the cuda"):
        platform.quantize_model(None, "int8wo")  # type: ignore[arg-type]


def test_one_row_steps_take_the_fp8_gemv() -> None:
    """Batch-1 decode: the FP8 codes times the unrounded activations, scaled per row."""
    torch.manual_seed(4)
    w = torch.randn(64, 512, device=DEVICE) * 0.05
    q, s = fp8.quantize_rows(w)
    layer = fp8.Fp8Linear(q, s)
    assert layer.gemv_tiles == (4, 512, 4)
    x = torch.randn(1, 512, device=DEVICE)
    weight_only = x @ fp8.dequantize(q, s).t()
    torch.testing.assert_close(layer(x), weight_only, rtol=1e-4, atol=1e-4)
    # two rows: activations rounded too (the GEMM's numerics)
    two = layer(torch.cat([x, x]))
    assert _rel(two[:1], weight_only) > 1e-3
    assert fp8.Fp8Linear(q[:, :500].contiguous(), s).gemv_tiles is None  # no strip divides K
