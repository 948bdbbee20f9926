"""A grace period at interpreter exit for the threads of torch's process groups.

A gloo worker thread that finishes a collective drops its reference to the
operation, and with it to the tensors the caller passed. When that is the
last C++ reference to a tensor Python has seen, freeing it needs the GIL.
If the main thread reaches interpreter finalization first (a script whose
last lines follow a collective while a model still holds the process group,
as FSDP2's does, so ``destroy_process_group()`` does not join the threads),
the worker is ended while it waits for the GIL and the process aborts with
"terminate called without an active exception" after its last line: up
to one run in four of a short FSDP2 script on two ranks
(pytorch/pytorch#190489, and the ``atexit`` proposals in torch's pull
requests 157193 and 179291).

Releasing the GIL once at exit, while the interpreter is still whole, lets
such a thread take it and finish. The release is registered once per
process, not at import: the first time a :class:`join_core.Join` is built,
one of ddp-join's entry points (``DistributedDataParallel``,
``ZeroRedundancyOptimizer``, ``FSDPJoinable``), which hold a process group
without a Join, or ``rpc_registry.init_rpc``.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import Final

#: How long the main thread leaves the GIL to other threads at exit. A waiting
#: thread needs well under a millisecond; the rest is room for a busy scheduler.
EXIT_GRACE_S: Final = 0.02

_lock = threading.Lock()
_installed = False


def _release_gil() -> None:
    time.sleep(EXIT_GRACE_S)


def install_exit_grace() -> None:
    """Leave the GIL to other threads for :data:`EXIT_GRACE_S` at interpreter
    exit, so that torch's process-group threads free the tensors of finished
    collectives before Python finalizes. Idempotent; :class:`join_core.Join`
    calls it, and scripts that use ``torch.distributed`` without a Join may
    call it too::

        import join_core

        join_core.install_exit_grace()
    """
    global _installed
    with _lock:
        if not _installed:
            atexit.register(_release_gil)
            _installed = True
