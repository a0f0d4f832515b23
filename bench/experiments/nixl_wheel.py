#!/usr/bin/env python3
"""Make ``.whl-pd/``: the NIXL wheel that bench/pd_gpu.py carries to the GPU machine, small
enough to travel next to ``.whl`` (a device call carries 64 MiB in all).

PyPI's ``nixl-cu13`` wheel for CPython 3.12 (the GPU image has CUDA 13 and Python 3.12) is
56 MiB, over half of it ``nixl_ep_cu13/``: torch extensions for expert-parallel all-to-all
that the KV connector never imports. This downloads the wheel and writes it again without that
folder (its RECORD lines dropped too), 29 MiB:

    python3 bench/nixl_wheel.py .whl-pd      # then name .whl-pd in the device call's carry
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "nixl-cu13==1.5.1"
DROP = "nixl_ep_cu13/"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(into)]  # fmt: skip
    cmd.append(PACKAGE)
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd, check=True)
    return next(into.glob("nixl_cu13-*.whl"))


def strip(src: Path, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(DROP):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(DROP)).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dest", type=Path, help="folder to write the wheel to (e.g. .whl-pd)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = strip(download(Path(tmp)), args.dest)
    print(f"{wheel} ({wheel.stat().st_size / (1 << 20):.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
