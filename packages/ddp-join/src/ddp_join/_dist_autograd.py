"""Whether this thread runs a pass of a distributed autograd backward.

rpc-registry's ``dist_autograd.backward`` computes gradients for its context,
not into ``.grad``, so ``AccumulateGrad``'s hooks never run; DDP reduces
those gradients instead (as torch's reducer does under distributed autograd).
Asked through rpc-registry's public ``rpc_registry.autograd.running_backward``,
looked up among the loaded modules: when rpc-registry was never imported no
such backward can run, and ddp-join does not depend on it.
"""

from __future__ import annotations

import sys
from typing import Final

_MODULE: Final = "rpc_registry.autograd"


def distributed_backward_running() -> bool:
    """Whether a distributed autograd backward pass runs on this thread now."""
    module = sys.modules.get(_MODULE)
    probe = getattr(module, "running_backward", None)
    return callable(probe) and probe() is not None


def distributed_autograd_loaded() -> bool:
    """Whether rpc-registry's distributed autograd is imported (none can run before)."""
    return _MODULE in sys.modules
