"""``python -m join_core.trace DIR``: read a job's dumps and name the culprit.

DIR is a run's folder of dumps (``rank-<N>.json``, see :mod:`join_core.dump`)
or the folder above it, of which the newest run is read. The analysis is the
one the watch logged: the hang report from the states the ranks reported,
the first collective at which the ranks' records differ, or the lost ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from join_core.hang_report import analyze_hang, find_desync

__all__ = ["analyze_dumps", "main"]

_MAX_DUMP_BYTES = 64 * 1024 * 1024


def _run_folder(path: Path) -> Path:
    if any(path.glob("rank-*.json")):
        return path
    runs = [p for p in path.iterdir() if p.is_dir() and any(p.glob("rank-*.json"))]
    if not runs:
        raise SystemExit(f"join_core.trace: no dumps (rank-<N>.json) in {path} or its folders")
    return max(runs, key=lambda p: max(f.stat().st_mtime for f in p.glob("rank-*.json")))


def _load(folder: Path) -> dict[int, dict[str, Any]]:
    dumps: dict[int, dict[str, Any]] = {}
    for file in sorted(folder.glob("rank-*.json")):
        if file.stat().st_size > _MAX_DUMP_BYTES:
            print(f"join_core.trace: {file.name} is larger than 64 MiB: skipped", file=sys.stderr)
            continue
        try:
            content = json.loads(file.read_text())
            dumps[int(content["rank"])] = content
        except (ValueError, KeyError, TypeError, RecursionError) as error:
            print(f"join_core.trace: {file.name} is not a dump ({error}): skipped", file=sys.stderr)
    return dumps


def analyze_dumps(folder: Path) -> list[str]:
    """The analysis of the dumps in a run's ``folder``, as lines; the first names the culprit."""
    dumps = _load(folder)
    if not dumps:
        return [f"no readable dumps in {folder}"]
    world_size = max(int(d.get("world_size", 0)) for d in dumps.values())
    kinds = {d.get("kind") for d in dumps.values()}
    missing = [r for r in range(world_size) if r not in dumps]
    tail = (
        [f"no dump from {'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing))}"]
        if missing
        else []
    )
    if "desync" in kinds:
        found = find_desync({rank: d["records"] for rank, d in dumps.items()})
        if found is not None:
            return [found, *tail]
    if "hang" in kinds:
        reported = [d for d in dumps.values() if d.get("kind") == "hang" and "awaited" in d]
        if reported:
            first = reported[0]
            states: dict[int, Any] = dict.fromkeys(range(world_size))
            states.update({rank: d["state"] for rank, d in dumps.items() if d.get("kind") == "hang"})
            return analyze_hang(first["awaited"], states, float(first.get("waited", 0.0)))
    messages = sorted({str(d.get("message", "")) for d in dumps.values()})
    return [*messages, *tail]


def main(argv: Sequence[str] | None = None) -> int:
    """The command's entry point."""
    parser = argparse.ArgumentParser(
        prog="python -m join_core.trace",
        description="Name the culprit of a hang, desync or lost rank from dumps.",
    )
    parser.add_argument(
        "dir", type=Path, help="a run's folder of dumps, or the folder of runs (newest is read)"
    )
    args = parser.parse_args(argv)
    if not args.dir.is_dir():
        parser.error(f"{args.dir} is not a folder")
    folder = _run_folder(args.dir)
    print(f"dumps: {folder}")
    print("\n".join(analyze_dumps(folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
