"""A worker for the launcher tests: joins the process group, then ends as told.

    python -m join_core.launch --nproc-per-node 3 launch_worker.py --kill 2 --sleep 1

Every rank meets the others in a barrier, then: the ranks of ``--kill``
SIGKILL themselves, those of ``--exit CODE:RANK`` exit with that code after
``--exit-after`` seconds, and the rank of ``--raise`` raises ValueError, and the others sleep ``--sleep`` seconds, write to
the rendezvous store through a new client (it must still serve: it is the
agent's, not rank 0's), print ``rank R: store ok`` and exit with 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

# torch's stubs do not re-export the store class it documents publicly.
TCPStore = dist.TCPStore  # type: ignore[attr-defined]


@record  # a raised error reaches the agent through torch's error file
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kill", type=int, action="append", default=[], help="a rank that SIGKILLs itself")
    parser.add_argument("--exit", action="append", default=[], help="CODE:RANK: that rank exits with CODE")
    parser.add_argument("--raise", dest="raise_", type=int, default=-1, help="a rank that raises ValueError")
    parser.add_argument("--exit-after", type=float, default=0.0, help="seconds before the --exit ranks exit")
    parser.add_argument(
        "--sleep", type=float, default=1.0, help="seconds the other ranks wait before the store"
    )
    parser.add_argument("--pid-dir", type=Path, default=None, help="where each rank writes 'PID AGENT_PID'")
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    dist.barrier()
    dist.destroy_process_group()
    if args.pid_dir is not None:  # after the group: a test that kills a rank then leaves the others whole
        (args.pid_dir / f"rank-{rank}").write_text(f"{os.getpid()} {os.getppid()}")
    if rank in args.kill:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == args.raise_:
        raise ValueError(f"rank {rank} was told to fail")
    exits = {int(r): int(code) for code, _, r in (item.partition(":") for item in args.exit)}
    if rank in exits:
        time.sleep(args.exit_after)
        print(f"rank {rank}: exiting with {exits[rank]}", flush=True)
        return exits[rank]
    time.sleep(args.sleep)
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=10),
    )
    store.set(f"launch-test/{rank}", "alive")
    print(f"rank {rank}: store ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
