"""Random PEFT LoRA adapters for tests and their transformers + peft greedy reference."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.core.lora import LoRAAdapter

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: Path, out: Path, rank: int, seed: int, alpha: float | None = None,
    modules: list[str] | None = None, rslora: bool = False, scale: float = 0.5,
) -> Path:  # fmt: skip
    """A LoRA adapter of ``rank`` with random A and B (``scale`` times peft's random init, so
    the outputs change but stay text), saved by peft to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=modules or ALL_MODULES, init_lora_weights=False, use_rslora=rslora,
    )  # fmt: skip
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    model.save_pretrained(out)
    return out


def peft_greedy(
    model_dir: Path, adapters: dict[str, Path], runs: list[tuple[list[int], str | None]], n: int
) -> list[list[int]]:
    """transformers + peft greedy continuations (``n`` tokens) of each (prompt ids, adapter
    name or None for the base model), float32 on the CPU."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    outs = []
    for ids, name in runs:
        x = torch.tensor([ids])
        kw = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    y = model.generate(x, **kw)
            else:
                model.set_adapter(name)
                y = model.generate(x, **kw)
        outs.append(y[0, len(ids) :].tolist())
    return outs


class RecordedWeights:
    """AdapterWeights that records which adapter each slot was loaded with (no tensors)."""

    def __init__(self) -> None:
        self.loads: list[tuple[int, str]] = []

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.loads.append((slot, adapter.name))

    def set_step(self, token_slots: torch.Tensor) -> None:
        pass


def named_adapter(name: str, uid: int) -> LoRAAdapter:
    """A rank-4 adapter with no weights: enough for the slot pool and the registry."""
    return LoRAAdapter(name, "/p", 4, 1.0, {}, uid)
