"""bench/results-peers.md and bench/results-peers.png: the peers' figures side by side."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from peers.runner import Outcome
from peers.workloads import ECHO_MIB, PS_MIB, PS_TRAINERS

__all__ = ["ROWS", "Row", "table", "write"]


@dataclass(frozen=True)
class Row:
    """One workload's figure: the key the workers report it under, and which way is better."""

    key: str
    name: str
    unit: str
    lower_is_better: bool


ROWS: Final = (
    Row("sync_p50_us", "rpc_sync no-op, 64-byte argument, p50", "us", True),
    Row("sync_p99_us", "rpc_sync no-op, 64-byte argument, p99", "us", True),
    Row("async_per_s", "rpc_async no-op throughput", "calls/s", False),
    *(Row(f"echo{mib}_gb_s", f"{mib} MiB tensor echo (both ways)", "GB/s", False) for mib in ECHO_MIB),
    Row("ps_per_s", f"parameter server: {PS_TRAINERS} trainers x {PS_MIB} MiB rpc_sync", "calls/s", False),
    Row("startup_s", "start-up to the first completed call", "s", True),
)


def _cell(outcome: Outcome, row: Row) -> str:
    if outcome.unavailable:
        return "cannot run here"
    value = outcome.median(row.key)
    return "failed" if value is None else f"{value:.3g}"


def _versus(ours: Outcome | None, others: list[Outcome], row: Row) -> str:
    """How ours compares with the best of the others: the factor by which it is better."""
    mine = ours.median(row.key) if ours else None
    theirs = [v for v in (o.median(row.key) for o in others) if v is not None]
    if mine is None or not theirs or mine <= 0:
        return "-"
    best = min(theirs) if row.lower_is_better else max(theirs)
    factor = best / mine if row.lower_is_better else mine / best
    return f"{factor:.2f}x"


def table(outcomes: list[Outcome], rounds: int, quick: bool, load: list[str]) -> str:
    """The results page: the table, then how each peer ran, with its version and failures."""
    ours = next((o for o in outcomes if o.spec.key == "ours"), None)
    others = [o for o in outcomes if o.spec.key != "ours"]
    headers = [f"{o.spec.title} {o.version}".strip() for o in outcomes]
    lines = [
        f"Ours against what users would pick instead: 2 processes on 127.0.0.1 (the parameter server: {PS_TRAINERS + 1}, plus the driver for "
        "Ray and Monarch), CPU, each peer in fresh processes and an environment of its own; "
        f"medians of {rounds} rounds{' (--quick: fewer calls)' if quick else ''}, the peers' order "
        f"rotating each round. {os.cpu_count()} cores; {' -> '.join(load)}.",
        "",
        f"| figure | unit | {' | '.join(headers)} | ours vs the best other |",
        "|---|---|" + "---|" * len(outcomes) + "---|",
    ]
    for row in ROWS:
        cells = " | ".join(_cell(o, row) for o in outcomes)
        lines.append(f"| {row.name} | {row.unit} | {cells} | {_versus(ours, others, row)} |")
    lines += [
        "",
        '"ours vs the best other": how many times better ours is than the best of the other '
        "columns (below 1x: worse). Start-up runs from starting the processes (interpreter, "
        "imports, `init_rpc`, `ray.init` or spawning the actor's process) to the first call's reply.",
        "",
        "How each peer ran:",
        "",
    ]
    for o in outcomes:
        where = f".venvs/{o.spec.env}"
        if o.unavailable:
            lines.append(f"- **{o.spec.title}** ({where}): cannot run here: {o.unavailable}")
            continue
        runs = f"{len(o.samples.get('sync_p50_us', []))} of {rounds} two-process runs and "
        runs += f"{len(o.samples.get('ps_per_s', []))} of {rounds} parameter-server runs completed"
        lines.append(f"- **{o.spec.title}** {o.version} ({where}, `{o.spec.module}`): {runs}.")
        lines += [f"  - {failure}" for failure in o.failures]
    return "\n".join(lines) + "\n"


def write(outcomes: list[Outcome], rounds: int, quick: bool, load: list[str], out: Path) -> str:
    """Write ``out``/results-peers.md and results-peers.png; return the page."""
    page = table(outcomes, rounds, quick, load)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results-peers.md").write_text(page)
    _plot(outcomes, out / "results-peers.png")
    return page


def _plot(outcomes: list[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "#2a7ab9", "torch": "#bbbbbb", "ray": "#e0a040", "monarch": "#7a5aa0"}
    fig, axes = plt.subplots(len(ROWS), 1, figsize=(8, 1.2 * len(ROWS) + 0.6))
    for ax, row in zip(axes, ROWS):
        shown = [(o, o.median(row.key)) for o in outcomes]
        names = [o.spec.title if value is not None else f"{o.spec.title} (no figure)" for o, value in shown]
        values = [value if value is not None else float("nan") for _, value in shown]
        bars = ax.barh(names, values, color=[colors.get(o.spec.key, "#888888") for o, _ in shown])
        ax.bar_label(bars, labels=[f"{v:.3g}" if v == v else "" for v in values], fontsize=7, padding=2)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.15 * max((v for v in values if v == v), default=1.0))
        better = "lower" if row.lower_is_better else "higher"
        ax.set_title(f"{row.name} ({row.unit}, {better} is better)", fontsize=8, loc="left")
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
