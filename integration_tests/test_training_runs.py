"""Full training runs composing join-core, ddp-join, rpc-registry and
tensorpipe-backend, each on 2 to 4 local ranks started by launch.py."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import launch, session_alive
from train_dist_autograd import reference as dist_autograd_reference
from train_fsdp import EVAL_SAMPLES, evaluate_single_process
from train_param_server import reference as param_server_reference
from training_common import make_model, read_results, reference_dense

HERE = Path(__file__).resolve().parent

DEVICES = pytest.mark.parametrize(
    "device,backend",
    [
        pytest.param("cpu", "gloo", id="cpu-gloo"),
        pytest.param(
            "cuda",
            "gloo",
            id="cuda-gloo",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
        pytest.param(
            "cuda",
            "nccl",
            id="cuda-nccl",
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices"),
        ),
    ],
)


def _ranks(backend: str, wanted: int) -> int:
    return min(wanted, torch.cuda.device_count()) if backend == "nccl" else wanted


def _run(script: str, nproc: int, args: list[str], timeout: float = 240.0) -> None:
    exits = launch(HERE / script, nproc, args, timeout=timeout)
    failed = [e for e in exits if e.returncode != 0]
    assert not failed, "\n".join(f"--- rank {e.rank} (exit {e.returncode}) ---\n{e.output}" for e in failed)


@DEVICES
def test_coordinated_uneven_data_matches_single_process_reference(
    device: str, backend: str, tmp_path: Path
) -> None:
    nproc = _ranks(backend, 3)
    _run(
        "train_coordinated.py",
        nproc,
        ["--device", device, "--backend", backend, "--result-dir", str(tmp_path)],
    )
    results = read_results(tmp_path, nproc)
    counts = [len(r["batches"]) for r in results]
    assert len(set(counts)) == nproc, f"ranks should end with different batch counts, got {counts}"
    for other in results[1:]:
        assert torch.equal(results[0]["params"], other["params"])
    expected = reference_dense([r["batches"] for r in results], lambda ps: torch.optim.Adam(ps, lr=0.02))
    torch.testing.assert_close(results[0]["params"], expected, rtol=1e-5, atol=1e-6)
    losses = [loss for r in results for loss in r["losses"]]
    first = sum(r["losses"][0] for r in results) / nproc
    last = sum(r["losses"][-1] for r in results) / nproc
    assert last < first, f"loss did not fall: {first:.4f} -> {last:.4f} ({losses})"


@DEVICES
def test_parameter_server_with_ddp_matches_single_process_reference(
    device: str, backend: str, tmp_path: Path
) -> None:
    nproc = _ranks(backend, 3)
    base, extra = 3, 2
    args = ["--device", device, "--backend", backend, "--base", str(base), "--extra", str(extra)]
    _run("train_param_server.py", nproc, [*args, "--result-dir", str(tmp_path)])
    results = read_results(tmp_path, nproc)
    assert [r["steps"] for r in results] == [base + r * extra for r in range(nproc)]
    for other in results[1:]:
        assert torch.equal(results[0]["dense"], other["dense"])
        assert torch.equal(results[0]["table"], other["table"])
    dense, table = param_server_reference(nproc, base, extra)
    torch.testing.assert_close(results[0]["dense"], dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0]["table"], table, rtol=1e-5, atol=1e-6)


@DEVICES
def test_a_rank_failing_inside_join_stops_every_rank(device: str, backend: str) -> None:
    nproc = _ranks(backend, 3)
    fail_rank = 1
    exits = launch(
        HERE / "train_failure.py",
        nproc,
        ["--device", device, "--backend", backend, "--fail-rank", str(fail_rank)],
        timeout=120.0,
    )
    for e in exits:
        assert e.returncode == 1, f"rank {e.rank} exit {e.returncode}\n{e.output}"
        assert e.seconds < 30, f"rank {e.rank} took {e.seconds:.0f} s"
    assert "ValueError: corrupt batch at step 2" in exits[fail_rank].output
    for e in exits:
        if e.rank != fail_rank:
            assert f"JoinAbortedError: Join aborted: rank {fail_rank} raised ValueError" in e.output, e.output
    # Each rank ran in its own session: nothing of any is left.
    assert not any(session_alive(e.pid) for e in exits)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(
            "freeze",
            marks=pytest.mark.slow(
                reason="the launcher kills the frozen rank only 15 s after the survivors exit (about 30 s)"
            ),
        ),
        "kill",
    ],
)
def test_a_rank_lost_inside_join_is_named_by_every_rank_within_seconds(how: str) -> None:
    lost = 1
    exits = launch(
        HERE / "train_failure.py",
        3,
        ["--fail-rank", str(lost), "--how", how, "--base", "1000"],
        timeout=120.0,
        grace=15.0,  # after the first exit; then a frozen rank is killed
    )
    assert exits[lost].returncode == -9, f"rank {lost} exit {exits[lost].returncode}\n{exits[lost].output}"
    for e in exits:
        if e.rank == lost:
            continue
        assert e.returncode == 1, f"rank {e.rank} exit {e.returncode}\n{e.output}"
        assert f"RankLostError: Join aborted: lost rank {lost} (no heartbeat for " in e.output, e.output
        told = re.search(r"told ([0-9.]+) s after the last step", e.output)
        assert told is not None and float(told.group(1)) < 10, e.output
    assert not any(session_alive(e.pid) for e in exits)


@DEVICES
def test_fsdp_uneven_training_then_exact_evaluation(device: str, backend: str, tmp_path: Path) -> None:
    nproc = _ranks(backend, 3)
    base, extra = 3, 2
    args = ["--device", device, "--backend", backend, "--base", str(base), "--extra", str(extra)]
    _run("train_fsdp.py", nproc, [*args, "--result-dir", str(tmp_path)])
    results = read_results(tmp_path, nproc)
    assert [len(r["batches"]) for r in results] == [base + r * extra for r in range(nproc)]
    for other in results[1:]:
        assert torch.equal(results[0]["params"], other["params"])
    expected = reference_dense([r["batches"] for r in results], lambda ps: torch.optim.Adam(ps, lr=0.02))
    torch.testing.assert_close(results[0]["params"], expected, rtol=1e-5, atol=1e-6)
    # Exact evaluation: each sample on one rank, uneven shares, the single-process metric.
    assert sum(r["eval_local"] for r in results) == EVAL_SAMPLES
    assert len({r["eval_local"] for r in results}) > 1 or nproc == 1
    model = make_model()
    torch.nn.utils.vector_to_parameters(results[0]["params"], model.parameters())
    expected_sum, expected_count = evaluate_single_process(model)
    for result in results:
        assert result["eval_count"] == expected_count
        assert result["eval_sum"] == pytest.approx(expected_sum, rel=1e-6)


@DEVICES
def test_parameter_server_with_distributed_autograd_matches_single_process_reference(
    device: str, backend: str, tmp_path: Path
) -> None:
    nproc = _ranks(backend, 3)
    base, extra = 3, 2
    args = ["--device", device, "--backend", backend, "--base", str(base), "--extra", str(extra)]
    _run("train_dist_autograd.py", nproc, [*args, "--result-dir", str(tmp_path)])
    results = read_results(tmp_path, nproc)
    trainers = results[1:]
    assert [r["steps"] for r in trainers] == [base + i * extra for i in range(nproc - 1)]
    for other in trainers[1:]:
        assert torch.equal(trainers[0]["dense"], other["dense"])
    server, dense = dist_autograd_reference(nproc, base, extra)
    torch.testing.assert_close(results[0]["server"], server, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(trainers[0]["dense"], dense, rtol=1e-5, atol=1e-6)
    longest = trainers[-1]["losses"]
    assert longest[-1] < longest[0], f"loss did not fall: {longest}"


def test_ddp_rpc_example_trainers_end_with_identical_ddp_parameters(tmp_path: Path) -> None:
    _run("train_ddp_rpc.py", 4, ["--result-dir", str(tmp_path)])
    with open(tmp_path / "rank2.pkl", "rb") as f:
        first, second = pickle.load(f)["trainers"]
    torch.manual_seed(0)
    initial = torch.cat([p.detach().reshape(-1) for p in torch.nn.Linear(16, 8).parameters()])
    assert not torch.equal(first, initial), "the trainers' Linear did not train"
    assert torch.equal(first, second), (
        f"the trainers' DDP replicas differ by up to {(first - second).abs().max()}"
    )


@pytest.mark.parametrize(
    "script",
    [
        "train_coordinated.py",
        "train_dist_autograd.py",
        "train_failure.py",
        "train_fsdp.py",
        "train_param_server.py",
    ],
)
def test_a_script_run_without_torchruns_environment_says_what_to_set_in_one_paragraph(script: str) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    result = subprocess.run(
        [sys.executable, str(HERE / script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert result.stdout == ""
    [paragraph] = result.stderr.splitlines()
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set" in paragraph
    assert "torchrun --nproc-per-node 2 " in paragraph and "launch.py" in paragraph


@DEVICES
def test_survivors_of_a_killed_rank_finish_the_epoch_exactly(
    device: str, backend: str, tmp_path: Path
) -> None:
    _survivors_run(device, backend, tmp_path, [])


def test_survivors_call_each_other_by_rpc_after_a_loss(tmp_path: Path) -> None:
    _survivors_run("cpu", "gloo", tmp_path, ["--rpc"])


def _survivors_run(device: str, backend: str, tmp_path: Path, extra: list[str]) -> None:
    nproc = _ranks(backend, 3)
    lost = nproc - 2
    args = [
        "--device",
        device,
        "--backend",
        backend,
        "--lose-rank",
        f"{lost}@4",
        "--result-dir",
        str(tmp_path),
    ]
    exits = launch(HERE / "train_survivors.py", nproc, args + extra, timeout=120.0, grace=120.0)
    wrong = [e for e in exits if (e.returncode != -9) == (e.rank == lost)]
    assert not wrong, "\n".join(f"--- rank {e.rank} (exit {e.returncode}) ---\n{e.output}" for e in wrong)
    survivors = [rank for rank in range(nproc) if rank != lost]
    results = {}
    for rank in survivors:
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            results[rank] = pickle.load(f)
    first = results[survivors[0]]
    assert list(first["lost"]) == [lost] and len(first["lost"][lost]) == 4
    trained = [first["lost"][lost] if rank == lost else results[rank]["batches"] for rank in range(nproc)]
    assert sorted(b for batches in trained for b in batches) == list(range(30))  # each batch once
    for rank in survivors[1:]:
        assert torch.equal(results[rank]["params"], first["params"])
    expected = reference_dense(trained, lambda ps: torch.optim.Adam(ps, lr=0.02))
    torch.testing.assert_close(first["params"], expected, rtol=1e-5, atol=1e-6)
