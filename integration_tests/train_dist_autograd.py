"""Parameter server with distributed autograd: worker0 holds the first layer of
the model behind an RRef; every other rank is a trainer with its own number
of batches, whose dense head is DistributedDataParallel under Join.

    python integration_tests/launch.py --nproc 3 integration_tests/train_dist_autograd.py

Each step of a trainer runs inside ``rpc_registry.autograd.context()``: the
server's layer computes the hidden features by RPC, the head's loss goes
backward locally (DDP averages the head's gradients over the trainers still
training; joined ones shadow the all-reduce), the features' gradient goes
backward through RPC into the server's layer (``dist_autograd.backward``),
and a ``DistributedOptimizer`` steps the server's parameters with that
context's gradients. The server runs iteration ``i``'s forwards only after
every trainer of iteration ``i - 1`` stepped, so the run is deterministic.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from training_common import distributed, flat, make_parser, rank_from_env, write_result

import rpc_registry
import rpc_registry.autograd as dist_autograd
from ddp_join import DistributedDataParallel
from rpc_registry import RRef
from rpc_registry.optim import DistributedOptimizer

IN, HIDDEN, OUT, LR = 6, 5, 2, 0.05
WAIT_S = 60.0


class ParameterServer:
    """The first layer of the model, with a gate that orders iterations."""

    def __init__(self, steps_per_trainer: dict[int, int]) -> None:
        self.layer = torch.nn.Linear(IN, HIDDEN)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(3)
            for param in self.layer.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))
        self.steps = steps_per_trainer
        self._cond = threading.Condition()
        self._stepped: dict[int, set[int]] = {}  # iteration -> trainers that stepped in it

    def _done(self, iteration: int) -> bool:
        wanted = {rank for rank, steps in self.steps.items() if steps > iteration}
        return iteration < 0 or self._stepped.get(iteration, set()) >= wanted

    def forward(self, iteration: int, x: torch.Tensor) -> torch.Tensor:
        """The hidden features of ``x``, once the steps of the previous iteration are applied."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done(iteration - 1), timeout=WAIT_S):
                raise TimeoutError(
                    f"forward of iteration {iteration}: steps of iteration {iteration - 1} missing"
                )
        return torch.tanh(self.layer(x))

    def stepped(self, rank: int, iteration: int) -> None:
        """Trainer ``rank`` applied its step of ``iteration``."""
        with self._cond:
            self._stepped.setdefault(iteration, set()).add(rank)
            self._cond.notify_all()

    def parameters(self) -> list[RRef[torch.Tensor]]:
        """RRefs to the layer's parameters, for a DistributedOptimizer."""
        return [RRef(param) for param in self.layer.parameters()]

    def snapshot(self) -> torch.Tensor:
        with self._cond:
            return flat([p.detach() for p in self.layer.parameters()])


_server: RRef[ParameterServer] | None = None
_server_set = threading.Event()


def receive_server(rref: RRef[ParameterServer]) -> None:
    """Runs on every trainer: keep the server's RRef."""
    global _server
    _server = rref
    _server_set.set()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, IN, generator=gen), torch.randn(4, OUT, generator=gen)


def steps_of(rank: int, base: int, extra: int) -> int:
    """Trainer ``rank``'s number of batches (ranks from 1)."""
    return base + (rank - 1) * extra


def head() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(HIDDEN, OUT)


def main(argv: list[str]) -> int:
    args = make_parser(__doc__ or "").parse_args(argv)
    me = rank_from_env(args.device, args.backend)
    trainers = list(range(1, me.world_size))
    counts = {rank: steps_of(rank, args.base, args.extra) for rank in trainers}
    with distributed(me):
        trainer_group = dist.new_group(trainers)  # every rank takes part in creating it
        if me.rank == 0:
            server = rpc_registry.remote("worker0", ParameterServer, args=(counts,))
            for rank in trainers:
                rpc_registry.rpc_sync(f"worker{rank}", receive_server, args=(server,))
            dist.barrier()  # the trainers are done
            write_result(args.result_dir, me.rank, {"server": server.rpc_sync().snapshot()})
            dist.barrier()
            return 0
        if not _server_set.wait(timeout=WAIT_S):
            raise TimeoutError(f"rank {me.rank}: no server RRef from worker0 within {WAIT_S:.0f} s")
        assert _server is not None
        server = _server
        model = DistributedDataParallel(
            head().to(me.device),
            device_ids=[me.device] if me.device.type == "cuda" else None,
            process_group=trainer_group,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        dist_optim = DistributedOptimizer(torch.optim.SGD, server.rpc_sync().parameters(), lr=LR)
        losses = []
        with model.join():
            for step in range(counts[me.rank]):
                x, y = batch(me.rank, step)
                with dist_autograd.context() as context_id:
                    hidden = server.rpc_sync().forward(step, x)
                    features = hidden.detach().to(me.device).requires_grad_()
                    optimizer.zero_grad()
                    loss = torch.nn.functional.mse_loss(model(features), y.to(me.device))
                    loss.backward()  # DDP all-reduces the head's gradients here
                    optimizer.step()
                    assert features.grad is not None
                    # The features' gradient, on through the server's layer.
                    dist_autograd.backward(context_id, [(hidden * features.grad.cpu()).sum()])
                    dist_optim.step(context_id)
                server.rpc_sync().stepped(me.rank, step)
                losses.append(loss.item())
        dist.barrier()
        dist.barrier()  # the server took its snapshot
        dense = flat(model.parameters())
    write_result(args.result_dir, me.rank, {"steps": counts[me.rank], "dense": dense, "losses": losses})
    print(f"rank {me.rank}: {counts[me.rank]} steps")
    return 0


def reference(world_size: int, base: int, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same run in one process: (the server's layer, the head), flattened."""
    trainers = list(range(1, world_size))
    counts = {rank: steps_of(rank, base, extra) for rank in trainers}
    server = ParameterServer(counts)
    model = head()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(max(counts.values())):
        active = [rank for rank in trainers if counts[rank] > step]
        layer_grads = []
        head_total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in active:
            x, y = batch(rank, step)
            server.layer.zero_grad()
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(torch.tanh(server.layer(x))), y)
            loss.backward()
            layer_grads.append([p.grad.clone() for p in server.layer.parameters() if p.grad is not None])
            for acc, p in zip(head_total, model.parameters()):
                assert p.grad is not None
                acc += p.grad
        # DDP averages over the trainers of the group, the joined ones adding zeros.
        for acc, p in zip(head_total, model.parameters()):
            p.grad = acc / len(trainers)
        optimizer.step()
        with torch.no_grad():
            for grads in layer_grads:  # every trainer steps the server with its own gradients
                for p, g in zip(server.layer.parameters(), grads):
                    p.sub_(LR * g)
    return server.snapshot(), flat(model.parameters())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
