"""The RPC API across three processes: this one (w0) and two spawned workers."""

from __future__ import annotations

import functools
import gc
import logging
import multiprocessing
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch
from rpcreg_socket_agent import (
    SlowToArrive,
    SocketOptions,
    Tracked,
    add_one_on,
    drop_held,
    fetch_held,
    hold,
    let_arrive,
    live_tracked,
    local_value_if_owner,
    make_tracked,
    pid,
    raise_value_error,
    run_worker,
    sleep_then,
    socket_backend,
    tracked_copy_of,
    tracked_of,
    value_via_to_here,
)

from rpc_registry import (
    OperatorSchemaError,
    RRef,
    WorkerInfo,
    WorkerNameError,
    get_worker_info,
    init_rpc,
    remote,
    report_slow_calls,
    rpc_async,
    rpc_sync,
    shutdown,
)

# Called with arguments they do not take, on purpose.
UNTYPED_ADD: Callable[..., Any] = torch.add
UNTYPED_DIVMOD: Callable[..., Any] = divmod
UNTYPED_ZEROS: Callable[..., Any] = torch.zeros

pytestmark = pytest.mark.timeout(90)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _eventually(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=run_worker, args=(f"w{rank}", rank, 3, init_method), daemon=True)
        for rank in (1, 2)
    ]
    for worker in workers:
        worker.start()
    try:
        init_rpc(
            "w0",
            backend=socket_backend(),
            rank=0,
            world_size=3,
            rpc_backend_options=SocketOptions(rpc_timeout=20.0, init_method=init_method),
        )
        yield
        shutdown(graceful=True, timeout=30.0)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
    assert [w.exitcode for w in workers] == [0, 0]


@pytest.fixture(autouse=True)
def no_tracked_values_left() -> Iterator[None]:
    yield
    gc.collect()
    for name in ("w1", "w2"):
        _eventually(functools.partial(_holds_nothing, name), f"{name} freed its values")


def _holds_nothing(worker: str) -> bool:
    return rpc_sync(worker, live_tracked) == 0


def test_a_slow_rpc_sync_logs_the_callees_running_stack(caplog: pytest.LogCaptureFixture) -> None:
    report_slow_calls(after=1.0)
    try:
        with caplog.at_level(logging.ERROR, logger="rpc_registry.slow_calls"):
            assert rpc_sync("w1", sleep_then, args=(3.0, 7)) == 7
            _eventually(lambda: bool(caplog.records), "a slow-call report")
    finally:
        report_slow_calls()
    report = caplog.records[0].getMessage()
    assert report.startswith("rpc_sync to w1 (sleep_then) has waited"), report
    assert "w1 has been running sleep_then for" in report, report
    assert "in sleep_then" in report and "time.sleep(seconds)" in report, report


def test_rpc_sync_runs_function_in_other_process() -> None:
    assert rpc_sync("w1", pid) != os.getpid()
    result = rpc_sync("w1", torch.add, args=(torch.ones(2), 1))
    assert torch.equal(result, torch.full((2,), 2.0))


def test_rpc_async_future_holds_result() -> None:
    futures = [rpc_async(f"w{i}", sleep_then, args=(0.05, i)) for i in (1, 2)]
    assert [f.wait() for f in futures] == [1, 2]


def test_worker_can_be_named_by_worker_info_or_id() -> None:
    assert rpc_sync(get_worker_info("w2"), pid) == rpc_sync(2, pid)


def test_unknown_worker_id_raises_runtime_error_as_torch_and_value_error() -> None:
    for exc_type in (RuntimeError, ValueError):
        with pytest.raises(exc_type, match=r"to=7: no worker has this id \(the ids are \[0, 1, 2\]\)"):
            rpc_sync(7, pid)
    assert issubclass(WorkerNameError, RuntimeError) and issubclass(WorkerNameError, ValueError)


def test_destination_of_another_type_raises_value_error_as_torch_and_type_error() -> None:
    for exc_type in (ValueError, TypeError):
        with pytest.raises(exc_type, match=r"to=1.5: must be a worker name, a WorkerInfo or a worker id"):
            rpc_async(1.5, pid)  # type: ignore[call-overload]


def test_failed_request_is_logged_on_the_callee(caplog: pytest.LogCaptureFixture) -> None:
    # Calls to oneself take the callee's path too, so this process's log shows it.
    with (
        caplog.at_level(logging.WARNING, logger="rpc_registry.api"),
        pytest.raises(ValueError, match="logged boom"),
    ):
        rpc_sync("w0", raise_value_error, args=("logged boom",))
    (record,) = [r for r in caplog.records if "logged boom" in r.getMessage()]
    assert "w0: a request of w0 failed" in record.getMessage()
    assert "raise_value_error" in record.getMessage()  # the traceback


def test_call_to_self_runs_in_this_process() -> None:
    assert rpc_sync("w0", pid) == os.getpid()


def test_remote_exception_reaches_caller_with_its_type() -> None:
    with pytest.raises(ValueError, match="boom"):
        rpc_sync("w1", raise_value_error, args=("boom",))


def test_torch_operator_with_no_matching_schema_raises_torchs_runtime_error_that_is_a_type_error() -> None:
    with pytest.raises(
        RuntimeError, match=r"^Overloaded torch operator invoked from Python failed to match any schema"
    ):
        rpc_sync("w1", UNTYPED_ADD, args=())
    with pytest.raises(TypeError, match=r"Expected a value of type 'Tensor' for argument 'other'"):
        rpc_async("w1", UNTYPED_ADD, args=(torch.ones(1), "x"))  # at the call, as torch's


@pytest.mark.parametrize("call", [rpc_sync, rpc_async, remote], ids=["rpc_sync", "rpc_async", "remote"])
def test_an_operators_arguments_are_matched_to_its_schemas_at_the_call_as_torchs(
    call: Callable[..., object],
) -> None:
    # torch.zeros(3) runs in Python, but an operator called through RPC takes
    # its schema's types: the size is a list.
    with pytest.raises(OperatorSchemaError, match=r"^Overloaded torch operator .*failed to match any schema"):
        call("w1", UNTYPED_ZEROS, args=(3,))
    assert rpc_sync("w1", torch.zeros, args=([3],)).tolist() == [0.0, 0.0, 0.0]


def test_type_error_of_a_python_function_stays_a_plain_type_error() -> None:
    with pytest.raises(TypeError) as raised:
        rpc_sync("w1", UNTYPED_DIVMOD, args=(1,))
    assert type(raised.value) is TypeError


def test_call_exceeding_timeout_raises_timeout_error() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no reply within 0.3 s"):
        rpc_sync("w1", sleep_then, args=(2.0, 1), timeout=0.3)
    assert time.monotonic() - start < 1.5


def test_timeout_zero_waits_without_limit() -> None:
    assert rpc_sync("w1", sleep_then, args=(0.3, 7), timeout=0) == 7


def test_negative_timeout_other_than_minus_one_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"timeout=-2"):
        rpc_sync("w1", pid, timeout=-2)


def test_get_worker_info_knows_every_worker() -> None:
    assert get_worker_info() == WorkerInfo("w0", 0)
    assert get_worker_info("w2") == WorkerInfo("w2", 2)
    assert get_worker_info(worker_name="w2") == WorkerInfo("w2", 2)


def test_init_rpc_twice_raises_already_initialized() -> None:
    with pytest.raises(RuntimeError, match="RPC is already initialized"):
        init_rpc("w0", backend=socket_backend(), rank=0, world_size=3)


def test_async_execution_replies_when_returned_future_completes() -> None:
    # The reply is the future's value; rpc_sync's static type cannot tell.
    result = cast(torch.Tensor, rpc_sync("w1", add_one_on, args=("w2", torch.ones(2))))
    assert torch.equal(result, torch.full((2,), 4.0))


def test_remote_value_lives_on_owner() -> None:
    rref = remote("w1", make_tracked, args=(5,))
    assert (rref.owner_name(), rref.owner(), rref.is_owner()) == ("w1", WorkerInfo("w1", 1), False)
    assert rref.to_here().value == 5
    assert rref.confirmed_by_owner()
    assert rpc_sync("w1", live_tracked) == 1


def test_local_value_on_a_user_raises_and_names_the_owner() -> None:
    rref = remote("w1", make_tracked, args=(1,))
    with pytest.raises(RuntimeError, match=r"Call it on owner WorkerInfo\(id=1, name=w1\).*to_here"):
        rref.local_value()


def test_rref_takes_torchs_type_hint_argument() -> None:
    assert RRef(7, int).local_value() == 7
    assert RRef(torch.ones(1), type_hint=torch.Tensor).to_here().item() == 1.0


def test_rref_string_forms_are_torchs() -> None:
    owned = RRef(1)
    assert str(owned) == f"OwnerRRef(GloballyUniqueId(created_on=0, local_id={owned._rref_id[1]}))"
    user = remote("w1", make_tracked, args=(1,))
    rref_id, fork_id = user._rref_id[1], user._fork_id[1] if user._fork_id else -1
    assert str(user) == (
        f"UserRRef(RRefId = GloballyUniqueId(created_on=0, local_id={rref_id}), "
        f"ForkId = GloballyUniqueId(created_on=0, local_id={fork_id}))"
    )
    user.to_here()


def test_failed_remote_creation_is_raised_by_to_here() -> None:
    rref: RRef[None] = remote("w1", raise_value_error, args=("no value",))
    with pytest.raises(ValueError, match="no value"):
        rref.to_here()


def test_owner_releases_value_after_last_user_reference() -> None:
    rref = remote("w1", make_tracked, args=(3,))
    rref.to_here()
    assert rpc_sync("w1", live_tracked) == 1
    del rref
    gc.collect()
    _eventually(lambda: rpc_sync("w1", live_tracked) == 0, "w1 freed the value")


def test_owner_keeps_value_while_a_forked_user_holds_it() -> None:
    rref = remote("w1", make_tracked, args=(9,))
    assert rpc_sync("w2", hold, args=(rref,)) is False
    del rref
    gc.collect()
    time.sleep(0.5)  # time for this worker's release to reach w1
    assert rpc_sync("w1", live_tracked) == 1
    assert rpc_sync("w2", fetch_held) == 9
    rpc_sync("w2", drop_held)
    _eventually(lambda: rpc_sync("w1", live_tracked) == 0, "w1 freed the value")


def test_rref_sent_back_to_owner_is_the_local_value_there() -> None:
    rref = remote("w1", make_tracked, args=(4,))
    assert rpc_sync("w1", local_value_if_owner, args=(rref,)) == 4


def test_rref_returned_by_owner_keeps_value_alive_for_caller() -> None:
    rref: RRef[RRef[Tracked]] = remote("w2", remote, args=("w1", make_tracked, (6,)))
    inner = rref.to_here()
    del rref
    gc.collect()
    assert inner.owner_name() == "w1"
    assert inner.to_here().value == 6


def test_rref_proxies_call_methods_of_the_value_on_owner() -> None:
    rref = remote("w1", make_tracked, args=(5,))
    assert rref.rpc_sync().add(2) == 7
    assert rref.rpc_async().get().wait() == 7
    assert rref.remote().get().to_here() == 7


def test_rpc_async_proxy_returns_at_once_while_the_value_is_created() -> None:
    # The proxy waited until the owner had the creation's arguments: here 10 s, after which the
    # argument arrives as -1; a large one takes as long to arrive.
    rref = remote("w1", tracked_of, args=(SlowToArrive(5),))
    fut = rref.rpc_async().add(2)
    rpc_sync("w2", rpc_sync, args=("w1", let_arrive))  # w0's connection to w1 waits for the argument
    assert fut.wait() == 7


def test_rpc_async_proxy_of_a_failed_creation_fails_its_future() -> None:
    rref = remote("w1", raise_value_error, args=("no value",))
    fut = rref.rpc_async().get()
    with pytest.raises(ValueError, match="no value"):
        fut.wait()


def test_remote_proxy_of_a_missing_method_raises_attribute_error_at_the_call() -> None:
    rref = remote("w1", make_tracked, args=(5,))
    with pytest.raises(AttributeError, match=r"'Tracked' object has no attribute 'non_exist'.* on w1"):
        rref.remote().non_exist()
    with pytest.raises(AttributeError, match=r"has no attribute 'non_exist'"):
        RRef(Tracked(1)).remote().non_exist()
    assert rref.remote().get().to_here() == 5


def test_local_rref_is_owned_here() -> None:
    value = Tracked(2)
    rref = RRef(value)
    assert rref.is_owner() and rref.local_value() is value
    assert rref.owner() == get_worker_info()
    assert rpc_sync("w1", value_via_to_here, args=(rref,)) == 2


def test_to_here_right_after_remote_whose_arguments_fork_an_rref() -> None:
    # The creation waits for w2 to learn of the fork; the fetch must not overtake it.
    for _ in range(5):
        held = remote("w2", make_tracked, args=(4,))
        result = remote("w1", value_via_to_here, args=(held,))
        assert result.to_here() == 4
        assert result.rpc_sync().bit_length() == 3
        del held, result


def test_an_rref_dropped_before_its_creation_went_out_is_freed_by_its_owner() -> None:
    # Each creation waits for w2 to learn of the fork of `held`; the RRef it returns is dropped at
    # once, so its deletion is queued first. w1 must still free every value (checked after the test).
    held = remote("w2", make_tracked, args=(4,))
    for _ in range(5):
        remote("w1", tracked_copy_of, args=(held,))
    del held


def test_sparse_tensors_travel_as_arguments_and_results() -> None:
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2, 2], [1, 0, 0]]), torch.tensor([1.0, 2.0, 3.0]), (3, 2), check_invariants=True
    )
    doubled = rpc_sync("w1", torch.add, args=(sparse, sparse))
    assert doubled.layout == torch.sparse_coo
    assert torch.equal(doubled.to_dense(), (sparse + sparse).to_dense())
    assert torch.equal(rpc_sync("w2", torch.Tensor.to_dense, args=(sparse,)), sparse.to_dense())
    # An uncoalesced one arrives as it is, duplicate indices and all (as with torch's agent).
    uncoalesced = rpc_sync("w1", torch.Tensor.clone, args=(sparse,))
    assert (uncoalesced.is_coalesced(), uncoalesced._nnz()) == (False, 3)
    assert torch.equal(uncoalesced._indices(), sparse._indices())
    coalesced = rpc_sync("w1", torch.Tensor.coalesce, args=(sparse,))
    assert (coalesced.is_coalesced(), coalesced._nnz()) == (True, 2)


def test_non_contiguous_views_keep_their_strides() -> None:
    view = torch.arange(12.0).view(3, 4).t()[1:]
    assert rpc_sync("w1", torch.Tensor.stride, args=(view,)) == view.stride()
    back = rpc_sync("w2", torch.Tensor.mul, args=(view, 1))
    assert torch.equal(back, view)
    assert torch.equal(rpc_sync("w1", torch.Tensor.clone, args=(view,)), view)


def test_rref_cannot_be_pickled_outside_rpc() -> None:
    import pickle

    with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):
        pickle.dumps(RRef(35))
