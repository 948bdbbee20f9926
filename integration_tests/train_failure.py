"""Failure: one rank raises, freezes or is killed mid-epoch inside Join. Every
rank must leave with an error, RPC shut down, within seconds; no process is
left behind.

    python integration_tests/launch.py --nproc 3 integration_tests/train_failure.py --fail-rank 1
    python integration_tests/launch.py --nproc 3 integration_tests/train_failure.py --how freeze
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from training_common import distributed, make_batch, make_model, make_parser, rank_from_env

from ddp_join import DistributedDataParallel, ZeroRedundancyOptimizer
from join_core import Join, RankLostError


def main(argv: list[str]) -> int:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--fail-rank", type=int, default=1, help="the rank that fails")
    parser.add_argument(
        "--how", choices=["raise", "freeze", "kill"], default="raise", help="raise, SIGSTOP or SIGKILL itself"
    )
    args = parser.parse_args(argv)
    me = rank_from_env(args.device, args.backend)
    try:
        with distributed(me):
            model = DistributedDataParallel(
                make_model().to(me.device), device_ids=[me.device] if me.device.type == "cuda" else None
            )
            optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
            last_step = time.monotonic()
            try:
                with Join([model, optimizer]):
                    for step in range(args.base + me.rank * args.extra):
                        x, y = make_batch(100 * me.rank + step, me.device)
                        loss = torch.nn.functional.mse_loss(model(x), y)
                        if me.rank == args.fail_rank and step == 2:
                            if args.how == "raise":
                                raise ValueError(f"corrupt batch at step {step}")
                            os.kill(os.getpid(), signal.SIGSTOP if args.how == "freeze" else signal.SIGKILL)
                        loss.backward()
                        optimizer.step()
                        last_step = time.monotonic()
            except RankLostError:
                print(f"told {time.monotonic() - last_step:.1f} s after the last step", flush=True)
                raise
    except Exception:  # noqa: BLE001 - report and exit non-zero, as a training script would
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
