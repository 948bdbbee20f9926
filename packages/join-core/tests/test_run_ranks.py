"""run_ranks tells how each rank that gave no result ended."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from join_core.testing import RanksFailedError, run_ranks, run_script


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_a_rank_that_exits_without_a_result_is_told_by_its_exit_code() -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_exit_on_rank_one, 2, timeout=60)
    assert failed.value.failures == {1: "exited with code 3 before reporting a result"}


def test_run_script_gives_each_rank_torchruns_environment_and_tells_how_it_ended(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], sys.argv[1])\n"
        "sys.exit(int(os.environ['RANK']) * 3)\n"
    )
    ended = run_script(script, 2, "arg", timeout=60)
    assert [(e.rank, e.returncode, e.output) for e in ended] == [
        (0, 0, "0 2 127.0.0.1 arg\n"),
        (1, 3, "1 2 127.0.0.1 arg\n"),
    ]


def _first_optimizer_seconds(rank: int, world_size: int) -> tuple[bool, float]:
    compiler_loaded = "torch._dynamo" in sys.modules
    start = time.process_time()
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return compiler_loaded, time.process_time() - start


def test_ranks_start_with_what_a_first_optimizer_imports_already_loaded() -> None:
    # torch imports torch._dynamo (about a second of CPU) when a process makes
    # its first optimizer: the fork server loads it once for every rank.
    for compiler_loaded, seconds in run_ranks(_first_optimizer_seconds, 2, timeout=60):
        assert compiler_loaded, (
            f"the first optimizer imported torch's compiler in the rank ({seconds:.2f} s of CPU)"
        )


_RANKS_OF_A_MODULE_ON_SYS_PATH = """
import os, sys
sys.path.insert(0, sys.argv[1])  # as pytest puts a test's folder there, not in PYTHONPATH
import ranks_module
from join_core.testing import run_ranks
print(run_ranks(ranks_module.imported_by_this_rank, 2, timeout=90))
"""


@pytest.mark.skipif(
    torch.backends.cuda.is_built(), reason="with CUDA built, the fork server imports torch alone (by design)"
)
def test_ranks_fork_with_the_module_of_their_function_imported_even_when_only_sys_path_finds_it(
    tmp_path: Path,
) -> None:
    # Every rank imported it again (with what it imports: Lightning costs a second of CPU).
    (tmp_path / "ranks_module.py").write_text(
        "import os\n"
        "IMPORTED_BY = os.getpid()\n"
        "def imported_by_this_rank(rank: int, world_size: int) -> bool:\n"
        "    return IMPORTED_BY == os.getpid()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ran = subprocess.run(
        [sys.executable, "-c", _RANKS_OF_A_MODULE_ON_SYS_PATH, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[-2] == "[False, False]"
