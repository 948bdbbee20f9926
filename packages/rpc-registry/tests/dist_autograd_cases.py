"""Functions that the distributed autograd tests run on other workers."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.futures import Future

import rpc_registry.autograd as dist_autograd
from rpc_registry import RRef, rpc_sync
from rpc_registry.engine import _current
from rpc_registry.functions import async_execution


def mul_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y + x.sin()


def chain(hops: list[str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x * y`` then, for each worker in ``hops``, a call to it with the running result."""
    out = x * y
    if hops:
        out = out + rpc_sync(hops[0], chain, args=(hops[1:], out.exp(), y))
    return out.tanh()


def chain_here(hops: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """What :func:`chain` computes, in this process alone."""
    out = x * y
    if hops:
        out = out + chain_here(hops - 1, out.exp(), y)
    return out.tanh()


def doubled_in_place(x: torch.Tensor) -> torch.Tensor:
    """``x * 2`` computed in place on the tensor this worker received."""
    return x.mul_(2)


class KeepsVariable(torch.autograd.Function):
    """``x * 2``; its ctx holds a tensor named ``variable``, as a leaf's accumulate-grad node does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.variable = x.detach()
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


def doubled_keeping_variable(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = KeepsVariable.apply(x)  # type: ignore[no-untyped-call]
    return out


def use_rref(rref: RRef[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    return rref.local_value() * t


class FailingBackward(torch.autograd.Function):
    """Identity whose backward raises."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("simulated error in backward")


def fails_in_backward(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = FailingBackward.apply(x * 2)  # type: ignore[no-untyped-call]
    return out


_PARAMS: dict[str, torch.Tensor] = {}


def make_param(name: str, values: list[float]) -> RRef[torch.Tensor]:
    """A leaf tensor kept on this worker, returned as an RRef."""
    param = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    _PARAMS[name] = param
    return RRef(param)


def scale_by_param(name: str, x: torch.Tensor) -> torch.Tensor:
    return x * _PARAMS[name]


def param_grad(name: str, context_id: int) -> torch.Tensor | None:
    """The gradient of the named parameter in ``context_id`` on this worker; its .grad stays None."""
    param = _PARAMS[name]
    assert param.grad is None
    return dist_autograd.get_gradients(context_id).get(param)


# What the hooks on accumulate-grad nodes saw, by parameter name; the nodes, kept alive with their hooks.
NodeHookCall = tuple[str, tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]
_NODE_HOOK_CALLS: dict[str, list[NodeHookCall]] = {}
_HOOKED_NODES: dict[str, torch.autograd.graph.Node] = {}


def accumulate_node(leaf: torch.Tensor) -> torch.autograd.graph.Node:
    """The accumulate-grad node of ``leaf`` (through public API: the next node of a view)."""
    view = leaf.view_as(leaf)
    assert view.grad_fn is not None
    node, _ = view.grad_fn.next_functions[0]
    assert node is not None
    return node


def hook_param_node(name: str, scale: float) -> None:
    """A pre hook that scales the named parameter's gradient and a post hook, both recording their arguments."""
    node = _HOOKED_NODES[name] = accumulate_node(_PARAMS[name])
    calls = _NODE_HOOK_CALLS.setdefault(name, [])

    def scale_grad(grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        calls.append(("pre", grads, ()))
        return tuple(None if grad is None else grad * scale for grad in grads)

    def record(
        grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: tuple[torch.Tensor | None, ...]
    ) -> None:
        calls.append(("post", grad_inputs, grad_outputs))

    node.register_prehook(scale_grad)
    node.register_hook(record)


def node_hook_calls(name: str) -> list[NodeHookCall]:
    return _NODE_HOOK_CALLS.get(name, [])


def add_node_hooks(name: str, count: int) -> None:
    """``count`` pre hooks that keep the gradient on the named parameter's accumulate-grad node."""
    node = _HOOKED_NODES[name] = accumulate_node(_PARAMS[name])
    for _ in range(count):
        node.register_prehook(lambda grads: None)


def set_switch_interval(seconds: float) -> float:
    """Set how often this worker's threads take turns; the previous interval."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    return previous


def stall_context_releases(seconds: float) -> None:
    """Keep this worker from releasing any autograd context for ``seconds`` (from a thread of its own)."""
    held = threading.Event()

    def hold() -> None:
        with _current().grad._lock:
            held.set()
            time.sleep(seconds)

    threading.Thread(target=hold, daemon=True).start()
    if not held.wait(10):
        raise TimeoutError("stall_context_releases: the contexts' lock was not taken within 10 s")


def context_count() -> int:
    return _current().grad.count()


class Stage(nn.Module):
    """One stage of a model split over workers."""

    def __init__(self, n_in: int, n_out: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.linear = nn.Linear(n_in, n_out).double()
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(n_out, n_in, generator=generator, dtype=torch.float64))
            self.linear.bias.copy_(torch.randn(n_out, generator=generator, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.tanh(self.linear(x))
        return out


def module_state(module: RRef[nn.Module]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.local_value().state_dict().items()}


@async_execution
def returns_no_future() -> Future[int]:
    return 3  # type: ignore[return-value]


class TwoArgumentError(Exception):
    """An exception that pickle cannot rebuild (its __init__ takes two arguments)."""

    def __init__(self, flag: bool, message: str) -> None:
        self.flag = flag
        super().__init__(message)


def raise_two_argument_error() -> None:
    raise TwoArgumentError(True, "cannot come back as it is")
