"""A graceful shutdown releases a worker's RRefs only once every worker has
stopped calling: until then another worker may still ask it to forward one."""

from __future__ import annotations

import gc
import queue
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tpb_workers import CONTEXT, forward_kept_when, free_port, keep, options, shut_down_when, spawned

from rpc_registry import RRef, init_rpc, rpc_sync, shutdown
from tensorpipe_backend import ensure_registered

pytestmark = pytest.mark.timeout(90)


def test_a_worker_in_shutdown_still_forwards_its_rrefs_for_workers_that_are_not() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    stored, go, results = CONTEXT.Event(), CONTEXT.Event(), CONTEXT.Queue()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (shut_down_when, ("w1", 1, 3, init_method, stored)),
        (forward_kept_when, ("w2", 2, 3, init_method, "w1", go, results)),
    ]
    with spawned(targets):
        init_rpc("w0", ensure_registered(), 0, 3, options(init_method))
        try:
            value = torch.ones(2)
            freed = weakref.ref(value)
            rref = RRef(value)
            del value
            rpc_sync("w1", keep, args=(rref,))  # w1's fork is now the only reference
            del rref
            gc.collect()
            stored.set()  # w1 shuts down; w2 has not yet
            # Give a premature release by w1 time to free the value here, then let w2 call.
            deadline = time.monotonic() + 2.0
            while freed() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            go.set()
            try:
                outcome = results.get(timeout=60)
            except queue.Empty:
                outcome = "w2 reported nothing"
        finally:
            shutdown(graceful=True, timeout=60.0)
    assert outcome == "ok"
    assert freed() is None, "the value outlived every reference to it"
