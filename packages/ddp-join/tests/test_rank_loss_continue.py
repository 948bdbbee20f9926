"""Join(on_rank_lost="continue"): when a rank dies, freezes or is cut off,
the others go on with DDP and end exactly where a single process applying,
at each iteration, the gradients of the ranks active then would end."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ddp_cases import batch, flat_params, loss_fn, make_model, reference
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from ddp_join import (
    DistributedDataParallel,
    FSDPJoinable,
    UnevenDistributedSampler,
    ZeroRedundancyOptimizer,
    allreduce_hook,
)
from join_core import Join, RankLostError, RankRemovedError, spare_connections
from join_core.testing import RanksFailedError, run_ranks

LIVENESS = timedelta(seconds=2)
STEPS = 8
LOST_AT = 3  # the iteration (from 0) in which rank 2 is lost
TINY_BUCKETS_MB = 1e-6  # a bucket per parameter: a loss can fall between two buckets' reductions


def _pids(rank: int, world_size: int) -> list[int]:
    pids = torch.zeros(world_size, dtype=torch.int64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)
    return [int(pid) for pid in pids]


def _lose_rank_2(rank: int, world_size: int, how: str, where: str, hook: bool = False) -> str:
    """Train STEPS iterations; rank 2 is lost in iteration LOST_AT at ``where``
    (``hook``: the gradients reduced by a communication hook, the metadata in
    an all-reduce of its own). Survivors check their parameters against the
    reference and the Join's record."""
    pids = _pids(rank, world_size)
    model = DistributedDataParallel(make_model(), bucket_cap_mb=TINY_BUCKETS_MB)
    if hook:
        model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    lose = signal.SIGSTOP if how == "freeze" else signal.SIGKILL

    def lose_here(spot: str, step: int) -> None:
        if step != LOST_AT:
            return
        if rank == 2 and where.startswith(spot):
            os.kill(os.getpid(), lose)
        if rank != 2 and where == f"{spot}-known":  # the loss is known before the backward's reductions
            time.sleep(2.5 * LIVENESS.total_seconds())

    current = [0]

    def lose_between_buckets(grad: torch.Tensor) -> torch.Tensor:
        lose_here("between-buckets", current[0])
        return grad

    # The first parameter's gradient comes last in backward: later buckets are reduced by then.
    next(model.module.parameters()).register_hook(lose_between_buckets)
    if rank == 1 and where == "step-reduction-one-missed":
        _miss_a_reduction(model, pids[2], current)
    try:
        with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS) as join:
            for step in range(STEPS):
                current[0] = step
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step))
                lose_here("forward", step)
                loss.backward()
                lose_here("step", step)
                optimizer.step()
    except RankRemovedError as removed:
        assert rank == 2, str(removed)
        assert removed.iteration == LOST_AT + 1, str(removed)  # counted from 1
        return "removed"
    finally:
        if rank == 0 and how == "freeze":
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[2], signal.SIGCONT)  # it wakes up: it must be fenced
    assert rank != 2, "the lost rank went on"
    assert list(join.lost_ranks) == [2], join.lost_ranks
    # Found in the iteration of its loss, or (lost after its reduction) the next one; counted from 1.
    removed_in = LOST_AT + 2 if where.startswith("step") else LOST_AT + 1
    assert f"removed at iteration {removed_in}" in join.lost_ranks[2], join.lost_ranks
    assert dist.get_world_size(join.process_group) == 2
    # Its gradients count through the last iteration whose reduction it completed.
    through = LOST_AT if where.startswith("step") else LOST_AT - 1
    expected = reference([STEPS, STEPS, through + 1], lambda p: torch.optim.SGD(p, lr=0.1))
    torch.testing.assert_close(flat_params(model.module), expected, rtol=1e-5, atol=1e-6)
    return "survived"


def _miss_a_reduction(
    model: DistributedDataParallel[torch.nn.Module], lost_pid: int, current: list[int]
) -> None:
    """In iteration LOST_AT, rank 2 dies right after its backward, and this rank
    fails in the last bucket's reduction as if rank 2's part never reached it,
    while rank 0 finished it and goes on into the next iteration."""
    last = model._reducer._buckets[-1]
    finish = last.result
    missed: list[bool] = []

    def result() -> torch.Tensor:
        reduced = finish()
        if current[0] == LOST_AT and not missed:
            missed.append(True)
            _wait_ended(lost_pid)
            raise ConnectionError("rank 2's part of this reduction did not arrive")
        return reduced

    last.result = result  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "where", ["forward", "forward-known", "between-buckets", "step", "step-reduction-one-missed"]
)
def test_survivors_of_a_killed_rank_finish_exactly(where: str) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_lose_rank_2, 3, "kill", where, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)  # the survivors' checks passed
    assert "exited with code -9" in failed.value.failures[2]


def test_survivors_of_a_rank_killed_between_buckets_finish_exactly_with_a_communication_hook() -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_lose_rank_2, 3, "kill", "between-buckets", True, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)
    assert "exited with code -9" in failed.value.failures[2]


def test_survivors_of_a_frozen_rank_finish_exactly_and_fence_it_when_it_wakes() -> None:
    assert run_ranks(_lose_rank_2, 3, "freeze", "forward", timeout=90) == ["survived", "survived", "removed"]


def _two_frozen(rank: int, world_size: int) -> str:
    """Ranks 2 and 3 freeze together in iteration LOST_AT; rank 0 wakes them at the end:
    each must learn when it was removed."""
    pids = _pids(rank, world_size)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS):
            for step in range(STEPS):
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step))
                if rank >= 2 and step == LOST_AT:
                    os.kill(os.getpid(), signal.SIGSTOP)
                loss.backward()
                optimizer.step()
    except RankRemovedError as removed:
        return f"removed at {removed.iteration}"
    finally:
        if rank == 0:
            for frozen in pids[2:]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(frozen, signal.SIGCONT)
    return "survived"


def test_ranks_frozen_together_learn_when_they_were_removed() -> None:
    # The survivors recorded their agreement under both lost ranks; each woken rank looked for it
    # under itself alone and said it was removed "while this rank was away".
    results = run_ranks(_two_frozen, 4, timeout=90)
    assert results == ["survived", "survived", f"removed at {LOST_AT + 1}", f"removed at {LOST_AT + 1}"]


def _recovery_times_out(rank: int, world_size: int) -> str:
    """Rank 2 is killed; rank 1 stays away (alive, outside collectives) longer than the
    survivors' agreement waits for it (shortened to 2 s here)."""
    import join_core.join

    join_core.join.agree = functools.partial(join_core.join.agree, wait=timedelta(seconds=2))  # type: ignore[attr-defined]
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS):
            for step in range(STEPS):
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step))
                if step == LOST_AT and rank == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == LOST_AT and rank == 1:
                    time.sleep(4 * LIVENESS.total_seconds())
                loss.backward()
                optimizer.step()
    except (RankLostError, TimeoutError) as error:
        if rank == 0:  # it waited for rank 1 in the agreement, in vain
            text = str(error)
            assert isinstance(error, RankLostError) and "lost rank 2" in text, text
            assert "Join(on_rank_lost='continue') could not go on without it (TimeoutError: " in text, text
            assert "or pass Join(on_rank_lost='continue')" not in text, text
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_survivors_whose_recovery_fails_are_not_told_to_pass_continue() -> None:
    # The verdict's own advice ("or pass Join(on_rank_lost='continue') to go on without it")
    # reached survivors that had passed it and failed to go on.
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_recovery_times_out, 3, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)


def _survivor_dies_building_the_group(rank: int, world_size: int) -> str:
    """Rank 2 is killed; rank 1 dies after the survivors agreed, as they build their group."""
    import join_core.join

    def die(members: tuple[int, ...], like: dist.ProcessGroup) -> dist.ProcessGroup:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    if rank == 1:
        join_core.join.build_group = die  # type: ignore[attr-defined]
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS):
            for step in range(STEPS):
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step))
                if step == LOST_AT and rank == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                optimizer.step()
    except RankLostError as error:
        text = str(error)
        assert "could not go on without it (TimeoutError: rank(s) [1] fell silent" in text, text
        assert sorted(error.ranks) == [1, 2], error.ranks  # the killed rank and the one that died later
        return "RankLostError"
    raise AssertionError(f"rank {rank} went on without rank 1")


def test_a_survivor_dying_as_the_survivors_build_their_group_fails_the_others_in_seconds() -> None:
    # The others waited for it in new_group for the process group's timeout (here the test's 90 s;
    # by default 30 minutes).
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_survivor_dies_building_the_group, 3, timeout=90)
    assert sorted(failed.value.failures) == [1, 2], str(failed.value)


def _survivor_frozen_building_the_group(rank: int, world_size: int) -> str:
    """Rank 2 is killed; rank 1 freezes as the survivors build their group (longer than the
    liveness timeout) and wakes as rank 0 has given up on it."""
    import subprocess

    import join_core.join

    build = join_core.join.build_group  # type: ignore[attr-defined]

    def freeze_then_build(members: tuple[int, ...], like: dist.ProcessGroup) -> dist.ProcessGroup:
        wake_in = 3 * LIVENESS.total_seconds()
        subprocess.Popen(["sh", "-c", f"sleep {wake_in}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        return build(members, like)  # rank 0's abandoned thread still waits in new_group

    if rank == 1:
        join_core.join.build_group = freeze_then_build  # type: ignore[attr-defined]
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS):
            for step in range(STEPS):
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step))
                if step == LOST_AT and rank == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                optimizer.step()
    except RankLostError as error:
        text = str(error)
        assert "could not go on without it (TimeoutError: rank(s) [1] fell silent" in text, text
        # Rank 0 names the one it gave up on; that one (woken) names only the killed rank.
        assert sorted(error.ranks) == ([1, 2] if rank == 0 else [2]), error.ranks
        return "RankLostError"
    raise AssertionError(f"rank {rank} went on")


def test_a_survivor_that_gives_up_building_the_group_is_followed_by_the_one_it_gave_up_on() -> None:
    # Rank 1, woken, built its group with rank 0's abandoned attempt and went on alone.
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_survivor_frozen_building_the_group, 3, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)


def _uneven_with_losses(
    rank: int,
    world_size: int,
    counts: list[int],
    losses: dict[int, int],
    divide_by_initial: bool,
    views: bool,
) -> list[float]:
    """Rank r trains counts[r] iterations; rank l of ``losses`` is killed in the
    forward of iteration losses[l]. Survivors check against the reference."""
    model = DistributedDataParallel(
        make_model(), bucket_cap_mb=TINY_BUCKETS_MB, gradient_as_bucket_view=views
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join(
        divide_by_initial_world_size=divide_by_initial, liveness_timeout=LIVENESS, on_rank_lost="continue"
    ) as join:
        for step in range(counts[rank]):
            optimizer.zero_grad()
            loss = loss_fn(model, *batch(rank, step))
            if losses.get(rank) == step:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
    assert sorted(join.lost_ranks) == sorted(losses), join.lost_ranks
    assert dist.get_world_size(join.process_group) == world_size - len(losses)
    contributed = [losses.get(r, counts[r]) for r in range(world_size)]
    make_sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    expected = reference(contributed, make_sgd, divide_by_initial_world_size=divide_by_initial)
    torch.testing.assert_close(flat_params(model.module), expected, rtol=1e-5, atol=1e-6)
    return flat_params(model.module).tolist()


@pytest.mark.parametrize(
    "counts,losses,divide_by_initial,views",
    [
        pytest.param([8, 3, 8], {2: 5}, True, False, id="lost-while-another-rank-shadows"),
        pytest.param([8, 3, 8], {2: 5}, True, True, id="lost-while-another-rank-shadows-grad-views"),
        pytest.param([8, 8, 5], {1: 3}, False, False, id="divided-by-the-ranks-training"),
        pytest.param([8, 8, 8, 8], {3: 2, 2: 5}, True, False, id="two-losses"),
        # After the first loss the survivors' group numbers global rank 3 as 2.
        pytest.param([8, 8, 8, 8], {1: 2, 3: 5}, True, False, id="two-losses-a-middle-rank-first"),
    ],
)
def test_survivors_with_uneven_inputs_finish_exactly(
    counts: list[int], losses: dict[int, int], divide_by_initial: bool, views: bool
) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_uneven_with_losses, len(counts), counts, losses, divide_by_initial, views, timeout=90)
    assert sorted(failed.value.failures) == sorted(losses), str(failed.value)
    assert all("exited with code -9" in failed.value.failures[r] for r in losses), str(failed.value)


def _buffers_source_lost(rank: int, world_size: int, where: str) -> None:
    """Rank 0, whose buffers every forward takes, is killed; the survivors take
    the buffers of their own first rank from then on and stay identical."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model = DistributedDataParallel(module, bucket_cap_mb=TINY_BUCKETS_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS) as join:
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = loss_fn(model, *batch(rank, step))
            if rank == 0 and step == LOST_AT and where == "forward":
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            if rank == 0 and step == LOST_AT and where == "step":
                os.kill(os.getpid(), signal.SIGKILL)  # the others fail in the next buffer broadcast
            optimizer.step()
    assert list(join.lost_ranks) == [0], join.lost_ranks
    state = torch.cat([t.detach().reshape(-1).float() for t in module.state_dict().values()])
    states = [torch.empty_like(state) for _ in range(2)]
    dist.all_gather(states, state, group=join.process_group)
    torch.testing.assert_close(states[0], states[1], rtol=0, atol=0)


@pytest.mark.parametrize("where", ["forward", "step"])
def test_survivors_of_the_buffers_source_take_their_own_and_stay_identical(where: str) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_buffers_source_lost, 3, where, timeout=90)
    assert list(failed.value.failures) == [0], str(failed.value)


def _adam_reference(contributed: list[int]) -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
    """Parameters and Adam state of one process applying, at iteration i, the
    sum of the gradients of the ranks that contributed to it, over the world size."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(max(contributed)):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in (r for r in range(len(contributed)) if contributed[r] > step):
            model.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            for acc, p in zip(total, model.parameters()):
                assert p.grad is not None
                acc += p.grad
        for acc, p in zip(total, model.parameters()):
            p.grad = acc / len(contributed)
        optimizer.step()
    return flat_params(model), optimizer.state_dict()["state"]


def _miss_a_round(optimizer: ZeroRedundancyOptimizer, rank: int, lost_pid: int, current: list[int]) -> None:
    """In iteration LOST_AT, rank 2 dies right after ZeRO's broadcast round, and
    rank 1 fails in that round as if rank 2's part never reached it, while rank 0
    finished it and goes on into the next iteration: the survivors are a round apart."""
    finish_round = optimizer._broadcast_shards_once

    def round_then_lose() -> None:
        finish_round()
        if current[0] != LOST_AT:
            return
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1:
            _wait_ended(lost_pid)
            raise ConnectionError("rank 2's shard of this broadcast round did not arrive")

    optimizer._broadcast_shards_once = round_then_lose  # type: ignore[method-assign]


def _wait_ended(pid: int) -> None:
    deadline = time.monotonic() + 30
    while not _ended(pid):
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.01)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` ended (a zombie not reaped yet counts)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _zero_loses_rank(rank: int, world_size: int, lost: int, where: str, first_epoch_steps: int = 0) -> None:
    """DDP + ZeRO Adam with shard replicas: rank ``lost`` is killed in iteration
    LOST_AT; the survivors end with the reference's parameters and optimizer state."""
    model = DistributedDataParallel(make_model(), bucket_cap_mb=TINY_BUCKETS_MB)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01, shard_replicas=1)
    current = [0]

    def lose_between_buckets(grad: torch.Tensor) -> torch.Tensor:
        if rank == lost and current[0] == LOST_AT and where == "between-buckets":
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    next(model.module.parameters()).register_hook(lose_between_buckets)  # its gradient comes last
    if where == "after-a-round-one-missed":
        _miss_a_round(optimizer, rank, _pids(rank, world_size)[lost], current)
    if where == "step-reduction-one-missed":
        lost_pid = _pids(rank, world_size)[lost]
        if rank == 1:
            _miss_a_reduction(model, lost_pid, current)
    # A Join per epoch: the loss falls in the last one.
    epochs = (
        [range(first_epoch_steps), range(first_epoch_steps, STEPS)] if first_epoch_steps else [range(STEPS)]
    )
    for epoch in epochs:
        with Join([model, optimizer], on_rank_lost="continue", liveness_timeout=LIVENESS) as join:
            for step in epoch:
                current[0] = step
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step))
                if rank == lost and step == LOST_AT and where == "forward":
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                if rank == lost and step == LOST_AT and where.startswith("step"):
                    os.kill(os.getpid(), signal.SIGKILL)  # the others wait for its shard
                optimizer.step()
    assert list(join.lost_ranks) == [lost], join.lost_ranks
    contributed = [STEPS] * world_size
    contributed[lost] = LOST_AT if where in ("forward", "between-buckets") else LOST_AT + 1
    expected_params, expected_state = _adam_reference(contributed)
    torch.testing.assert_close(flat_params(model.module), expected_params, rtol=1e-5, atol=1e-6)
    optimizer.consolidate_state_dict(to=0)
    if dist.get_rank(join.process_group) == 0:
        state = optimizer.state_dict()["state"]
        assert sorted(state) == sorted(expected_state)
        for index, values in expected_state.items():
            for key, value in values.items():
                torch.testing.assert_close(state[index][key], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("where", ["forward", "between-buckets", "step"])
@pytest.mark.parametrize("lost", [0, 2])
def test_zero_survivors_keep_the_lost_shard_and_finish_exactly(lost: int, where: str) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_zero_loses_rank, 3, lost, where, timeout=90)
    assert list(failed.value.failures) == [lost], str(failed.value)


@pytest.mark.parametrize("first_epoch_steps", [0, 2], ids=["first-join", "second-join"])
@pytest.mark.parametrize("where", ["after-a-round-one-missed", "step-reduction-one-missed"])
def test_zero_survivors_a_collective_apart_finish_exactly(where: str, first_epoch_steps: int) -> None:
    # One survivor finished the interrupted collective (ZeRO's round: it is in the next
    # iteration's reduction; the reduction: it is in ZeRO's round) and hands the other its
    # result. In a second Join too, where the model has reduced once more than ZeRO stepped
    # (the first Join's last heartbeat).
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_zero_loses_rank, 3, 2, where, first_epoch_steps, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)


def _refusal(rank: int, world_size: int) -> str:
    model = DistributedDataParallel(make_model())
    unreplicated = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError) as refused, Join([model, unreplicated], on_rank_lost="continue"):
        pass
    return str(refused.value)


def test_zero_without_replicas_is_refused_before_training() -> None:
    zero = run_ranks(_refusal, 2)[0]
    assert "ZeroRedundancyOptimizer needs shard_replicas=1" in zero, zero


def _fsdp_cannot_go_on(rank: int, world_size: int) -> None:
    """FSDP2 cannot go on without a lost rank: warned at the start, RankLostError saying so at the loss."""
    pids = _pids(rank, world_size)
    sharded = make_model()
    fully_shard(sharded)
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="FSDPJoinable cannot go on without a lost rank"):
        join = Join([FSDPJoinable(sharded, optimizer)], on_rank_lost="continue", liveness_timeout=LIVENESS)
    try:
        with pytest.raises(RankLostError) as lost, join:
            for step in range(STEPS):
                optimizer.zero_grad()
                loss = loss_fn(sharded, *batch(rank, step))
                if rank == 2 and step == LOST_AT:
                    os.kill(os.getpid(), signal.SIGKILL)
                loss.backward()
                optimizer.step()
        assert list(lost.value.ranks) == [2], str(lost.value)
        assert "FSDPJoinable cannot do without a lost rank" in str(lost.value), str(lost.value)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[2], signal.SIGKILL)


def test_fsdp2_under_continue_is_warned_and_raises_at_a_loss() -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_fsdp_cannot_go_on, 3, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)


SAMPLES = 40
BATCH = 2


def _count_samples(rank: int, world_size: int, shuffle: bool) -> None:
    """Rank 2 is killed in its 4th batch; the survivors take its later samples
    over: each sample of the epoch is trained on exactly once."""
    features = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(torch.arange(SAMPLES))
    sampler = UnevenDistributedSampler(dataset, shuffle=shuffle, seed=5)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trained: list[int] = []
    with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS) as join:
        sampler.follow(join, BATCH)
        for step, (indices,) in enumerate(loader):
            optimizer.zero_grad()
            loss = model(features[indices]).square().mean()
            if rank == 2 and step == LOST_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
            trained += indices.tolist()
    assert join.contributions == {2: LOST_AT}, join.contributions
    lost_trained = sampler.indices_of(2)[: LOST_AT * BATCH]
    mine = torch.full((SAMPLES,), -1, dtype=torch.int64)
    mine[: len(trained)] = torch.tensor(trained)
    gathered = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(gathered, mine, group=join.process_group)
    everything = sorted([i for i in torch.cat(gathered).tolist() if i >= 0] + lost_trained)
    assert everything == list(range(SAMPLES)), everything


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_of_the_epoch_is_trained_on_once_when_a_rank_is_lost(shuffle: bool) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_count_samples, 3, shuffle, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)


def _spared_connection_survives(rank: int, world_size: int) -> None:
    """Ranks 0 and 1 keep a connection of their own (as an RPC agent does), to
    a listener rank 0 spares; rank 2 is killed. The survivors' connection works after."""
    listener = socket.create_server(("127.0.0.1", 0)) if rank == 0 else None
    port = torch.tensor([listener.getsockname()[1] if listener is not None else 0])
    dist.broadcast(port, src=0)
    if listener is not None:
        spare_connections(int(port))
    conn = socket.create_connection(("127.0.0.1", int(port))) if rank == 1 else None
    accepted = listener.accept()[0] if listener is not None else None
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS) as join:
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = loss_fn(model, *batch(rank, step))
            if rank == 2 and step == LOST_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
    assert list(join.lost_ranks) == [2]
    if conn is not None:
        conn.sendall(b"still here")
        conn.close()
    if accepted is not None:
        accepted.settimeout(10)
        assert accepted.recv(64) == b"still here"
        accepted.close()


def test_connections_a_library_spares_outlive_the_loss() -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_spared_connection_survives, 3, timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)


def _lose_rank_over_a_file_store(rank: int, world_size: int, path: str) -> None:
    """The same run over a FileStore (no process serves it): rank 2 killed, the others exact."""
    dist.destroy_process_group()  # run_ranks' group, over its TCPStore; this run uses the file
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world_size)
    model = DistributedDataParallel(make_model(), bucket_cap_mb=TINY_BUCKETS_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model], on_rank_lost="continue", liveness_timeout=LIVENESS) as join:
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = loss_fn(model, *batch(rank, step))
            if rank == 2 and step == LOST_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
    assert list(join.lost_ranks) == [2], join.lost_ranks
    expected = reference([STEPS, STEPS, LOST_AT], lambda p: torch.optim.SGD(p, lr=0.1))
    torch.testing.assert_close(flat_params(model.module), expected, rtol=1e-5, atol=1e-6)


def test_survivors_go_on_over_a_file_store(tmp_path: Path) -> None:
    with pytest.raises(RanksFailedError) as failed:
        run_ranks(_lose_rank_over_a_file_store, 3, str(tmp_path / "store"), timeout=90)
    assert list(failed.value.failures) == [2], str(failed.value)
