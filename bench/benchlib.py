"""What the benchmark scripts share: a figure of ours against torch's, and the
results table and plot they write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Figure", "cost_script_runs", "write_results"]


@dataclass(frozen=True)
class Figure:
    """One row of the table: ours and torch's medians and the goal on their ratio."""

    name: str
    unit: str
    ours: float
    torch: float
    goal: str  # e.g. ">= 1.0x" (speed-up of ours) or "<= 1%"
    ratio: float  # what the goal is checked against
    met: bool
    reference: str = "torch"  # what the torch column holds when it is not torch's figure


def write_results(figures: list[Figure], rounds: int, out: Path, load: list[str] | None = None) -> str:
    """Write ``out``/results.md and results.png; return the table. ``load``: the machine's
    load averages at the start and the end."""
    lines = [
        f"Ours vs torch {torch.__version__}: 2 processes on 127.0.0.1 unless the figure says otherwise, "
        f"gloo, CPU; medians of {rounds} alternating rounds."
        + (f" {os.cpu_count()} cores; {' -> '.join(load)}." if load else ""),
        "",
        "| figure | unit | ours | torch (or reference) | goal | ratio | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        if f.ratio != f.ratio:  # NaN: the reference could not run
            ratio = "-"
        elif f.goal.endswith("x") or f.goal in ("<= torch", "(context)", "(floor)"):
            ratio = f"{f.ratio:.2f}x"
        else:
            ratio = f"{f.ratio:+.1f}"
        lines.append(
            f"| {f.name} | {f.unit} | {f.ours:.3g} | {_reference(f)} | {f.goal} | {ratio} | {'yes' if f.met else 'NO'} |"
        )
    table = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table)
    _plot(figures, out / "results.png")
    return table


def _reference(f: Figure) -> str:
    if f.torch != f.torch:  # NaN: torch could not run it
        return f"- ({f.reference})"
    return f"{f.torch:.3g}" if f.reference == "torch" else f"{f.torch:.3g} ({f.reference})"


def _plot(figures: list[Figure], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [f for f in figures if f.unit in ("ms/step", "ms", "us", "s", "GB/s", "calls/s")]
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.6 * len(timed)))
    labels = [f"{f.name} ({f.unit})" for f in timed]
    y = range(len(timed))
    ax.barh([i + 0.2 for i in y], [f.torch for f in timed], height=0.4, label="torch", color="#bbbbbb")
    ax.barh([i - 0.2 for i in y], [f.ours for f in timed], height=0.4, label="ours", color="#2a7ab9")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.legend(loc="lower right")
    ax.set_title("ours vs torch (lower is better except GB/s and calls/s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cost_script_runs(script: str, what: str, processes: int = 3) -> list[dict[str, float]]:
    """Run ``script`` (Python that prints one JSON object on its last line) in ``processes``
    fresh interpreters, one after another; their objects. ``what`` names the measure in the
    error raised when a run fails."""
    found = []
    for _ in range(processes):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{what} could not be measured:\n{done.stderr}")
        found.append(json.loads(done.stdout.splitlines()[-1]))
    return found
