"""PyTorch's "combining DDP with distributed RPC" example (pytorch/examples,
distributed/rpc/ddp_rpc) with its imports switched to ours, on four ranks:
ranks 0 and 1 are trainers, rank 2 the master, rank 3 the parameter server.

    python integration_tests/launch.py --nproc 4 integration_tests/train_ddp_rpc.py

The master creates an ``EmbeddingBag`` on the parameter server as a
``RemoteModule`` and starts both trainers by RPC. A trainer's model is that
remote embedding followed by a local ``Linear`` under
``DistributedDataParallel`` (over the trainers only); each step runs inside
``dist_autograd.context()``, goes backward with ``dist_autograd.backward``
(DDP averages the ``Linear``'s gradients over the trainers there) and steps
the remote and the local parameters with one ``DistributedOptimizer``. The
trainers see different data, so their replicas stay equal only if DDP
averaged their gradients; the master writes both trainers' final ``Linear``.
"""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from training_common import distributed, flat, make_parser, rank_from_env, write_result

import rpc_registry as rpc
import rpc_registry.autograd as dist_autograd
from ddp_join import DistributedDataParallel as DDP
from rpc_registry import RRef
from rpc_registry.nn import RemoteModule
from rpc_registry.optim import DistributedOptimizer

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
TRAINERS = [0, 1]
MASTER, PS = 2, 3


class HybridModel(torch.nn.Module):
    """The remote embedding, then a local ``Linear`` under DDP (the trainers' group)."""

    def __init__(self, remote_emb_module: RemoteModule, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        torch.manual_seed(0)
        self.fc = DDP(torch.nn.Linear(EMBEDDING_DIM, 8), process_group=group)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        return self.fc(emb_lookup)  # type: ignore[no-any-return]


_group: dist.ProcessGroup | None = None
_group_set = threading.Event()
WAIT_S = 60.0


def _batches(rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The example's random batches; each trainer its own."""
    rng = random.Random(rank)
    gen = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(count):
        num_indices = rng.randint(20, 50)
        indices = torch.randint(0, NUM_EMBEDDINGS, (num_indices,), generator=gen)
        offsets = []
        start = 0
        while start < num_indices:
            offsets.append(start)
            start += rng.randint(1, 10)
        target = torch.randint(0, 8, (len(offsets),), generator=gen)
        batches.append((indices, torch.tensor(offsets), target))
    return batches


def run_trainer(remote_emb_module: RemoteModule, rank: int, epochs: int, batches: int) -> torch.Tensor:
    """One trainer's training (runs by RPC from the master); its final ``Linear``, flattened."""
    if not _group_set.wait(timeout=WAIT_S):
        raise TimeoutError(f"trainer {rank}: the trainers' process group not made within {WAIT_S:.0f} s")
    assert _group is not None
    model = HybridModel(remote_emb_module, _group)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(torch.optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    data = _batches(rank, batches)
    for _ in range(epochs):
        for indices, offsets, target in data:
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
    return flat([p.detach() for p in model.fc.parameters()])


def main(argv: list[str]) -> int:
    global _group
    parser = make_parser(__doc__ or "")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args(argv)
    me = rank_from_env("cpu", "gloo")
    if me.world_size != 4:
        raise SystemExit(
            f"train_ddp_rpc.py runs on 4 ranks (2 trainers, master, server), not {me.world_size}"
        )
    with distributed(me):
        _group = dist.new_group(TRAINERS)  # every rank takes part in creating it
        _group_set.set()
        if me.rank == MASTER:
            remote_emb_module = RemoteModule(
                f"worker{PS}",
                torch.nn.EmbeddingBag,
                args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                kwargs={"mode": "sum"},
            )
            futs = [
                rpc.rpc_async(
                    f"worker{rank}", run_trainer, args=(remote_emb_module, rank, args.epochs, args.batches)
                )
                for rank in TRAINERS
            ]
            write_result(args.result_dir, me.rank, {"trainers": [fut.wait() for fut in futs]})
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
