"""What the integration runs share: the environment torchrun gives, devices,
the model and data, RPC start-up, result files, and single-process references."""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import rpc_registry
from tensorpipe_backend import TensorPipeRpcBackendOptions

FEATURES: Final = 8
OUTPUTS: Final = 2


@dataclass(frozen=True)
class Rank:
    """This process's place in the run, from torchrun's environment."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def name(self) -> str:
        return f"worker{self.rank}"


def make_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every run takes; a run may add its own."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--base", type=int, default=4, help="batches of rank 0")
    parser.add_argument("--extra", type=int, default=2, help="batches each next rank has more")
    parser.add_argument("--result-dir", type=Path, default=None, help="where each rank writes its result")
    return parser


#: What torchrun (or launch.py) sets for every rank, and init_process_group("env://") reads.
TORCHRUN_VARIABLES: Final = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def rank_from_env(device: str, backend: str) -> Rank:
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
    if missing:
        script = os.path.relpath(sys.argv[0])
        raise SystemExit(
            f"{script} runs as one rank of a job and reads where it stands from the environment "
            f"torchrun gives, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. "
            f"Start every rank at once with `torchrun --nproc-per-node 2 {script}` or "
            f"`python integration_tests/launch.py --nproc 2 {script}`, or set RANK (0 to N-1), "
            "WORLD_SIZE (N), MASTER_ADDR and MASTER_PORT (where rank 0 listens, e.g. 127.0.0.1 "
            "and 29500) in each rank's environment yourself."
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device == "cuda":
        # NCCL needs a GPU per rank; over gloo every rank may share one.
        dev = torch.device("cuda", local_rank if backend == "nccl" else 0)
        torch.cuda.set_device(dev)
    else:
        if backend == "nccl":
            raise SystemExit("--backend nccl needs --device cuda")
        dev = torch.device("cpu")
    return Rank(rank, world_size, local_rank, dev, backend)


@contextmanager
def distributed(me: Rank, graceful_rpc: bool = True) -> Iterator[None]:
    """The process group and RPC for this rank, both through env://."""
    dist.init_process_group(me.backend, init_method="env://", timeout=timedelta(seconds=120))
    options = TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=60.0)
    rpc_registry.init_rpc(me.name, rank=me.rank, world_size=me.world_size, rpc_backend_options=options)
    ok = False
    try:
        yield
        ok = True
    finally:
        rpc_registry.shutdown(graceful=ok and graceful_rpc, timeout=30.0)
        dist.destroy_process_group()


def write_result(result_dir: Path | None, rank: int, result: dict[str, Any]) -> None:
    if result_dir is not None:
        result_dir.mkdir(parents=True, exist_ok=True)
        with open(result_dir / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(result, f)


def read_results(result_dir: Path, world_size: int) -> list[dict[str, Any]]:
    results = []
    for rank in range(world_size):
        with open(result_dir / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUTPUTS))


_TRUE = torch.Generator().manual_seed(1234)
TRUE_WEIGHTS = torch.randn(FEATURES, OUTPUTS, generator=_TRUE)


def make_batch(batch_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``batch_id`` of a regression the model can learn."""
    gen = torch.Generator().manual_seed(10_000 + batch_id)
    x = torch.randn(16, FEATURES, generator=gen)
    y = torch.tanh(x @ TRUE_WEIGHTS)
    return x.to(device), y.to(device)


def flat(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).cpu() for t in tensors])


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded parameter, on the CPU, on every rank: torch
    2.11's ``DTensor.full_tensor()`` crashes (SIGSEGV) on CUDA tensors over
    gloo, so there FSDP2's dim-0 shards are gathered with ``all_gather_object``."""
    if not isinstance(value, DTensor):
        return value.detach().cpu()
    group = value.device_mesh.get_group()
    if value.device.type == "cpu" or dist.get_backend(group) != "gloo":
        return value.full_tensor().detach().cpu()
    assert value.placements == (Shard(0),), value.placements
    shards: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, value.to_local().detach().cpu(), group=group)
    return torch.cat(shards)


def reference_dense(
    batches_per_rank: list[list[int]], make_optimizer: Callable[[Any], torch.optim.Optimizer]
) -> torch.Tensor:
    """One process: at iteration i, the gradients of the batches the ranks
    still training took, summed and divided by the world size, then a step."""
    model = make_model()
    optimizer = make_optimizer(model.parameters())
    world_size = len(batches_per_rank)
    for step in range(max(len(b) for b in batches_per_rank)):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for batches in batches_per_rank:
            if step < len(batches):
                model.zero_grad()
                x, y = make_batch(batches[step])
                torch.nn.functional.mse_loss(model(x), y).backward()
                for acc, p in zip(total, model.parameters()):
                    assert p.grad is not None
                    acc += p.grad
        for acc, p in zip(total, model.parameters()):
            p.grad = acc / world_size
        optimizer.step()
    return flat(model.parameters())
