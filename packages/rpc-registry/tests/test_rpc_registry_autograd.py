"""Distributed autograd, DistributedOptimizer and RemoteModule across four processes."""

from __future__ import annotations

import functools
import multiprocessing
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from dist_autograd_cases import (
    NodeHookCall,
    Stage,
    accumulate_node,
    add_node_hooks,
    chain,
    chain_here,
    context_count,
    doubled_in_place,
    doubled_keeping_variable,
    fails_in_backward,
    hook_param_node,
    make_param,
    module_state,
    mul_add,
    node_hook_calls,
    param_grad,
    raise_two_argument_error,
    returns_no_future,
    scale_by_param,
    set_switch_interval,
    stall_context_releases,
    use_rref,
)
from rpcreg_socket_agent import (
    SlowToArrive,
    SocketOptions,
    let_arrive,
    run_worker,
    socket_backend,
    tracked_of,
)

import rpc_registry.autograd as dist_autograd
from rpc_registry import RRef, init_rpc, remote, rpc_async, rpc_sync, shutdown
from rpc_registry.nn import RemoteModule
from rpc_registry.optim import DistributedOptimizer

pytestmark = pytest.mark.timeout(120)

WORKERS = ("w0", "w1", "w2", "w3")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=run_worker, args=(name, rank, len(WORKERS), init_method), daemon=True)
        for rank, name in enumerate(WORKERS)
        if rank > 0
    ]
    for worker in workers:
        worker.start()
    try:
        init_rpc(
            "w0",
            backend=socket_backend(),
            rank=0,
            world_size=len(WORKERS),
            rpc_backend_options=SocketOptions(rpc_timeout=30.0, init_method=init_method),
        )
        yield
        shutdown(graceful=True, timeout=30.0)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
    assert [w.exitcode for w in workers] == [0] * (len(WORKERS) - 1)


def _wait_for_counts(want: list[int]) -> None:
    """Wait (10 s at most) until the workers hold ``want`` autograd contexts."""
    deadline = time.monotonic() + 10
    while (counts := [rpc_sync(name, context_count) for name in WORKERS]) != want:
        assert time.monotonic() < deadline, f"autograd contexts held by {WORKERS}: {counts}, not {want}"
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def contexts_released_everywhere() -> Iterator[None]:
    yield
    _wait_for_counts([0] * len(WORKERS))


def _leaves(seed: int, n: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(n)]


def _local_grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, leaves))


def _assert_grads(
    got: dict[torch.Tensor, torch.Tensor], leaves: list[torch.Tensor], want: list[torch.Tensor]
) -> None:
    for leaf, expected in zip(leaves, want):
        assert leaf in got, "a leaf of this worker has no gradient in the context"
        torch.testing.assert_close(got[leaf], expected, rtol=1e-6, atol=0)
        assert leaf.grad is None


def test_gradients_of_one_remote_call_equal_local_autograd() -> None:
    x, y = _leaves(0)
    want = _local_grads((mul_add(x, y) * y).sum(), [x, y])
    with dist_autograd.context() as context_id:
        loss = (rpc_sync("w1", mul_add, args=(x, y)) * y).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(dist_autograd.get_gradients(context_id), [x, y], want)


def test_hooks_of_a_leaf_sent_by_rpc_see_its_gradient() -> None:
    x, y = _leaves(8)
    x.register_hook(lambda grad: grad * 3)
    want = _local_grads((mul_add(x, y) * y).sum(), [x, y])
    with dist_autograd.context() as context_id:
        loss = (rpc_sync("w2", mul_add, args=(x, y)) * y).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(dist_autograd.get_gradients(context_id), [x, y], want)


def test_gradients_through_nested_calls_a_b_c_d() -> None:
    x, y = _leaves(1)
    want = _local_grads(chain_here(3, x, y).sum(), [x, y])
    with dist_autograd.context() as context_id:
        loss = rpc_sync("w1", chain, args=(["w2", "w3", "w0"], x, y)).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(dist_autograd.get_gradients(context_id), [x, y], want)


def test_gradients_through_rrefs_to_here_and_calls_on_the_owner() -> None:
    x, y = _leaves(2)
    t = torch.full((3, 4), 1.5, dtype=torch.float64, requires_grad=True)
    want = _local_grads(((mul_add(x, y) * t).sum() + mul_add(x, y).pow(2).sum()), [x, y, t])
    with dist_autograd.context() as context_id:
        rref = remote("w2", mul_add, args=(x, y))
        fetched = rref.to_here()
        via_owner = rpc_sync(rref.owner(), use_rref, args=(rref, t))
        loss = via_owner.sum() + fetched.pow(2).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(dist_autograd.get_gradients(context_id), [x, y, t], want)


def test_an_rpc_async_proxy_call_sent_once_the_rref_is_created_keeps_the_callers_context() -> None:
    # Sent from the thread that saw the creation done, it left without the context: no gradient.
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    with dist_autograd.context() as context_id:
        rref = remote("w1", tracked_of, args=(SlowToArrive(5),))
        fut = rref.rpc_async().add(x)
        rpc_sync("w2", rpc_sync, args=("w1", let_arrive))  # w0's connection to w1 waits for the argument
        dist_autograd.backward(context_id, [fut.wait().sum()])
        grads = dist_autograd.get_gradients(context_id)
    assert [id(leaf) for leaf in grads] == [id(x)]
    assert torch.equal(grads[x], torch.ones(2, dtype=torch.float64))


def test_gradients_of_leaves_on_other_workers_stay_there() -> None:
    make_param_rref = rpc_sync("w3", make_param, args=("p", [0.5, -1.0, 2.0, 3.0]))
    p = torch.tensor([0.5, -1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    (x,) = _leaves(3, 1)
    want = _local_grads((x * p).pow(2).sum(), [p])
    with dist_autograd.context() as context_id:
        loss = rpc_sync("w3", scale_by_param, args=("p", x)).pow(2).sum()
        dist_autograd.backward(context_id, [loss])
        remote_grad = rpc_sync("w3", param_grad, args=("p", context_id))
    assert remote_grad is not None
    torch.testing.assert_close(remote_grad, want[0], rtol=1e-6, atol=0)
    del make_param_rref


def test_concurrent_backward_passes_through_a_hooked_parameter_of_one_worker() -> None:
    # Four trainer threads on each of w0 and w1, one parameter on w3 with many node hooks.
    values = [0.5, -1.0, 2.0, 3.0]
    param_rref = rpc_sync("w3", make_param, args=("shared", values))
    rpc_sync("w3", add_node_hooks, args=("shared", 1000))
    previous = rpc_sync("w3", set_switch_interval, args=(1e-6,))
    try:
        futures = [
            rpc_async(trainer, _train_against_shared_param, args=(values, 4, 10)) for trainer in ("w0", "w1")
        ]
        assert [fut.wait() for fut in futures] == [[], []]
    finally:
        rpc_sync("w3", set_switch_interval, args=(previous,))
    del param_rref


def _train_against_shared_param(values: list[float], threads: int, steps: int) -> list[str]:
    """Backward passes of ``steps`` contexts in each of ``threads`` threads; the failures."""
    want = torch.tensor(values, dtype=torch.float64)
    errors: list[str] = []

    def train(seed: int) -> None:
        try:
            for _ in range(steps):
                (x,) = _leaves(seed, 1)
                with dist_autograd.context() as context_id:
                    loss = rpc_sync("w3", scale_by_param, args=("shared", x)).sum()
                    dist_autograd.backward(context_id, [loss])
                    (grad,) = dist_autograd.get_gradients(context_id).values()
                    torch.testing.assert_close(grad, want.expand(3, 4), rtol=0, atol=0)
                    got = rpc_sync("w3", param_grad, args=("shared", context_id))
                    torch.testing.assert_close(got, x.detach().sum(0), rtol=1e-12, atol=0)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors.append(repr(exc))

    workers = [threading.Thread(target=train, args=(seed,)) for seed in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    return errors


def test_concurrent_contexts_keep_their_gradients_apart() -> None:
    results: dict[int, tuple[list[torch.Tensor], dict[torch.Tensor, torch.Tensor], list[torch.Tensor]]] = {}
    errors: list[BaseException] = []

    def one(seed: int) -> None:
        try:
            x, y = _leaves(10 + seed)
            hops = [WORKERS[1 + (seed + i) % 3] for i in range(2)]
            want = _local_grads(chain_here(1, x, y).sum() * (seed + 1), [x, y])
            with dist_autograd.context() as context_id:
                for _ in range(seed + 1):  # several backward passes accumulate in one context
                    loss = rpc_sync(hops[0], chain, args=(hops[1:], x, y)).sum()
                    dist_autograd.backward(context_id, [loss])
                results[seed] = ([x, y], dist_autograd.get_gradients(context_id), want)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2, 3]
    for leaves, got, want in results.values():
        _assert_grads(got, leaves, want)


def test_remote_error_in_backward_reaches_caller_with_remote_traceback() -> None:
    (x,) = _leaves(4, 1)
    with dist_autograd.context() as context_id:
        loss = rpc_sync("w2", fails_in_backward, args=(x,)).sum()
        with pytest.raises(
            RuntimeError, match=r"Error on Node 2: simulated error in backward \(on w2\)"
        ) as info:
            dist_autograd.backward(context_id, [loss])
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "Raised on the remote worker" in notes
    assert "ValueError: simulated error in backward" in notes
    assert "dist_autograd_cases.py" in notes


def test_context_is_released_on_every_worker_it_reached() -> None:
    (x,) = _leaves(5, 1)
    with dist_autograd.context() as context_id:
        rpc_sync("w1", chain, args=(["w2", "w3"], x, x))
        assert all(rpc_sync(name, context_count) == 1 for name in WORKERS)
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {context_id}"):
        dist_autograd.get_gradients(context_id)
    _wait_for_counts([0, 0, 0, 0])


def test_leaving_a_context_does_not_wait_for_a_worker_slow_to_release_it() -> None:
    (x,) = _leaves(14, 1)
    with pytest.raises(ValueError, match="failed in the body"), dist_autograd.context():
        rpc_sync("w1", chain, args=(["w2"], x, x))  # w2 holds the context through w1
        rpc_sync("w2", stall_context_releases, args=(3.0,))
        raised = time.monotonic()
        raise ValueError("failed in the body")
    assert time.monotonic() - raised < 1.0
    _wait_for_counts([0, 0, 0, 0])


def test_result_of_a_remote_call_is_a_root_of_backward() -> None:
    (x,) = _leaves(12, 1)
    with dist_autograd.context() as context_id:
        loss = rpc_sync("w1", torch.sum, args=(x,))
        dist_autograd.backward(context_id, [loss])
        _assert_grads(dist_autograd.get_gradients(context_id), [x], [torch.ones_like(x)])


def test_tensors_received_by_rpc_may_be_changed_in_place() -> None:
    x, y = _leaves(13)
    want = _local_grads((mul_add(x, y) * 2 + x * 2).pow(2).sum(), [x, y])
    with dist_autograd.context() as context_id:
        out = rpc_sync("w2", mul_add, args=(x, y))
        out.mul_(2)
        loss = (out + rpc_sync("w3", doubled_in_place, args=(x,))).pow(2).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(dist_autograd.get_gradients(context_id), [x, y], want)


def test_custom_function_keeping_a_tensor_named_variable_backpropagates() -> None:
    x, y = _leaves(15)
    want = _local_grads((doubled_keeping_variable(x) * y).sum() + doubled_keeping_variable(y).sum(), [x, y])
    with dist_autograd.context() as context_id:
        loss = (doubled_keeping_variable(x) * y).sum() + rpc_sync(
            "w1", doubled_keeping_variable, args=(y,)
        ).sum()
        dist_autograd.backward(context_id, [loss])
        _assert_grads(dist_autograd.get_gradients(context_id), [x, y], want)


def test_rref_backward_runs_on_the_owner_locally_or_in_a_context() -> None:
    (x,) = _leaves(9, 1)
    RRef((x * 2).sum()).backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    x.grad = None
    with dist_autograd.context() as context_id:
        owned_by_w1 = remote("w1", mul_add, args=(x, x)).remote().sum()
        owned_by_w1.backward(context_id, retain_graph=True)
        owned_by_w1.backward(context_id)
        want = _local_grads(mul_add(x, x).sum(), [x])
        _assert_grads(dist_autograd.get_gradients(context_id), [x], [want[0] * 2])
    with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward\(\)"):
        RRef("foo").backward()
    with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id' to be specified"):
        owned_by_w1.backward()


def test_context_ids_carry_the_worker_id_and_do_not_nest() -> None:
    with dist_autograd.context() as context_id:
        assert context_id >> 48 == 0
        with pytest.raises(RuntimeError, match="Already have an autograd context id for this thread"):
            dist_autograd.context().__enter__()


def test_backward_rejects_roots_torch_rejects() -> None:
    with dist_autograd.context() as context_id:
        with pytest.raises(TypeError, match="context_id=None"):
            dist_autograd.backward(None, [])  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="No tensors provided"):
            dist_autograd.backward(context_id, [])
        with pytest.raises(RuntimeError, match="requires_grad not set"):
            dist_autograd.backward(context_id, [torch.ones(())])
        with pytest.raises(RuntimeError, match="all roots need to be scalar"):
            dist_autograd.backward(context_id, [torch.ones(3, requires_grad=True) * 2])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            dist_autograd.backward(context_id, [torch.ones((), requires_grad=True)])


def test_distributed_optimizer_trains_a_split_model_to_the_single_process_result() -> None:
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randn(5, 4, generator=generator, dtype=torch.float64) for _ in range(4)]
    targets = [torch.randn(5, 2, generator=generator, dtype=torch.float64) for _ in range(4)]

    first, second = Stage(4, 6, seed=1), Stage(6, 2, seed=2)
    reference = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1, momentum=0.9)
    for batch, target in zip(batches, targets):
        reference.zero_grad()
        torch.nn.functional.mse_loss(second(first(batch)), target).backward()
        reference.step()

    remote_first = RemoteModule("w1/cpu", Stage, args=(4, 6), kwargs={"seed": 1})
    remote_second = RemoteModule("rank:2/cpu", Stage, args=(6, 2), kwargs={"seed": 2})
    params = remote_first.remote_parameters() + remote_second.remote_parameters()
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    assert sorted(o.owner_name() for o in optimizer.remote_optimizers) == ["w1", "w2"]
    for batch, target in zip(batches, targets):
        with dist_autograd.context() as context_id:
            loss = torch.nn.functional.mse_loss(remote_second(remote_first(batch)), target)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)

    for module, remote_module in ((first, remote_first), (second, remote_second)):
        got = rpc_sync(remote_module.on, module_state, args=(remote_module.get_module_rref(),))
        for name, value in module.state_dict().items():
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-12)


def test_distributed_optimizer_builds_its_optimizers_with_a_factory() -> None:
    generator = torch.Generator().manual_seed(8)
    batches = [torch.randn(5, 4, generator=generator, dtype=torch.float64) for _ in range(3)]
    local = Stage(4, 2, seed=3)
    reference = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        reference.zero_grad()
        local(batch).pow(2).sum().backward()
        reference.step()

    remote_module = RemoteModule("w2/cpu", Stage, args=(4, 2), kwargs={"seed": 3})
    sgd_with_momentum = functools.partial(torch.optim.SGD, momentum=0.9)
    optimizer = DistributedOptimizer(sgd_with_momentum, remote_module.remote_parameters(), lr=0.1)
    for batch in batches:
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [remote_module(batch).pow(2).sum()])
            optimizer.step(context_id)
    got = rpc_sync("w2", module_state, args=(remote_module.get_module_rref(),))
    for name, value in local.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-12)
    with pytest.raises(TypeError, match=r"optimizer_class='SGD': must be an optimizer class"):
        DistributedOptimizer("SGD", remote_module.remote_parameters())  # type: ignore[arg-type]


def test_remote_module_forward_async_and_backward() -> None:
    local = Stage(4, 3, seed=5)
    remote_module = RemoteModule("w3/cpu", Stage, args=(4, 3), kwargs={"seed": 5})
    (x,) = _leaves(6, 1)
    want_out = local(x)
    want = _local_grads(want_out.pow(2).sum(), [x, *local.parameters()])
    with dist_autograd.context() as context_id:
        out = remote_module.forward_async(x).wait()
        torch.testing.assert_close(out, want_out, rtol=1e-6, atol=0)
        dist_autograd.backward(context_id, [remote_module(x).pow(2).sum()])
        _assert_grads(dist_autograd.get_gradients(context_id), [x], want[:1])
        param_grads = rpc_sync("w3", _module_param_grads, args=(remote_module.get_module_rref(), context_id))
    for got, expected in zip(param_grads, want[1:]):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert rpc_async("w3", context_count).wait() == 0


def _module_param_grads(module: object, context_id: int) -> list[torch.Tensor]:
    from rpc_registry import RRef

    assert isinstance(module, RRef)
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in module.local_value().parameters()]


def test_remote_module_rejects_a_malformed_remote_device() -> None:
    with pytest.raises(ValueError, match=r"remote_device='w1/'"):
        RemoteModule("w1/", Stage, args=(4, 3), kwargs={"seed": 5})


def test_async_execution_without_a_future_gets_torchs_error() -> None:
    with pytest.raises(
        RuntimeError, match=r"must return a torch\.futures\.Future object, but .*returns_no_future"
    ):
        rpc_sync("w1", returns_no_future)


def test_remote_exception_that_cannot_be_rebuilt_arrives_as_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="Original exception on remote side was TwoArgumentError") as info:
        rpc_sync("w2", raise_two_argument_error)
    assert "cannot come back as it is" in str(info.value)


def test_function_the_callee_cannot_import_gets_torchs_error() -> None:
    import dist_autograd_cases

    def local_only() -> int:
        return 1

    local_only.__module__ = "dist_autograd_cases"
    local_only.__qualname__ = "not_on_the_callee"
    dist_autograd_cases.not_on_the_callee = local_only  # type: ignore[attr-defined]
    try:
        with pytest.raises(RuntimeError, match="RPC pickler does not serialize function code: w1 could not"):
            rpc_sync("w1", local_only)
    finally:
        del dist_autograd_cases.not_on_the_callee  # type: ignore[attr-defined]


class _PassThrough(torch.autograd.Function):
    """Identity; its backward notes the address of the gradient it hands on, to each input."""

    seen: int = 0

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.count = len(inputs)
        return sum(inputs[1:], inputs[0].clone())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = grad._values() if grad.layout == torch.sparse_coo else grad
        _PassThrough.seen = values.data_ptr()
        count: int = ctx.count
        return (grad,) * count


def _pass_through(*inputs: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _PassThrough.apply(*inputs)  # type: ignore[no-untyped-call]
    return out


def _kept_address(context_id: int, leaf: torch.Tensor) -> int:
    grad = dist_autograd.get_gradients(context_id)[leaf]
    return (grad._values() if grad.layout == torch.sparse_coo else grad).data_ptr()


def test_first_gradient_is_kept_without_a_copy_as_torch_does() -> None:
    a, b = torch.randn(5, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [(_pass_through(a) * 1).sum()])
        # mul's backward made a fresh contiguous gradient: kept as it is.
        assert _kept_address(context_id, a) == _PassThrough.seen
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [(_pass_through(a, b) * 1).sum()])
        # One gradient for both leaves: each gets its own copy.
        assert len({_kept_address(context_id, a), _kept_address(context_id, b), _PassThrough.seen}) == 3
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_pass_through(a).sum()])
        # sum's backward expands (not contiguous): copied.
        assert _kept_address(context_id, a) != _PassThrough.seen
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[a], torch.ones(5, 6))


def test_first_sparse_gradient_is_kept_without_a_copy_as_torch_does() -> None:
    weight = torch.randn(10, 3, requires_grad=True)
    with dist_autograd.context() as context_id:
        loss = torch.nn.functional.embedding_bag(
            torch.tensor([1, 2, 4, 5]), _pass_through(weight), torch.tensor([0, 2]), sparse=True
        ).sum()
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        assert _kept_address(context_id, weight) == _PassThrough.seen
        dist_autograd.backward(context_id, [loss])
        want = torch.zeros(10, 3)
        want[[1, 2, 4, 5]] = 1.0  # two passes, each a mean over bags of two
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[weight].to_dense(), want)


def test_running_backward_names_the_context_only_inside_its_passes() -> None:
    (x,) = _leaves(9, 1)
    seen: list[int | None] = []
    x.register_hook(lambda grad: seen.append(dist_autograd.running_backward()))
    (mul_add(x, x) * x).sum().backward()
    assert seen == [None]
    with dist_autograd.context() as context_id:
        assert dist_autograd.running_backward() is None
        loss = (rpc_sync("w1", mul_add, args=(x, x)) * x).sum()
        dist_autograd.backward(context_id, [loss])
    # One pass here for the loss, one for the gradient coming back from w1.
    assert seen == [None, context_id, context_id]
    assert dist_autograd.running_backward() is None


def _post_hooks_of_torchs_test(leaf: torch.Tensor, calls: list[NodeHookCall]) -> torch.Tensor:
    """torch's test_post_hooks: three post hooks on ``leaf``'s accumulate-grad node (its two
    edges of ``leaf + leaf``) worth 5 calls, and a pre hook; every call is recorded."""

    def post(
        weight: int,
    ) -> Callable[[tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]], Any]:
        def hook(
            grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: tuple[torch.Tensor | None, ...]
        ) -> Any:
            calls.extend([("post", grad_inputs, grad_outputs)] * weight)
            return grad_inputs

        return hook

    def pre(grads: tuple[torch.Tensor | None, ...]) -> None:
        calls.append(("pre", grads, ()))

    a = leaf + leaf
    assert a.grad_fn is not None
    first, second = (node for node, _ in a.grad_fn.next_functions)
    assert first is not None and second is not None
    first.register_hook(post(1))
    first.register_hook(post(2))
    second.register_hook(post(2))
    second.register_prehook(pre)
    return (a * torch.arange(12.0).view(3, 4)).sum()


def test_hooks_of_accumulate_grad_nodes_run_with_the_arguments_of_torchs_engine() -> None:
    # What torch's local engine hands the same hooks is what torch's distributed engine hands them.
    local = torch.zeros(3, 4, requires_grad=True)
    want: list[NodeHookCall] = []
    _post_hooks_of_torchs_test(local, want).backward()
    t = torch.zeros(3, 4, requires_grad=True)
    got: list[NodeHookCall] = []
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [_post_hooks_of_torchs_test(t, got)])
        grads = dist_autograd.get_gradients(context_id)
    assert [kind for kind, _, _ in got] == ["pre"] + ["post"] * 5
    assert len(got) == len(want)
    for (kind, first, second), (want_kind, want_first, want_second) in zip(got, want):
        assert kind == want_kind
        torch.testing.assert_close(first, want_first, rtol=0, atol=0)
        torch.testing.assert_close(second, want_second, rtol=0, atol=0)
    assert list(grads) == [t]
    torch.testing.assert_close(grads[t], torch.arange(12.0).view(3, 4) * 2)
    assert t.grad is None


def test_node_hooks_of_a_leaf_on_another_worker_run_there_and_a_pre_hook_replaces_its_gradient() -> None:
    param_rref = rpc_sync("w2", make_param, args=("hooked", [0.5, -1.0, 2.0, 3.0]))
    rpc_sync("w2", hook_param_node, args=("hooked", 3.0))
    p = torch.tensor([0.5, -1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    (x,) = _leaves(4, 1)
    (want,) = _local_grads((x * p).pow(2).sum(), [p])
    with dist_autograd.context() as context_id:
        loss = rpc_sync("w2", scale_by_param, args=("hooked", x)).pow(2).sum()
        dist_autograd.backward(context_id, [loss])
        remote_grad = rpc_sync("w2", param_grad, args=("hooked", context_id))
    calls = rpc_sync("w2", node_hook_calls, args=("hooked",))
    assert [(kind, len(first), len(second)) for kind, first, second in calls] == [
        ("pre", 1, 0),
        ("post", 0, 1),
    ]
    torch.testing.assert_close(calls[0][1][0], want, rtol=1e-6, atol=0)
    torch.testing.assert_close(calls[1][2][0], want * 3, rtol=1e-6, atol=0)
    torch.testing.assert_close(remote_grad, want * 3, rtol=1e-6, atol=0)
    del param_rref


def test_a_node_hook_that_returns_a_wrong_number_of_gradients_fails_backward_as_in_torch() -> None:
    t = torch.zeros(3, requires_grad=True)
    loss = (t * 2).sum()
    accumulate_node(t).register_prehook(lambda grads: (grads[0], grads[0]))
    with pytest.raises(RuntimeError, match="has returned an incorrect number of values"):
        loss.backward(retain_graph=True)
    with (
        dist_autograd.context() as context_id,
        pytest.raises(RuntimeError, match="incorrect number of values"),
    ):
        dist_autograd.backward(context_id, [loss])


def _training_of(module: RRef[torch.nn.Module]) -> bool:
    return module.local_value().training


def _forward_there(remote_module: RemoteModule, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = remote_module(x)
    return out


def test_remote_module_from_a_module_rref_shares_the_remote_module() -> None:
    first = RemoteModule("w3/cpu", Stage, args=(4, 3), kwargs={"seed": 5})
    second = RemoteModule.init_from_module_rref("w3/cpu", first.get_module_rref())
    (x,) = _leaves(10, 1)
    assert second.get_module_rref() is first.get_module_rref()
    torch.testing.assert_close(second(x), Stage(4, 3, seed=5)(x), rtol=1e-6, atol=0)
    # Made on another worker, naming that one (as torch's suite does): calls still go to the owner.
    third = rpc_sync("w1", RemoteModule.init_from_module_rref, args=("w1/cpu", first.get_module_rref()))
    torch.testing.assert_close(third(x), Stage(4, 3, seed=5)(x), rtol=1e-6, atol=0)


def test_remote_module_train_and_eval_set_the_remote_modules_mode() -> None:
    remote_module = RemoteModule("w2/cpu", Stage, args=(4, 3), kwargs={"seed": 5})
    assert remote_module.eval() is remote_module
    assert rpc_sync("w2", _training_of, args=(remote_module.get_module_rref(),)) is False
    remote_module.train()
    assert rpc_sync("w2", _training_of, args=(remote_module.get_module_rref(),)) is True


def test_remote_module_methods_that_would_act_on_the_local_proxy_raise_value_error() -> None:
    remote_module = RemoteModule("w1/cpu", Stage, args=(4, 3), kwargs={"seed": 5})
    with pytest.raises(ValueError, match=r"Method ``parameters`` not supported .* use ``remote_parameters``"):
        remote_module.parameters()
    calls: dict[str, Callable[[], object]] = {
        "named_parameters": lambda: remote_module.named_parameters(),
        "buffers": lambda: remote_module.buffers(),
        "to": lambda: remote_module.to("cpu"),
        "cuda": lambda: remote_module.cuda(),
        "state_dict": lambda: remote_module.state_dict(),
        "zero_grad": lambda: remote_module.zero_grad(),
        "register_buffer": lambda: remote_module.register_buffer("b", torch.ones(1)),
        "extra_repr": lambda: remote_module.extra_repr(),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"Method ``{name}`` not supported for RemoteModule"):
            call()


def test_remote_module_of_a_class_that_is_not_a_module_raises_torchs_value_error() -> None:
    with pytest.raises(
        ValueError, match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns an instance of <class"
    ):
        RemoteModule("w1/cpu", dict, args=())  # type: ignore[arg-type]


def test_python_pickler_refuses_a_remote_module_that_rpc_sends() -> None:
    remote_module = RemoteModule("w3/cpu", Stage, args=(4, 3), kwargs={"seed": 5})
    with pytest.raises(RuntimeError, match="Cannot pickle RemoteModule in python pickler"):
        pickle.dumps(remote_module)
    (x,) = _leaves(11, 1)
    torch.testing.assert_close(
        rpc_sync("w2", _forward_there, args=(remote_module, x)), Stage(4, 3, seed=5)(x), rtol=1e-6, atol=0
    )
    setattr(remote_module, "note", "stays here")  # noqa: B010 - an attribute nn.Module does not type
    assert "note" not in rpc_sync("w2", _attributes, args=(remote_module,))
    assert repr(remote_module).startswith("RemoteModule(on='w3', device='cpu'")


def _attributes(remote_module: RemoteModule) -> list[str]:
    return list(vars(remote_module))
