#!/usr/bin/env python
"""``radixserve ...`` with cProfile in both of the server's processes: the HTTP process (this
one) and the engine process it spawns. Each writes its pstats file when it exits (the server
stops on SIGTERM), to ``$RADIXSERVE_BENCH_PROFILE_DIR/{http,engine}.pstats``.

    RADIXSERVE_BENCH_PROFILE_DIR=/tmp/prof python bench/serve_cprofile.py serve --model-path DIR

A benchmark's helper, not a server feature: cProfile slows Python-bound code, so rates measured
under it are not the server's (bench/gpu_serving.py profiles in a run of its own).
"""

from __future__ import annotations

import cProfile
import os
import sys
from pathlib import Path
from typing import Any

PROFILE_DIR_ENV = "RADIXSERVE_BENCH_PROFILE_DIR"


def _profiled(name: str, fn: Any, *args: Any) -> Any:
    prof = cProfile.Profile()
    prof.enable()
    try:
        return fn(*args)
    finally:
        prof.disable()
        out = Path(os.environ[PROFILE_DIR_ENV])
        out.mkdir(parents=True, exist_ok=True)
        prof.dump_stats(out / f"{name}.pstats")


def run_engine_profiled(*args: Any) -> None:
    """The engine process's entry point under cProfile (multiprocessing spawn imports this
    module by name in the child: the parent's sys.path travels with it)."""
    from radixserve.entrypoints import engine_process

    _profiled("engine", engine_process.run_engine, *args)


def main(argv: list[str]) -> int:
    import serve_cprofile  # this file by its module name, so the child can import it

    from radixserve.entrypoints import cli, engine_client

    # EngineClient.start_process starts the engine process at the entry it names
    engine_client.ENGINE_ENTRY = f"{serve_cprofile.__name__}:run_engine_profiled"
    return int(_profiled("http", cli.main, argv) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
