"""The CPU's fast mode, the default for a GGUF model: the file's own block formats and a 16-bit
KV cache.

A GGUF file is converted to an HF directory of float32 weights (``plugins/models/resolve.py``);
served as such, every product reads 4 bytes a weight where the file had 0.6 (Q4_1), and the
result equals transformers' float32 one. That exact path stays one flag away (``--dtype
float32``, or any ``--dtype``/``--quantization``): the fast mode applies only where the user
chose neither. It sets what the user left unset:

- ``--quantization gguf`` when the file's layer weights are Q4_1 (the blocks radixserve's CPU
  kernels multiply, as llama.cpp does); weights of another format stay float32 (logged).
- ``--kv-cache-dtype float16`` where the KV dtype is ``auto``: half the bytes decode attention
  reads.
- decode steps stay eager unless ``--enable-torch-compile`` is given (compiled, they measured
  ~2% faster for a minute's compile); then inductor's artifacts go to
  ``~/.cache/radixserve/inductor`` (``TORCHINDUCTOR_CACHE_DIR`` elsewhere), so the compile is
  paid once per machine.

docs/cpu_modes.md says what the fast mode gives up (agreement and perplexity, measured).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

from radixserve.core.config import EngineConfig

logger = logging.getLogger(__name__)

#: "exact" turns the fast mode off for every engine of the process tree (the test suite sets it:
#: its assertions compare with transformers in float32); "fast" (the default) leaves it on
MODE_ENV = "RADIXSERVE_CPU_MODE"

#: the GGUF block formats ``--quantization`` multiplies in place, by GGUF type name
KERNEL_FORMATS = {"Q4_1": "gguf"}


def gguf_source(model_dir: str) -> Path | None:
    """The .gguf file ``model_dir`` was converted from (its completion marker names it), or
    None for any other directory (or a source that is gone)."""
    from radixserve.plugins.models.gguf_loader import COMPLETE_MARKER

    marker = Path(model_dir) / COMPLETE_MARKER
    try:
        source = json.loads(marker.read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    path = Path(source) if isinstance(source, str) else None
    return path if path is not None and path.is_file() else None


def layer_format(gguf_path: Path) -> str:
    """The GGUF type of most of the file's layer weights (blk.*.weight of 2 dimensions), e.g.
    "Q4_1"; the file's header and tensor table only are read (memory-mapped)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    kinds = Counter(
        t.tensor_type.name
        for t in reader.tensors
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2
    )
    return kinds.most_common(1)[0][0] if kinds else "F32"


def inductor_cache_dir() -> Path:
    """Where compiled decode steps persist: TORCHINDUCTOR_CACHE_DIR when set, else
    ``inductor`` under RADIXSERVE_CACHE_DIR (default ``~/.cache/radixserve``)."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given:
        return Path(given)
    root = os.environ.get("RADIXSERVE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "radixserve"
    return base.expanduser() / "inductor"


def fast_mode(config: EngineConfig, model_dir: str) -> EngineConfig:
    """``config`` in the fast mode where it applies (a GGUF model, no --dtype or
    --quantization, one rank), else as given. Logs the mode either way for a GGUF model."""
    source = gguf_source(model_dir)
    if source is None:
        return config
    exact_env = os.environ.get(MODE_ENV, "fast") == "exact"
    chosen = config.dtype != "auto" or config.quantization is not None or config.tp_size != 1
    chosen = chosen or config.enable_deterministic_inference  # its GGUF kernels are not
    if exact_env or chosen:
        logger.info(
            "CPU exact mode: weights as converted from %s (float32 unless --dtype), as %s "
            "chose; give none of --dtype/--quantization for the fast mode",
            source.name,
            f"{MODE_ENV}=exact" if exact_env else "the flags",
        )
        return config
    fmt = layer_format(source)
    quantization = KERNEL_FORMATS.get(fmt)
    kv = "float16" if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
    # Compiled decode steps measured ~2% faster than eager here (SmolLM2 Q4_1, batch 1, 2-core
    # EPYC) for a minute's compile on a machine's first start and ~10 s on every later one: not
    # the default; --enable-torch-compile asks for them (their artifacts persist, below).
    compiled = config.enable_torch_compile
    weights = f"gguf {fmt} weights" if quantization else f"float32 weights ({fmt}: no kernel)"
    steps = "compiled decode" if compiled else "eager decode"
    logger.info(
        "CPU fast mode: %s, %s KV, %s; --dtype float32 for outputs equal to transformers'",
        weights, kv, steps,
    )  # fmt: skip
    if compiled:
        cache = inductor_cache_dir()
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))
        logger.info(
            "compiling decode steps into %s: about a minute on two cores the first time on "
            "this machine, seconds later",
            cache,
        )
    return replace(
        config, quantization=quantization, kv_cache_dtype=kv, enable_torch_compile=compiled
    )
