"""Demo: three local ranks with uneven inputs under join_core.Join.

Each rank trains a tiny linear model on its own number of batches and
averages gradients with the others every step. Ranks that run out join early
and shadow the others' all-reduces; the output shows each rank's progress,
who joined when, and that every rank ends with the same model.

    python3 tools/dev.py demo [--nproc N] [--batches B]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from join_core import Join, JoinHook
from join_core.testing import run_ranks


def say(line: str) -> None:
    # One write per line, so lines of different ranks never interleave.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class GradientAverager:
    """A Joinable that all-reduces a model's gradients each step and carries
    Join's heartbeat in the same all-reduce (one element more)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.shadowed = 0
        self.last_joiner = False

    def _all_reduce(self, grads: list[torch.Tensor], signal: float) -> tuple[float, torch.Tensor]:
        flat = torch.cat([torch.tensor([signal])] + [g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        return float(flat[0]), flat[1:]

    def average_gradients(self) -> None:
        Join.notify_join_context(self)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()]
        training, summed = self._all_reduce(grads, Join.heartbeat_signal(self))
        offset = 0
        for p in self.model.parameters():
            p.grad = (summed[offset : offset + p.numel()] / training).view_as(p)
            offset += p.numel()
        Join.heartbeat_result(self, training)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _AveragerHook(self)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD
        assert group is not None
        return group


class _AveragerHook(JoinHook):
    carries_heartbeat = True

    def __init__(self, averager: GradientAverager) -> None:
        self.averager = averager

    def main_hook(self) -> None:
        zeros = [torch.zeros_like(p) for p in self.averager.model.parameters()]
        training, _ = self.averager._all_reduce(zeros, Join.heartbeat_signal(self.averager))
        Join.heartbeat_result(self.averager, training)
        if training:
            self.averager.shadowed += 1
            say(f"  rank {dist.get_rank()}: joined, shadowing ({training:.0f} still training)")

    def post_hook(self, is_last_joiner: bool) -> None:
        # The last rank to join has the final model: everyone takes it.
        self.averager.last_joiner = is_last_joiner
        src = torch.tensor([dist.get_rank() if is_last_joiner else -1])
        dist.all_reduce(src, op=dist.ReduceOp.MAX)
        for p in self.averager.model.parameters():
            dist.broadcast(p.data, src=int(src))


def train(rank: int, world_size: int, base: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = GradientAverager(model)
    batches = base + 2 * rank
    gen = torch.Generator().manual_seed(rank)
    start = time.monotonic()
    with Join([averager]):
        for step in range(batches):
            x = torch.randn(8, 4, generator=gen)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            averager.average_gradients()
            optimizer.step()
            say(f"rank {rank}: batch {step + 1}/{batches}  loss {loss.item():.3f}")
        say(f"rank {rank}: out of inputs after {batches} batches, joining")
    return {
        "batches": batches,
        "shadowed": averager.shadowed,
        "last_joiner": averager.last_joiner,
        "seconds": time.monotonic() - start,
        "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=3, help="number of local ranks (default 3)")
    parser.add_argument("--batches", type=int, default=4, help="batches of rank 0; rank r has 2r more")
    args = parser.parse_args(argv)
    results = run_ranks(train, args.nproc, args.batches, timeout=120.0)
    print("\nsummary")
    for rank, result in enumerate(results):
        print(
            f"  rank {rank}: {result['batches']} batches, shadowed {result['shadowed']} iterations, "
            f"{result['seconds']:.2f} s"
        )
    last = [rank for rank, result in enumerate(results) if result["last_joiner"]]
    print(f"  joined last: rank {', '.join(map(str, last))}")
    same = all(torch.equal(results[0]["weights"], r["weights"]) for r in results[1:])
    print(f"  every rank ends with the same model: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
