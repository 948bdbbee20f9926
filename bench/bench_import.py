"""What importing our RPC packages costs beyond ``import torch``.

    PYTHONPATH=packages/join-core/src:packages/rpc-registry/src:packages/tensorpipe-backend/src:bench \
        python bench/bench_import.py [--rounds N]

Each sample is a fresh interpreter that imports torch, then ``rpc_registry``
and ``tensorpipe_backend``, and reports both times. Bytecode is cached, as an
installed wheel leaves it (``PYTHONDONTWRITEBYTECODE`` is dropped; the cache
goes to a temporary ``PYTHONPYCACHEPREFIX`` that one run fills first), so the
figure is the modules' own start-up, not their compilation. torch's RPC
comes with ``import torch``: the reference column is ``import torch`` itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Final

from benchlib import Figure

__all__ = ["import_figures"]

#: Fresh interpreters per round.
_SAMPLES: Final = 5
_GOAL_MS: Final = 50.0
_PROGRAM: Final = """\
import json, time
start = time.perf_counter()
import torch
torch_done = time.perf_counter()
import rpc_registry, tensorpipe_backend
print(json.dumps({"torch": torch_done - start, "ours": time.perf_counter() - torch_done}))
"""


def _sample(env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    times: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return times


def import_figures(rounds: int, quick: bool) -> list[Figure]:
    """The import figure: medians over ``rounds`` x 5 fresh interpreters (2 with ``quick``)."""
    samples = 2 if quick else _SAMPLES
    with tempfile.TemporaryDirectory(prefix="bench-pycache-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        _sample(env)  # fills the cache
        runs = [_sample(env) for _ in range(rounds * samples)]
    ours = statistics.median(r["ours"] for r in runs) * 1e3
    torch_ms = statistics.median(r["torch"] for r in runs) * 1e3
    return [
        Figure(
            "importing rpc_registry and tensorpipe_backend after torch (fresh interpreter, bytecode cached)",
            "ms",
            ours,
            torch_ms,
            f"<= {_GOAL_MS:g} ms",
            ours,
            ours <= _GOAL_MS,
            reference="import torch itself, which brings torch's RPC",
        )
    ]


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for figure in import_figures(args.rounds, False):
        print(
            f"{figure.name}: {figure.ours:.1f} ms (import torch: {figure.torch:.0f} ms; goal {figure.goal})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
