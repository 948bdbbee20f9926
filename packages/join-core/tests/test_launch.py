"""python -m join_core.launch: the survivor agent keeps the other workers
running when one is lost, never restarts, and exits with 0 only when the
survivors all succeed. Real agents and workers on 127.0.0.1, ports picked by
the OS, and nothing left running."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from join_core.launch import parse_args
from join_core.testing import LaunchExit, run_launch, start_launch

# torch's stubs do not re-export the store class it documents publicly.
TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]

WORKER = Path(__file__).resolve().parent / "launch_worker.py"
TIMEOUT = 60.0

pytestmark = pytest.mark.timeout(90)


def _report(run: LaunchExit) -> str:
    return f"exit {run.returncode}\n{run.output}"


def _clean(run: LaunchExit) -> None:
    assert run.worker_pids, _report(run)
    assert not run.leaked, f"processes left running: {run.leaked}\n{_report(run)}"


def test_survivors_of_a_killed_worker_finish_and_the_agent_exits_with_0() -> None:
    run = run_launch(WORKER, 3, "--kill", "2", timeout=TIMEOUT)
    assert run.returncode == 0, _report(run)
    assert re.search(
        r"worker rank 2 \(local rank 2 on .*\): lost: killed by SIGKILL while 2 other", run.output
    )
    assert "rank 0: store ok" in run.output and "rank 1: store ok" in run.output, _report(run)
    assert "job succeeded: 2 of 3 workers finished; 1 lost" in run.output, _report(run)
    assert "Stopping worker group" not in run.output and "restart" not in run.output.lower(), _report(run)
    _clean(run)


def test_losing_rank_0s_worker_loses_no_store() -> None:
    # The survivors connect to the store after rank 0's worker died: the agent serves it.
    run = run_launch(WORKER, 3, "--kill", "0", "--sleep", "1.5", timeout=TIMEOUT)
    assert run.returncode == 0, _report(run)
    assert "rank 1: store ok" in run.output and "rank 2: store ok" in run.output, _report(run)
    assert re.search(r"rank 0 \(.*\): lost: killed by SIGKILL", run.output), _report(run)
    _clean(run)


def test_a_worker_raising_while_others_run_is_lost_with_its_error() -> None:
    run = run_launch(WORKER, 2, "--raise", "1", timeout=TIMEOUT)
    assert run.returncode == 0, _report(run)
    lost = r"rank 1 \(.*\): lost: exited with code 1 \(ValueError: rank 1 was told to fail\) while 1 other"
    assert re.search(lost, run.output), _report(run)
    _clean(run)


def test_the_agents_log_directory_goes_with_the_job(tmp_path: Path) -> None:
    # The workers' error files live there: the error still reaches the summary.
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    run = run_launch(WORKER, 2, "--raise", "1", timeout=TIMEOUT, env={"TMPDIR": str(temporary)})
    assert "ValueError: rank 1 was told to fail" in run.output, _report(run)
    assert list(temporary.iterdir()) == [], _report(run)


def test_a_log_directory_asked_for_is_kept(tmp_path: Path) -> None:
    temporary, kept = tmp_path / "tmp", tmp_path / "logs"
    temporary.mkdir()
    run = run_launch(
        WORKER,
        2,
        "--raise",
        "1",
        launch_args=["--log-dir", str(kept)],
        timeout=TIMEOUT,
        env={"TMPDIR": str(temporary)},
    )
    assert "ValueError: rank 1 was told to fail" in run.output, _report(run)
    assert list(temporary.iterdir()) == [] and list(kept.rglob("error.json")), _report(run)


def test_a_worker_failing_after_another_finished_fails_the_job() -> None:
    run = run_launch(WORKER, 3, "--exit", "1:1", "--exit-after", "3", "--sleep", "0", timeout=TIMEOUT)
    assert run.returncode == 1, _report(run)
    assert re.search(
        r"rank 1 \(.*\): failed: exited with code 1 after 2 worker\(s\) had finished", run.output
    )
    assert "job failed" in run.output, _report(run)
    _clean(run)


def test_when_every_worker_fails_the_job_fails_with_a_summary() -> None:
    run = run_launch(WORKER, 2, "--exit", "4:0", "--exit", "5:1", "--exit-after", "0.5", timeout=TIMEOUT)
    assert run.returncode == 1, _report(run)
    assert "job failed: no worker of 2 finished" in run.output, _report(run)
    assert "exited with code 4" in run.output and "exited with code 5" in run.output, _report(run)
    assert "the last worker running" in run.output, _report(run)
    _clean(run)


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--max-restarts", "1"], "--max-restarts 1: the surviving workers go on instead of restarting"),
        (["--nnodes", "1:2"], "--nnodes 1:2: the group is never re-formed"),
        (["--run-path"], "--run-path: the agent watches each worker's process"),
        (["--agent-timeout", "1"], "--agent-timeout 1: agents beat every 1 s; pass at least 3"),
    ],
)
def test_arguments_that_would_restart_or_reform_the_group_are_refused(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args([*argv, "train.py"])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def _job_store() -> Any:
    """The rendezvous store of a job on two "hosts", served here (as by a host of its own)."""
    return TCPStore(
        "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False
    )


def _two_nodes(store: Any, *extra: str) -> list[str]:
    return [
        "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
        "--rdzv-conf", "is_host=0", "--rdzv-id", "two-nodes", *extra,
    ]  # fmt: skip


@pytest.mark.slow(
    reason="two launchers whose workers import torch: about 9 s alone, past 30 s beside the other test lanes"
)
def test_two_agents_of_one_job_go_on_without_a_lost_worker_and_agree() -> None:
    store = _job_store()
    nodes = _two_nodes(store)
    with (
        start_launch(WORKER, 2, "--kill", "3", launch_args=nodes) as first,
        start_launch(WORKER, 2, "--kill", "3", launch_args=nodes) as second,
    ):
        runs = [first.wait(TIMEOUT), second.wait(TIMEOUT)]
    for run in runs:
        assert run.returncode == 0, _report(run)
        assert "job succeeded: 3 of 4 workers finished; 1 lost" in run.output, _report(run)
        assert re.search(r"rank 3 \(.*\): lost: killed by SIGKILL while 3 other", run.output), _report(run)
        _clean(run)
    assert sum("the agent keeps the others running" in run.output for run in runs) == 1


@pytest.mark.slow(
    reason="two launchers whose workers import torch; the survivor's agent waits out the silent agent's timeout while its worker sleeps 10 s (about 40 s)"
)
def test_an_agent_that_goes_silent_has_its_workers_counted_lost(tmp_path: Path) -> None:
    store = _job_store()
    nodes = _two_nodes(store, "--agent-timeout", "3")
    # The survivor still sleeps when its agent finds the other silent, however loaded the host.
    args = ("--sleep", "10", "--pid-dir", str(tmp_path))
    with (
        start_launch(WORKER, 1, *args, launch_args=nodes) as first,
        start_launch(WORKER, 1, *args, launch_args=nodes) as second,
    ):
        deadline = time.monotonic() + TIMEOUT
        while len(list(tmp_path.glob("rank-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        # The agent of rank 1 (group rank 1: rank 0's agent serves the workers' store) goes down
        # with its worker, as with its host.
        pid, agent_pid = map(int, (tmp_path / "rank-1").read_text().split())
        down, up = (first, second) if first.pid == agent_pid else (second, first)
        os.kill(agent_pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        run = up.wait(TIMEOUT)
        down.wait(1.0)
    assert run.returncode == 0, _report(run)
    assert "the agent of group rank 1 has not answered" in run.output, _report(run)
    assert re.search(r"rank 1 \(.*\): lost: its agent stopped answering", run.output), _report(run)
    assert "rank 0: store ok" in run.output, _report(run)
    _clean(run)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_the_workers_of_a_killed_agent_end_with_it(tmp_path: Path) -> None:
    # torch's launcher starts workers in sessions of their own: a SIGKILLed agent would leave them
    # training beside survivors that count them lost.
    with start_launch(WORKER, 2, "--sleep", "60", "--pid-dir", str(tmp_path)) as agent:
        deadline = time.monotonic() + TIMEOUT
        while len(list(tmp_path.glob("rank-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(path.read_text().split()[0]) for path in sorted(tmp_path.glob("rank-*"))]
        assert len(workers) == 2 and all(_running(pid) for pid in workers)
        os.kill(agent.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = [pid for pid in workers if _running(pid)]
        run = agent.wait(5.0)
    assert running == [], f"workers outlived their agent: {running}\n{_report(run)}"


if sys.platform != "linux":  # the tests count the workers through /proc
    pytestmark = [pytestmark, pytest.mark.skip(reason="needs Linux's /proc")]
