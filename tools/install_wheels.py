#!/usr/bin/env python3
"""Install the carried wheels (``.whl/``) that this interpreter lacks, into a folder that then
goes first on PYTHONPATH; used on the lent GPU machine, whose image has torch, triton and
transformers but not our serving stack:

    python3 tools/install_wheels.py .whl /tmp/site && export PYTHONPATH=/tmp/site

A wheel is installed only where no distribution of its name is installed, or where the installed
one is too old for a requirement of a wheel being installed (then it is named, with the
requirement). The image's own torch stack (``PROTECTED``) is never replaced: an unmet
requirement on it is reported, not installed over. Every decision is printed. Standard library
only, plus ``packaging`` for version checks (the image has it; without it only missing
distributions are installed). radixserve's own runtime requirements (pyproject.toml) count as
a wheel's: one the machine meets with too old a version is installed from a carried wheel.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # no version checks: install what is missing
    Requirement = None  # type: ignore[assignment,misc]

PROTECTED = {"torch", "triton", "transformers", "numpy", "tokenizers", "safetensors",
             "huggingface-hub", "pip", "setuptools"}  # fmt: skip
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Wheel:
    path: Path
    name: str
    version: str
    requires: list[str] = field(default_factory=list)


def read_wheel(path: Path) -> Wheel:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith("/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return Wheel(path, canon(msg["Name"]), msg["Version"], msg.get_all("Requires-Dist") or [])


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def needs(requires: list[str]) -> list[tuple[str, object]]:
    """(name, requirement) for each requirement that applies here (markers true, no extras)."""
    if Requirement is None:
        return []
    out = []
    for text in requires:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append((canon(req.name), req))
    return out


def satisfied(req: object, version: str) -> bool:
    return req.specifier.contains(version, prereleases=True)  # type: ignore[attr-defined]


def project_requires() -> list[str]:
    """radixserve's runtime requirements (pyproject.toml)."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11: nothing to check with
        return []
    return list(tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"])


def choose(
    wheels: dict[str, Wheel], project: list[str], replace: tuple[str, ...] = ()
) -> tuple[dict[str, str], list[str]]:
    """{name: why} of the wheels to install, and warnings about requirements left unmet: the
    missing ones, then any carried one that radixserve or an installed wheel needs newer. A
    replaced wheel brings its carried requirements with it, protected or not (transformers
    5.25 needs a newer huggingface-hub and tokenizers than an image built for 5.17)."""
    chosen = {n: "not installed" for n in wheels if installed(n) is None}
    for name in replace:
        if name in wheels:
            chosen[name] = f"replaces the machine's {installed(name)} (--replace)"
    brings = set(n for n in replace if n in wheels)
    warnings: list[str] = []
    pending = [("radixserve", project)] + [(n, wheels[n].requires) for n in chosen]
    while pending:
        who, requires = pending.pop()
        for dep, req in needs(requires):
            have = wheels[dep].version if dep in chosen else installed(dep)
            if have is not None and satisfied(req, have):
                continue
            free = dep not in PROTECTED or (who in brings and dep not in {"torch", "triton"})
            if dep in wheels and dep not in chosen and free:
                chosen[dep] = f"installed {have} is too old: {who} needs {req}"
                pending.append((dep, wheels[dep].requires))
                if who in brings:
                    brings.add(dep)
            else:
                warnings.append(f"{who} needs {req}; found {have or 'nothing'}")
    return chosen, list(dict.fromkeys(warnings))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel_dir", type=Path)
    p.add_argument("target", type=Path)
    p.add_argument("--dry-run", action="store_true", help="print the decisions only")
    p.add_argument("--replace", action="append", default=[], metavar="NAME",
                   help="install this carried wheel over the machine's own, protected or not "
                        "(e.g. the transformers version the tests pin)")  # fmt: skip
    args = p.parse_args(argv)
    wheels = {w.name: w for w in map(read_wheel, sorted(args.wheel_dir.glob("*.whl")))}
    chosen, warnings = choose(wheels, project_requires(), tuple(map(canon, args.replace)))
    for name, wheel in sorted(wheels.items()):
        why = chosen.get(name)
        have = installed(name)
        print(f"install {name} {wheel.version} ({why})" if why else
              f"keep {name} {have} (carried {wheel.version} not installed)")  # fmt: skip
    if Requirement is None:
        warnings.append("no `packaging`: versions unchecked, only missing wheels installed")
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    args.target.mkdir(parents=True, exist_ok=True)
    if args.dry_run or not chosen:
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(args.target)]  # fmt: skip
    return subprocess.call(cmd + [str(wheels[n].path) for n in sorted(chosen)])


if __name__ == "__main__":
    sys.exit(main())
