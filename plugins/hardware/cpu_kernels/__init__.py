"""radixserve's C++ CPU kernels: the paged decode attention of the ``cpu_paged`` attention plugin
(``decode_attention.cpp``), the model's fused per-token ops (``fused_ops.cpp``, used through
``plugins/hardware/cpu_fused_ops.py``) and the 4-bit block linear of ``--quantization gguf``
(``q4_linear.cpp``, used by ``plugins/models/quant.py``), one library of
``torch.ops.radixserve_cpu`` ops.

torch's ``cpp_extension`` compiles it once per machine (~30 s on two cores) into
``~/.cache/radixserve/kernels`` (``RADIXSERVE_KERNEL_CACHE`` elsewhere), under a key of the
sources, torch's version, the flags and the CPU, since ``-march=native`` code is this CPU's; later
processes only load the library. ``python -m radixserve.plugins.hardware.cpu_kernels`` builds it
ahead of time (``make serve`` and ``make test`` do). ``checked()`` has the same ops behind checks
of their operands written in Python (``checks.py`` says why).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(n)
    for n in ("decode_attention.cpp", "fused_ops.cpp", "q4_linear.cpp", "f32_linear.cpp")
]
HEADERS = [Path(__file__).with_name("vec_math.h")]  # included by the sources; part of the key
NAME = "radixserve_cpu_kernels"
# -fopenmp: at::parallel_for spreads work over torch's OpenMP pool (the library links the
# libgomp torch has loaded); -march=native: the host's vector width.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def unavailable_reason() -> str | None:
    """None when the library can be built here (or is built), else why not, in one line."""
    if not _library_path().exists():
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            return f"no C++ compiler ({compiler}) on PATH to build radixserve's CPU kernels"
        if shutil.which("ninja") is None:
            return "torch's cpp_extension needs ninja on PATH (apt install ninja-build)"
    return None


@cache
def load() -> Any:
    """``torch.ops.radixserve_cpu``, the library built first if needed."""
    library = _library_path()
    start = time.perf_counter()
    try:  # built before: load it directly (cpp_extension.load would run ninja to check)
        torch.ops.load_library(str(library))
        logger.debug("loaded %s in %.2f s", library, time.perf_counter() - start)
    except OSError:  # not built, or another process is still writing it
        logger.info("building radixserve's CPU kernels in %s (once per machine)",
                    library.parent)  # fmt: skip
        from torch.utils import cpp_extension

        library.parent.mkdir(parents=True, exist_ok=True)
        # cpp_extension's lock file makes concurrent builders wait for the first one
        cpp_extension.load(
            name=NAME,
            sources=[str(src) for src in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(library.parent),
            is_python_module=False,
            verbose=logger.isEnabledFor(logging.DEBUG),
        )
        logger.debug("built the kernels in %.1f s", time.perf_counter() - start)
    return torch.ops.radixserve_cpu


def checked() -> Any:
    """The same ops as ``load()``, each behind checks of its operands written in Python
    (``checks.py``): bad input raises ``KernelInputError`` (a RuntimeError) before any C++ runs,
    on every build of torch. For callers whose operands are not built to fit."""
    from radixserve.plugins.hardware.cpu_kernels.checks import checked_ops

    load()  # the library built and its ops registered, before the checks call them
    return checked_ops()


def _library_path() -> Path:
    return _build_dir() / f"{NAME}.so"


@cache
def _build_dir() -> Path:
    root = os.environ.get("RADIXSERVE_KERNEL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "radixserve" / "kernels"
    key = hashlib.sha256()
    parts = [src.read_bytes() for src in SOURCES + HEADERS]
    parts += [torch.__version__.encode(), " ".join(CFLAGS).encode()]
    for part in parts:
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
    """``python -m radixserve.plugins.hardware.cpu_kernels``: build (or find) the library now."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"CPU kernels not built: {reason}; the CPU runs torch's ops instead")
    load()
    print(f"CPU kernels ready: {_library_path()}")
