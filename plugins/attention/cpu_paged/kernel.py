"""Builds and loads the C++ paged decode-attention kernel (``decode_attention.cpp``).

torch's ``cpp_extension`` compiles it once per machine (~20 s on two cores) into
``~/.cache/radixserve/kernels`` (``RADIXSERVE_KERNEL_CACHE`` elsewhere), under a key of the
source, torch's version, the flags and the CPU, since ``-march=native`` code is this CPU's; later
processes only load the library. ``python -m radixserve.plugins.attention.cpu_paged`` builds it
ahead of time (``make serve`` and ``make test`` do).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
NAME = "radixserve_cpu_paged"
# -fopenmp: at::parallel_for spreads work over torch's OpenMP pool (the library links the
# libgomp torch has loaded); -march=native: the host's vector width for the dot products.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def unavailable_reason() -> str | None:
    """None when the kernel can be built here (or is built), else why not, in one line."""
    if not _library_path().exists():
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            return f"no C++ compiler ({compiler}) on PATH to build its kernel"
        if shutil.which("ninja") is None:
            return "torch's cpp_extension needs ninja on PATH (apt install ninja-build)"
    return None


@cache
def decode_attention() -> Callable[..., torch.Tensor]:
    """``decode_attention(q, k_buf, v_buf, slots, starts, lens, scale)``, built if needed."""
    library = _library_path()
    start = time.perf_counter()
    try:  # built before: load it directly (cpp_extension.load would run ninja to check)
        torch.ops.load_library(str(library))
        logger.debug("loaded %s in %.2f s", library, time.perf_counter() - start)
    except OSError:  # not built, or another process is still writing it
        logger.info("building the CPU decode-attention kernel in %s (once per machine)",
                    library.parent)  # fmt: skip
        from torch.utils import cpp_extension

        library.parent.mkdir(parents=True, exist_ok=True)
        # cpp_extension's lock file makes concurrent builders wait for the first one
        cpp_extension.load(
            name=NAME,
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(library.parent),
            is_python_module=False,
            verbose=logger.isEnabledFor(logging.DEBUG),
        )
        logger.debug("built the kernel in %.1f s", time.perf_counter() - start)
    return torch.ops.radixserve_cpu_paged.decode_attention


def _library_path() -> Path:
    return _build_dir() / f"{NAME}.so"


@cache
def _build_dir() -> Path:
    root = os.environ.get("RADIXSERVE_KERNEL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "radixserve" / "kernels"
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(CFLAGS).encode()):
        key.update(part)
    key.update(_cpu_signature().encode())
    return base / f"{NAME}-{key.hexdigest()[:16]}"


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what -march=native compiled for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted}))


def build_main() -> None:
    """``python -m radixserve.plugins.attention.cpu_paged``: build (or find) the kernel now."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cpu_paged kernel not built: {reason}; the CPU uses torch_native")
    decode_attention()
    print(f"cpu_paged kernel ready: {_library_path()}")
