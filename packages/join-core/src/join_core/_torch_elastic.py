"""What the survivor agent reads of ``torch.distributed.elastic`` beyond its
public names: the one place to update if torch changes them
(``tests/test_torch_elastic_internals.py`` fails loudly if it does).

Why: ``LocalElasticAgent`` keeps its workers in a ``PContext`` whose only
public way to learn of an ended worker, ``wait()``, stops every other worker
first ("all or nothing"). To let the others go on, the agent polls each
worker's process itself, which torch offers no public name for: the context
is the agent's ``_pcontext``, and a script's workers are the ``proc``
(``subprocess.Popen``) of each of its ``subprocess_handlers``.
"""

from __future__ import annotations

import subprocess
from typing import Final

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext

__all__ = ["TorchElasticChangedError", "worker_error_file", "worker_processes"]

#: LocalElasticAgent's attribute holding the PContext of the running workers.
_CONTEXT_ATTRIBUTE: Final = "_pcontext"


class TorchElasticChangedError(RuntimeError):
    """torch.distributed.elastic no longer has what the survivor agent reads."""

    def __init__(self, what: str) -> None:
        import torch

        super().__init__(
            f"join_core.launch: torch {torch.__version__} changed {what}, which the survivor agent reads "
            "to watch each worker on its own; update join_core/_torch_elastic.py, or launch with torchrun "
            "(whose agent stops every worker when one fails)"
        )


def _context(agent: LocalElasticAgent) -> SubprocessContext | None:
    try:
        context: object = getattr(agent, _CONTEXT_ATTRIBUTE)
    except AttributeError:
        raise TorchElasticChangedError(f"LocalElasticAgent.{_CONTEXT_ATTRIBUTE}") from None
    if context is None:
        return None  # no workers started yet
    if not isinstance(context, SubprocessContext):
        raise TypeError(
            f"join_core.launch: the workers run as {type(context).__name__}, not as processes of a script "
            "or binary; launch a script (not --run-path, not a function entrypoint)"
        )
    return context


def worker_processes(agent: LocalElasticAgent) -> dict[int, subprocess.Popen[bytes]]:
    """Each local worker's process, by local rank ({} before the workers start)."""
    context = _context(agent)
    if context is None:
        return {}
    handlers: object = getattr(context, "subprocess_handlers", None)
    if not isinstance(handlers, dict):
        raise TorchElasticChangedError("SubprocessContext.subprocess_handlers")
    processes = {}
    for local_rank, handler in handlers.items():
        proc: object = getattr(handler, "proc", None)
        if not isinstance(proc, subprocess.Popen):
            raise TorchElasticChangedError("SubprocessHandler.proc")
        processes[int(local_rank)] = proc
    return processes


def worker_error_file(agent: LocalElasticAgent, local_rank: int) -> str:
    """Where a worker decorated with torch's ``@record`` writes its error ("" if unknown)."""
    context = _context(agent)
    files: object = getattr(context, "error_files", None)
    if not isinstance(files, dict):
        return ""
    return str(files.get(local_rank, ""))
