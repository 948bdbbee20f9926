"""Launch a training script as torchrun does, with an agent that keeps the
surviving workers running when one is lost.

    python -m join_core.launch --nproc-per-node 4 train.py [ARGS...]
    # on each of 2 hosts:
    python -m join_core.launch --nnodes 2 --nproc-per-node 4 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id JOB train.py [ARGS...]

It takes torchrun's arguments (``torch.distributed.run``'s parser) and runs
torch.distributed.elastic's rendezvous and local agent, with the policy of
:class:`join_core.survivor_agent.SurvivorAgent`: a worker that dies while
others run is logged as lost and the others go on (for scripts that use
``Join(on_rank_lost="continue")``); nothing is restarted; every agent exits
with 0 when the survivors all succeed, and otherwise with a non-zero code
after a summary of every rank. The workers use the agent's store
(``TORCHELASTIC_USE_AGENT_STORE``), so losing rank 0's worker loses no store.

On Linux the workers end with their agent: each gets SIGTERM when the
agent's process ends, however it ended (torchrun's workers, in sessions of
their own, outlive a killed agent and go on training beside survivors that
count them lost). A tiny Python program sets the parent-death signal and
then executes the worker's own command line.

Without ``--log-dir`` (nor ``--redirects``, ``--tee`` or ``--logs-specs``), the
agent's log directory holds only the workers' error files, and is removed
with the job.

Not supported, as they would stop or re-form the group: ``--max-restarts``
above 0, a range of nodes (``--nnodes 1:4``), ``--run-path``, and
rendezvous backends whose store the workers do not share.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Final

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.metrics.api import MetricsConfig
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from join_core.agent_ledger import BEAT_INTERVAL
from join_core.survivor_agent import DEFAULT_AGENT_TIMEOUT, JobOutcome, SurvivorAgent, SurvivorRendezvous

__all__ = ["launch", "main", "parse_args"]

PROG: Final = "python -m join_core.launch"
#: WorkerSpec's fields that launch() sets itself rather than copies from the LaunchConfig.
_SET_HERE: Final = frozenset(
    {
        "local_world_size",
        "entrypoint",
        "fn",
        "args",
        "rdzv_handler",
        "max_restarts",
        "master_addr",
        "master_port",
    }
)


# Run as ``python -S -c _END_WITH_AGENT AGENT_PID PROGRAM ARGS...``: PR_SET_PDEATHSIG (1) with
# SIGTERM, which execve keeps; a worker whose agent ended before that exits at once. Where the
# signal cannot be set, the worker runs all the same and says so.
_END_WITH_AGENT: Final = """\
import os, sys
try:
    import ctypes, signal
    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
except Exception as exc:
    print(f"join_core.launch: this worker may outlive its agent: {exc}", file=sys.stderr)
if os.getppid() != int(sys.argv[1]):
    sys.exit("join_core.launch: the agent ended before its worker started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _ending_with_this_agent(entrypoint: str, args: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """The command line that runs ``entrypoint args`` as a worker that gets SIGTERM when this
    process (its agent) ends; unchanged where the parent-death signal does not exist."""
    if not sys.platform.startswith("linux"):
        return entrypoint, tuple(args)
    return sys.executable, ("-S", "-c", _END_WITH_AGENT, str(os.getpid()), entrypoint, *args)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """torchrun's arguments, plus ``--agent-timeout``; exits (code 2) naming
    an argument this launcher cannot honour and what to pass instead."""
    parser = get_args_parser()
    parser.prog = PROG
    parser.description = (
        "torchrun whose agent keeps the surviving workers running when a worker is lost "
        "(for scripts using join_core.Join(on_rank_lost='continue'))."
    )
    parser.add_argument(
        "--agent-timeout",
        "--agent_timeout",
        type=float,
        default=DEFAULT_AGENT_TIMEOUT,
        help="Seconds another host's agent may stay silent in the rendezvous store before its "
        f"unfinished workers count as lost (default {DEFAULT_AGENT_TIMEOUT:g}).",
    )
    args = parser.parse_args(argv)
    if args.max_restarts != 0:
        parser.error(
            f"--max-restarts {args.max_restarts}: the surviving workers go on instead of restarting; "
            "pass --max-restarts 0 (the default), or use torchrun to restart the whole group"
        )
    if getattr(args, "run_path", False):
        parser.error(
            "--run-path: the agent watches each worker's process; launch the script as a process "
            "(leave --run-path out)"
        )
    if args.agent_timeout < 3 * BEAT_INTERVAL:
        parser.error(
            f"--agent-timeout {args.agent_timeout:g}: agents beat every {BEAT_INTERVAL:g} s; "
            f"pass at least {3 * BEAT_INTERVAL:g}"
        )
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if min_nodes != max_nodes:
        parser.error(
            f"--nnodes {args.nnodes}: the group is never re-formed while workers run, so nodes cannot "
            f"join later; pass a number of nodes (--nnodes {max_nodes})"
        )
    # torchrun's own defaults (torch.distributed.run.run): a local c10d rendezvous for one node.
    if args.standalone or (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and max_nodes == 1
    ):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    return args


def launch(
    config: LaunchConfig,
    entrypoint: str,
    args: Sequence[str],
    agent_timeout: float = DEFAULT_AGENT_TIMEOUT,
) -> JobOutcome:
    """Run the workers of this node under a :class:`SurvivorAgent` until the
    whole job ends (as ``torch.distributed.launcher.api.launch_agent`` does with
    torch's agent), and return how every worker of the job ended.

    Args:
        config: torchrun's launch configuration; ``max_restarts`` must be 0.
        entrypoint: the program each worker runs (e.g. ``sys.executable``).
        args: its arguments (e.g. ``["-u", "train.py", "--epochs", "3"]``).
        agent_timeout: see :class:`SurvivorAgent`.

    Raises:
        ValueError: the rendezvous backend does not share its store with the workers.
        SignalException: the agent got a termination signal (its workers were stopped).
    """
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr: str | None = None
    master_port: int | None = None
    if config.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    signals = getattr(config, "signals_to_handle", None)  # torch 2.10 lacks it
    if signals is not None:
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals  # read by the agent, as torchrun sets it
    handler = get_rendezvous_handler(params)
    if not handler.use_agent_store:
        handler.shutdown()
        raise ValueError(
            f"--rdzv-backend {config.rdzv_backend}: its store is not shared with the workers "
            "(TORCHELASTIC_USE_AGENT_STORE would be False, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set), "
            "so rank 0's worker would serve the store and its loss could not be survived; use "
            "--rdzv-backend c10d (or static), and unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
        )
    # The fields torchrun copies from its config to the workers' spec, as far as this torch has them.
    spec_fields = {field.name for field in dataclasses.fields(WorkerSpec)}
    copied = {
        field.name: getattr(config, field.name)
        for field in dataclasses.fields(LaunchConfig)
        if field.name in spec_fields and field.name not in _SET_HERE
    }
    program, program_args = _ending_with_this_agent(entrypoint, args)
    spec = WorkerSpec(
        **copied,
        local_world_size=config.nproc_per_node,
        entrypoint=program,
        args=program_args,
        rdzv_handler=SurvivorRendezvous(handler),
        max_restarts=0,
        master_addr=master_addr,
        master_port=master_port,
    )
    agent_options: dict[str, Any] = {}
    shutdown_timeout = getattr(config, "shutdown_timeout", None)
    if shutdown_timeout is not None and "shutdown_timeout" in inspect.signature(LocalElasticAgent).parameters:
        agent_options["shutdown_timeout"] = shutdown_timeout
    agent = SurvivorAgent(
        spec,
        config.logs_specs if config.logs_specs is not None else DefaultLogsSpecs(),
        config.start_method,
        config.log_line_prefix_template,
        agent_timeout,
        **agent_options,
    )
    shutdown_rendezvous = True
    try:
        metrics.initialize_metrics(MetricsConfig(config.metrics_cfg))
        agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
    except SignalException:
        # As torchrun: a signalled agent leaves the rendezvous open for the others.
        shutdown_rendezvous = False
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rendezvous:
            handler.shutdown()
    if agent.outcome is None:
        raise RuntimeError("join_core.launch: the agent ended without an outcome")
    return agent.outcome


@record
def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m join_core.launch [torchrun's arguments] script [args]``.

    Returns 0 when the job succeeded (the survivors all finished), 1 when it
    failed; the agent has logged a summary of every rank either way."""
    args = parse_args(argv)
    _log_to_stderr()
    with _log_dir_unless_kept(args):
        config, entrypoint, entry_args = config_from_args(args)
        if not isinstance(entrypoint, str):
            raise TypeError(f"join_core.launch: expected a program to run, got {entrypoint!r}")
        outcome = launch(config, entrypoint, entry_args, agent_timeout=args.agent_timeout)
    if outcome.succeeded:
        return 0
    return 1


@contextlib.contextmanager
def _log_dir_unless_kept(args: argparse.Namespace) -> Iterator[None]:
    """Without ``--log-dir``, ``--redirects``, ``--tee`` or ``--logs-specs``, the agent's log
    directory holds only the workers' error files, read when they end: it is made here and removed
    with the job (torchrun leaves a ``torchelastic_*`` directory behind on every run)."""
    kept = (
        args.log_dir is not None
        or args.redirects != "0"
        or args.tee != "0"
        or getattr(args, "logs_specs", None) is not None
    )
    if kept:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="join-core-launch-") as directory:
        args.log_dir = directory
        yield


def _log_to_stderr() -> None:
    """Show this package's log on stderr (the lost workers and the summary),
    unless the application configured logging already."""
    package = logging.getLogger("join_core")
    if package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(message)s"))
    package.addHandler(handler)
    package.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())


if __name__ == "__main__":
    sys.exit(main())
