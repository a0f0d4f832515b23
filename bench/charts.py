"""Draw the charts of the benchmarks page from the recorded figures.

Reads ``docs/assets/benchmarks/figures.json`` (the current figures, copied from recorded runs)
and writes one SVG per chart to ``docs/assets/benchmarks/NAME.svg``. Needs matplotlib
(``pip install matplotlib``).

    python bench/charts.py
    python bench/charts.py --figures other.json --out-dir /tmp/charts
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def draw(chart: dict[str, Any], out: Path) -> None:
    """One horizontal bar chart, its values printed beside the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "radixserve"  # stable element ids: re-running changes nothing
    plt.rcParams["svg.fonttype"] = "none"  # text stays text (smaller files, searchable)
    labels = [label for label, _ in chart["bars"]]
    values = [value for _, value in chart["bars"]]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(labels) + 1.4))
    bars = ax.barh(range(len(labels)), values, color="#3f6fb5")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(chart["xlabel"])
    ax.set_title(f"{chart['title']}\n{chart['machine']}, {chart['date']}", fontsize=10)
    ax.bar_label(bars, labels=[f"{v:,.2f}" if v < 10 else f"{v:,.0f}" for v in values], padding=3)
    ax.set_xlim(0, max(values) * 1.18)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    assets = ROOT / "docs" / "assets" / "benchmarks"
    parser.add_argument("--figures", type=Path, default=assets / "figures.json")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "assets" / "benchmarks")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for chart in json.loads(args.figures.read_text())["charts"]:
        out = args.out_dir / f"{chart['name']}.svg"
        draw(chart, out)
        print(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out)


if __name__ == "__main__":
    main()
