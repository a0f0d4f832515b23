"""Tiny random-weight Qwen2-VL / Qwen2.5-VL models in HF layout (config, safetensors,
tokenizer, image processor), saved with transformers, for the vision-language tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tiny_models import CORPUS, SPECIAL_TOKENS, randomize_weights

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=SPECIAL_TOKENS + VISION_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return {t: tok.token_to_id(t) for t in VISION_TOKENS} | {"vocab": tok.get_vocab_size()}


#: Qwen2.5-VL's tower at tiny sizes: 16-pixel windows (2x2 merged blocks, so a 32x32 image
#: has four and a 32x40 one six, two of them cut by the edge), block 1 of 0..2 attends over the
#: whole image, blocks 0 and 2 within windows
QWEN2_5_VL_VISION = dict(
    depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
    patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
    window_size=16, fullatt_block_indexes=[1], hidden_act="silu",
)  # fmt: skip


def save_randomized(model: Any, out: Path) -> None:
    """Randomized weights (tiny_models.randomize_weights), saved as safetensors."""
    randomize_weights(model)
    model.save_pretrained(out, safe_serialization=True)


def make_tiny_qwen2_vl_dir(out: Path, seed: int = 0, family: str = "qwen2_vl",
                           **text: Any) -> Path:  # fmt: skip
    """Write a Qwen2VLForConditionalGeneration (``family="qwen2_5_vl"``: a
    Qwen2_5_VLForConditionalGeneration, QWEN2_5_VL_VISION) of tiny sizes (patch 4, merge 2: a
    32x32 image is 16 image tokens), its tokenizer and its Qwen2-VL image processor (pixels
    16*16..64*64)."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(out / "tokenizer.json")
    text_config = dict(
        vocab_size=ids["vocab"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    text_config.update(text)
    vision_config: dict[str, Any] = dict(
        depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
    )  # fmt: skip
    name = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[family]
    if family == "qwen2_5_vl":
        vision_config = dict(QWEN2_5_VL_VISION)
    config = getattr(transformers, f"{name}Config")(
        text_config=text_config, vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).float()
    save_randomized(model, out)
    processor = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
    )  # fmt: skip
    processor.save_pretrained(out)
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"})
    )
    return out


def png(width: int, height: int, seed: int) -> bytes:
    """A random-noise PNG image."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8")).save(out, "PNG")
    return out.getvalue()


def load_reference(model_dir: Path) -> Any:
    """(transformers' model of the directory's architecture (Qwen2-VL or Qwen2.5-VL) in
    float32, its image processor)."""
    import torch
    import transformers
    from transformers import AutoImageProcessor

    arch = json.loads((model_dir / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), AutoImageProcessor.from_pretrained(model_dir)


def reference_logprobs(reference: Any, ids: list[int], images: list[bytes],
                       output: list[int]) -> Any:  # fmt: skip
    """transformers' log-softmax at each output position of ``ids`` (one image token per
    image, expanded here as its processor does) followed by ``output``."""
    import io

    import torch
    from PIL import Image

    model, processor = reference
    image_token = model.config.image_token_id
    kwargs: dict[str, Any] = {}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        out = processor(images=pil, return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [x for t in ids for x in ([t] * next(counts) if t == image_token else [t])]
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    full = torch.tensor([ids + output])
    kwargs["mm_token_type_ids"] = (full == image_token).int()
    with torch.no_grad():
        logits = model(input_ids=full, **kwargs).logits[0]
    n = len(ids)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(output)], dim=-1)


def make_tiny_llava_dir(out: Path, seed: int = 0) -> Path:
    """A LlavaForConditionalGeneration of tiny sizes (CLIP 32x32 images in 8x8 patches: 16
    image tokens; a Llama decoder), its tokenizer with ``<image>`` and CLIP's image processor
    (resize and crop to 32x32)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=[*SPECIAL_TOKENS, "<image>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=2, image_size=32, patch_size=8,
                              projection_dim=32, layer_norm_eps=1e-5)  # fmt: skip
    text = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, rms_norm_eps=1e-5, eos_token_id=0,
                       bos_token_id=None)  # fmt: skip
    image_token = tok.token_to_id("<image>")
    config = LlavaConfig(vision_config=vision, text_config=text, image_seq_length=16,
                         image_token_id=image_token, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).float()
    save_randomized(model, out)
    CLIPImageProcessorPil(size={"shortest_edge": 32},
                          crop_size={"height": 32, "width": 32}).save_pretrained(out)  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


def llava_reference_logprobs(model_dir: Path, ids: list[int], images: list[bytes],
                             output: list[int]) -> Any:  # fmt: skip
    """transformers' LLaVA log-softmax at each output position (``<image>`` expanded to its
    patch count as LlavaProcessor does)."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    token, count = model.config.image_token_id, model.config.image_seq_length
    kwargs: dict[str, Any] = {}
    if images:
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        processor = AutoImageProcessor.from_pretrained(model_dir)
        kwargs["pixel_values"] = processor(images=pil, return_tensors="pt")["pixel_values"]
    ids = [x for t in ids for x in ([t] * count if t == token else [t])]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + output]), **kwargs).logits[0]
    n = len(ids)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(output)], dim=-1)


IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]

#: SmolVLM's template for string contents (the chat routes put ``<image>`` in the text)
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def make_tiny_idefics3_dir(out: Path, seed: int = 0, architecture: str = "Idefics3") -> Path:
    """An Idefics3ForConditionalGeneration (or ``architecture="SmolVLM"``) of tiny sizes: SigLIP
    tiles of 32x32 in 4x4 patches, pixel shuffle 2 (16 tokens per tile), a Llama decoder; its
    tokenizer with Idefics3's image tokens and its image processor (longest edge resized to 64,
    split into 32x32 tiles: a square image is 2x2 tiles + the global image, a wide one 1x2 + 1)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForImageTextToText, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL_TOKENS + IDEFICS3_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    model_type = architecture.lower()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=4)  # fmt: skip
    text = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, rms_norm_eps=1e-5, eos_token_id=0,
                       bos_token_id=None)  # fmt: skip
    config = AutoConfig.for_model(model_type, vision_config=vision, text_config=text.to_dict(),
                                  scale_factor=2, image_token_id=tok.token_to_id("<image>"),
                                  tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).float()
    assert type(model).__name__ == f"{architecture}ForConditionalGeneration"
    save_randomized(model, out)
    Idefics3ImageProcessorPil(size={"longest_edge": 64},
                              max_image_size={"longest_edge": 32}).save_pretrained(out)  # fmt: skip
    (out / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": IDEFICS3_CHAT_TEMPLATE, "eos_token": "<|endoftext|>"})
    )
    return out


def idefics3_reference_logprobs(model_dir: Path, prompt: str, images: list[bytes],
                                output: list[int]) -> Any:  # fmt: skip
    """transformers' Idefics3 log-softmax at each output position: the prompt's ``<image>``
    expanded, tiled and tokenized by transformers' Idefics3Processor."""
    import io

    import torch
    from PIL import Image
    from transformers import (
        AutoImageProcessor,
        AutoModelForImageTextToText,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    processor = Idefics3Processor(AutoImageProcessor.from_pretrained(model_dir), tokenizer,
                                  image_seq_len=16)  # fmt: skip
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=prompt, images=pil or None, return_tensors="pt")
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    full = torch.cat((ids, torch.tensor([output])), dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, **inputs).logits[0]
    n = ids.shape[1]
    return torch.log_softmax(logits[n - 1 : n - 1 + len(output)], dim=-1)
