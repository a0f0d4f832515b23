"""Run SGLang's benchmark client, unchanged, once per command line, in one interpreter.

``python sglang_bench.py '[["--backend", "sglang", ...], [...]]'`` calls SGLang's own CLI entry
point (``sglang.benchmark.serving.cli_main``, what ``python -m sglang.bench_serving`` runs) with
each argument list in turn. One interpreter for all runs because importing the client costs
5-20 s on the CI machine's 2 cores: it imports much of ``sglang.srt`` and transformers.

The one thing added to SGLang's environment: its import chain reaches ``torchvision``
(sglang/srt/multimodal/internvl_utils.py), whose only x86-64 wheel on PyPI is the CUDA build.
``make setup`` installs that wheel in ``.venv/sglang-bench``, outside the venv's site-packages
(an importable torchvision that cannot load its kernels would break transformers for every
other test); this script puts that folder at the end of ``sys.path``. Against the CPU torch
the wheel's compiled ops do not load, and its import then registers fake kernels for two of
them (``torchvision::nms``, ``qnms``), which fails for operators that do not exist; declaring
the two first lets the real package import. The benchmark never calls them.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

BENCH_PATH = Path(sys.prefix) / "sglang-bench"


def declare_torchvision_ops() -> None:
    # The signatures of torchvision.ops' Python callers (boxes.py); a fake kernel only needs
    # the operator to exist.
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    # Keep the library alive for the process: dropping it would drop the definitions.
    declare_torchvision_ops.library = lib  # type: ignore[attr-defined]


def main(runs: list[list[str]]) -> int:
    sys.path.append(str(BENCH_PATH))
    declare_torchvision_ops()
    from sglang.benchmark.serving import cli_main

    failed = 0
    for argv in runs:
        sys.argv = ["sglang.bench_serving", *argv]
        try:
            cli_main()
        except (Exception, SystemExit) as e:
            if isinstance(e, SystemExit) and e.code in (0, None):
                continue
            # Go on with the other runs; the test reports the one without a result, and this.
            traceback.print_exc()
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
