"""What the survivor agent reads of torch.distributed.elastic beyond its
public names (join_core/_torch_elastic.py) is still there: these fail first,
and by name, when torch changes it."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, start_processes
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

from join_core._torch_elastic import TorchElasticChangedError, worker_error_file, worker_processes
from join_core.survivor_agent import SurvivorAgent

pytestmark = pytest.mark.timeout(60)


def _spec() -> WorkerSpec:
    # Made without connecting anywhere: the rendezvous runs only in agent.run().
    rendezvous = StaticTCPRendezvous("127.0.0.1", 0, rank=0, world_size=1, run_id="internals", timeout=10)
    return WorkerSpec(
        role="trainer", local_world_size=1, rdzv_handler=rendezvous, entrypoint=sys.executable, max_restarts=0
    )


def _context(tmp_path: Path) -> PContext:
    """The workers' context as LocalElasticAgent starts it, for one worker that ends at once."""
    return start_processes(
        name="trainer",
        entrypoint=sys.executable,
        args={0: ("-c", "pass")},
        envs={0: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
    )


def test_the_agent_keeps_its_workers_context_under_the_name_read() -> None:
    agent = SurvivorAgent(_spec(), DefaultLogsSpecs())
    assert worker_processes(agent) == {}  # the attribute exists, and holds no workers before they start


def test_a_script_workers_context_holds_a_process_and_an_error_file_per_worker(tmp_path: Path) -> None:
    agent = SurvivorAgent(_spec(), DefaultLogsSpecs())
    context = _context(tmp_path)
    try:
        agent._pcontext = context  # what LocalElasticAgent._start_workers does
        processes = worker_processes(agent)
        assert list(processes) == [0]
        assert isinstance(processes[0], subprocess.Popen)
        assert processes[0].wait(timeout=30) == 0
        assert worker_error_file(agent, 0).endswith("error.json")
    finally:
        context.close()


def test_the_agent_starts_its_workers_into_the_attribute_read() -> None:
    # LocalElasticAgent._start_workers must still store the context where it is read.
    source = inspect.getsource(LocalElasticAgent._start_workers)
    assert "self._pcontext = start_processes(" in source, (
        "LocalElasticAgent._start_workers no longer sets self._pcontext: update join_core/_torch_elastic.py"
    )


def test_a_missing_attribute_fails_naming_what_changed() -> None:
    class Stranger(LocalElasticAgent):
        def __init__(self) -> None:  # no LocalElasticAgent.__init__: no _pcontext
            pass

    with pytest.raises(TorchElasticChangedError, match=r"LocalElasticAgent\._pcontext.*_torch_elastic\.py"):
        worker_processes(Stranger())
