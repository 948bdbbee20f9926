"""FSDPJoinable: FSDP2 models trained with uneven inputs under Join end equal
to a single-process reference, on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ddp_cases import DEVICES, batch, flat_params, full_tensor, loss_fn, make_model, rank_device, reference
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ddp_join import FSDPJoinable
from join_core import Join, JoinAbortedError, ShadowCollectives
from join_core.testing import run_ranks

BASE, EXTRA = 2, 2  # rank r trains on BASE + r * EXTRA batches


def counts(world_size: int) -> list[int]:
    return [BASE + r * EXTRA for r in range(world_size)]


def _sharded_model(device: torch.device, nested: bool, mesh: DeviceMesh | None = None) -> torch.nn.Module:
    model = make_model().to(device)
    if nested:
        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _make_optimizer(name: str, params: object) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]
    return torch.optim.Adam(params, lr=0.01)  # type: ignore[arg-type]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    assert isinstance(tensor, DTensor)
    return full_tensor(tensor)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: full_tensor(value) for key, value in model.state_dict().items()}


def _train(
    rank: int, world_size: int, device: str, backend: str, optimizer_name: str, divide: bool, nested: bool
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    dev = rank_device(device, backend, rank)
    model = _sharded_model(dev, nested)
    optimizer = _make_optimizer(optimizer_name, model.parameters())
    with Join([FSDPJoinable(model, optimizer)], divide_by_initial_world_size=divide):
        for step in range(counts(world_size)[rank]):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step, dev)).backward()
            optimizer.step()
    momentum_key = "momentum_buffer" if optimizer_name == "sgd" else "exp_avg"
    states = [optimizer.state[p][momentum_key] for p in model.parameters()]
    return _full_state(model), [_full(s) for s in states]


def _reference_state(optimizer_name: str, world_size: int, divide: bool) -> torch.Tensor:
    return reference(counts(world_size), lambda ps: _make_optimizer(optimizer_name, ps), divide)


@DEVICES
@pytest.mark.parametrize(
    "optimizer_name,divide,nested,world_size",
    [
        pytest.param("sgd", True, True, 2, id="sgd-divide-by-world-nested-2"),
        pytest.param("adam", False, True, 3, id="adam-divide-by-active-nested-3"),
        pytest.param("adam", True, False, 4, id="adam-divide-by-world-root-only-4"),
    ],
)
def test_uneven_fsdp_matches_single_process_reference(
    device: str, backend: str, optimizer_name: str, divide: bool, nested: bool, world_size: int
) -> None:
    results = run_ranks(
        _train, world_size, device, backend, optimizer_name, divide, nested, backend=backend, timeout=180
    )
    states = [state for state, _ in results]
    for other in states[1:]:
        for key in states[0]:
            assert torch.equal(states[0][key], other[key]), key
    # The state dict taken after the Join loads into a single-process model.
    plain = make_model()
    plain.load_state_dict(states[0])
    expected = _reference_state(optimizer_name, world_size, divide)
    torch.testing.assert_close(flat_params(plain), expected, rtol=1e-5, atol=1e-6)
    # Every rank stepped its shard on every iteration: the optimizer state matches too.
    momentum = torch.cat([s.reshape(-1) for s in results[0][1]])
    assert momentum.abs().sum() > 0
    for _, other_momentum in results[1:]:
        torch.testing.assert_close(torch.cat([s.reshape(-1) for s in other_momentum]), momentum)


def _train_throw(rank: int, world_size: int) -> int:
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    try:
        with Join([FSDPJoinable(model, optimizer)], throw_on_early_termination=True):
            for step in range(counts(world_size)[rank]):
                optimizer.zero_grad()
                loss_fn(model, *batch(rank, step)).backward()
                optimizer.step()
                steps += 1
    except RuntimeError as error:
        assert "exhausted" in str(error), error
        return steps
    raise AssertionError(f"rank {rank} did not raise")


def test_throw_on_early_termination_raises_on_every_rank() -> None:
    steps = run_ranks(_train_throw, 3, timeout=120)
    # Rank 0 runs out after BASE steps; the others raise during the next one.
    assert steps == [BASE, BASE, BASE]


def _train_throw_then_go_on(rank: int, world_size: int, clip: bool) -> dict[str, torch.Tensor]:
    """_train_throw (with a gradient clip in each step if ``clip``), then collectives after the
    Join: every rank left it between the same two collectives."""
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    joinable = FSDPJoinable(model, optimizer)
    with pytest.raises(RuntimeError, match="exhausted"), Join([joinable], throw_on_early_termination=True):
        for step in range(counts(world_size)[rank]):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            if clip:
                joinable.clip_grad_norm_(0.2)
            optimizer.step()
    ones = torch.ones(3)
    dist.all_reduce(ones)
    assert ones.tolist() == [world_size] * 3
    return _full_state(model)


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
def test_throw_on_early_termination_leaves_every_shard_at_the_last_complete_step(clip: bool) -> None:
    # Every rank raises before the iteration in which the first rank joined: a joined rank
    # replays none of it (no optimizer step of its shard, no clip's all-reduce of its own).
    world_size = 3
    states = run_ranks(_train_throw_then_go_on, world_size, clip, timeout=120)
    plain = make_model()
    plain.load_state_dict(states[0])
    if not clip:
        expected = reference([BASE] * world_size, lambda ps: torch.optim.SGD(ps, lr=0.1))
        torch.testing.assert_close(flat_params(plain), expected, rtol=1e-5, atol=1e-6)
    for state in states[1:]:
        for key in state:
            assert torch.equal(state[key], states[0][key]), key


def _train_disabled(rank: int, world_size: int, enable: bool) -> tuple[torch.Tensor, int, int]:
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    joinable = FSDPJoinable(model, optimizer)

    def iteration(step: int) -> None:
        optimizer.zero_grad()
        loss_fn(model, *batch(rank, step)).backward()
        optimizer.step()

    iteration(0)  # warm-up: FSDP's lazy initialisation issues collectives of its own
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
        Join([joinable], enable=enable),
    ):
        for step in range(1, 4):
            iteration(step)
    events = [event for event in prof.key_averages() if event.key.startswith("c10d::")]
    all_reduces = sum(event.count for event in events if event.key.startswith("c10d::allreduce_"))
    return (
        torch.cat([_full(p).reshape(-1) for p in model.parameters()]),
        all_reduces,
        sum(event.count for event in events) - all_reduces,
    )


def test_healthy_iterations_add_one_heartbeat_and_disabled_join_adds_none() -> None:
    enabled = run_ranks(_train_disabled, 2, True, timeout=120)
    disabled = run_ranks(_train_disabled, 2, False, timeout=120)
    # One heartbeat per iteration, and the one that finds every rank joined.
    assert [all_reduces for _, all_reduces, _ in enabled] == [4, 4]
    assert [all_reduces for _, all_reduces, _ in disabled] == [0, 0]
    # FSDP's own collectives are the same with or without Join.
    assert [fsdp for _, _, fsdp in enabled] == [fsdp for _, _, fsdp in disabled]
    assert disabled[0][2] > 0
    torch.testing.assert_close(enabled[0][0], disabled[0][0])
    expected = reference([4, 4], lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.testing.assert_close(enabled[0][0], expected, rtol=1e-5, atol=1e-6)


def _train_counts(rank: int, world_size: int, rank_counts: list[int]) -> dict[str, torch.Tensor]:
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([FSDPJoinable(model, optimizer)]):
        for step in range(rank_counts[rank]):
            optimizer.zero_grad()
            loss_fn(model, *batch(rank, step)).backward()
            optimizer.step()
    return _full_state(model)


def test_rank_without_any_batch_replays_a_peers_input() -> None:
    rank_counts = [0, 2]
    states = run_ranks(_train_counts, 2, rank_counts, timeout=120)
    plain = make_model()
    plain.load_state_dict(states[1])
    expected = reference(rank_counts, lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.testing.assert_close(flat_params(plain), expected, rtol=1e-5, atol=1e-6)
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key


def _clipped_beside_a_rank_without_batches(rank: int, world_size: int) -> str:
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    joinable = FSDPJoinable(model, optimizer)
    try:
        with Join([joinable]):
            for step in range(rank):  # rank 0 has no batch
                optimizer.zero_grad()
                loss_fn(model, *batch(rank, step)).backward()
                joinable.clip_grad_norm_(0.2)
                optimizer.step()
    except (ValueError, JoinAbortedError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_rank_without_any_batch_that_cannot_repeat_its_peers_clips_fails_every_rank_naming_why() -> None:
    # Rank 0 repeats the clips of its peers' iteration before the first: none. The others'
    # clip would have waited for an all-reduce rank 0 never issues.
    outcomes = run_ranks(_clipped_beside_a_rank_without_batches, 3, timeout=120)
    for outcome in outcomes[1:]:
        assert outcome.startswith(
            "ValueError: FSDPJoinable: a rank without any batch in this Join repeats the "
            "gradient clips of the iteration before this one (none); this iteration's differ "
            "(clip_grad_norm_(0.2, 2.0))"
        ), outcome
        assert "nothing was clipped before this iteration, so give every rank at least one batch" in outcome
    assert outcomes[0].startswith("JoinAbortedError"), outcomes[0]


def _clipped_join_then_one_without_batches(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """A first Join where every rank trains a clipped step, then evaluates (no_grad); a second
    where rank 0 has no batch and repeats the others' clips of the training step before."""
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    joinable = FSDPJoinable(model, optimizer)
    for first, steps in ((True, 1), (False, 0 if rank == 0 else 2)):
        with Join([joinable]):
            for step in range(steps):
                optimizer.zero_grad()
                loss_fn(model, *batch(rank, step)).backward()
                joinable.clip_grad_norm_(0.2)
                optimizer.step()
            if first:
                with torch.no_grad():
                    model(batch(rank, 9)[0])
    return _full_state(model)


def test_a_rank_without_any_batch_repeats_the_clips_of_the_last_training_step_not_of_an_evaluation() -> None:
    states = run_ranks(_clipped_join_then_one_without_batches, 3, timeout=120)
    for state in states[1:]:
        for key in state:
            assert torch.equal(state[key], states[0][key]), key


def test_rejects_a_module_not_sharded() -> None:
    model = make_model()
    with pytest.raises(TypeError, match="fully_shard"):
        FSDPJoinable(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _wrap_with_a_wrong_optimizer(rank: int, world_size: int) -> tuple[str, int]:
    model = _sharded_model(torch.device("cpu"), nested=False)
    hooks = len(model._forward_pre_hooks) + len(model._forward_hooks)
    try:
        FSDPJoinable(model, None)  # type: ignore[arg-type]
    except TypeError as error:
        message = str(error)
    else:
        message = "no error"
    return message, len(model._forward_pre_hooks) + len(model._forward_hooks) - hooks


def test_rejects_what_is_not_an_optimizer_before_hooking_the_module() -> None:
    [(message, hooks_added)] = run_ranks(_wrap_with_a_wrong_optimizer, 1, timeout=60)
    assert message.startswith("FSDPJoinable(optimizer=NoneType): not a torch.optim.Optimizer")
    assert hooks_added == 0


def _train_failing(rank: int, world_size: int) -> str:
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Join([FSDPJoinable(model, optimizer)]):
            for step in range(3):
                if rank == 1 and step == 1:
                    raise ValueError("bad batch")
                optimizer.zero_grad()
                loss_fn(model, *batch(rank, step)).backward()
                optimizer.step()
    except (ValueError, JoinAbortedError) as error:
        return type(error).__name__
    return "finished"


def test_failure_between_iterations_reaches_every_rank() -> None:
    assert run_ranks(_train_failing, 2, timeout=120) == ["JoinAbortedError", "ValueError"]


def _train_failing_in_loss(rank: int, world_size: int) -> str:
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with Join([FSDPJoinable(model, optimizer)]):
            for step in range(3):
                optimizer.zero_grad()
                output = model(batch(rank, step)[0])
                if rank == 1 and step == 1:
                    raise ValueError("NaN in the loss")  # after the forward, before its backward
                output.pow(2).mean().backward()
                optimizer.step()
    except (ValueError, JoinAbortedError) as error:
        return type(error).__name__
    return "finished"


def test_failure_between_forward_and_backward_reaches_every_rank() -> None:
    # The failing rank issues the backward's collectives the others wait in.
    assert run_ranks(_train_failing_in_loss, 2, timeout=60) == ["JoinAbortedError", "ValueError"]


def _train_with_logging(
    rank: int, world_size: int, device: str, backend: str, closure: bool, divide: bool
) -> tuple[dict[str, torch.Tensor], list[float]]:
    dev = rank_device(device, backend, rank)
    # Over the default group, which ShadowCollectives shadows: fully_shard's own
    # mesh may have a group of its own (CUDA over gloo does).
    assert dist.group.WORLD is not None
    mesh = DeviceMesh.from_group(dist.group.WORLD, dev.type)
    model = _sharded_model(dev, nested=True, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    logged: list[float] = []
    with Join([FSDPJoinable(model, optimizer), ShadowCollectives()], divide_by_initial_world_size=divide):
        for step in range(counts(world_size)[rank]):

            def iteration(step: int = step) -> torch.Tensor:
                optimizer.zero_grad()
                loss = loss_fn(model, *batch(rank, step, dev))
                synced = loss.detach().clone()
                dist.all_reduce(synced)  # between the forward and the backward, as Lightning's self.log
                logged.append(float(synced))
                loss.backward()
                return loss

            if closure:  # the forward and backward inside the step, as Lightning runs them
                optimizer.step(iteration)
            else:
                iteration()
                optimizer.step()
    return _full_state(model), logged


@pytest.mark.timeout(240)
@DEVICES
@pytest.mark.parametrize(
    "closure,divide",
    [pytest.param(True, True, id="closure"), pytest.param(False, False, id="plain-by-active")],
)
def test_shadow_collectives_beside_fsdp_shadow_the_loops_all_reduce(
    device: str, backend: str, closure: bool, divide: bool
) -> None:
    world_size = 3
    results = run_ranks(
        _train_with_logging, world_size, device, backend, closure, divide, backend=backend, timeout=120
    )
    plain = make_model()
    plain.load_state_dict(results[0][0])
    expected = reference(counts(world_size), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), divide)
    torch.testing.assert_close(flat_params(plain), expected, rtol=1e-5, atol=1e-6)
    # Each step's logged sum is over the ranks that had a batch: a joined rank adds 0.
    longest = results[-1][1]
    assert len(longest) == max(counts(world_size))
    for rank, (state, logged) in enumerate(results):
        assert logged == longest[: len(logged)], f"rank {rank}"
        for key in state:
            assert torch.equal(state[key], results[0][0][key]), f"rank {rank}: {key}"


EVAL_COUNTS = [3, 2, 2]  # the longest rank's last batch is the only one the others shadow


def _evaluate_with_logging(rank: int, world_size: int) -> list[float]:
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged: list[float] = []
    with torch.no_grad(), Join([FSDPJoinable(model, optimizer), ShadowCollectives()]):
        for step in range(EVAL_COUNTS[rank]):
            synced = loss_fn(model, *batch(rank, step))
            dist.all_reduce(synced)  # a metric synced on every step
            logged.append(float(synced))
    return logged


@pytest.mark.timeout(240)
def test_shadow_collectives_beside_fsdp_shadow_an_evaluation_loop() -> None:
    world_size = 3
    results = run_ranks(_evaluate_with_logging, world_size, timeout=120)
    model = make_model()
    with torch.no_grad():
        losses = [[float(loss_fn(model, *batch(r, s))) for s in range(EVAL_COUNTS[r])] for r in range(3)]
    # Each step's sum is over the ranks that had a batch: a joined rank adds 0.
    expected = [sum(losses[r][s] for r in range(3) if s < EVAL_COUNTS[r]) for s in range(max(EVAL_COUNTS))]
    for rank, logged in enumerate(results):
        assert logged == pytest.approx(expected[: EVAL_COUNTS[rank]], rel=1e-5), f"rank {rank}"


def _train_clipped(rank: int, world_size: int, kind: str) -> dict[str, torch.Tensor]:
    assert dist.group.WORLD is not None
    model = _sharded_model(torch.device("cpu"), nested=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    joinable = FSDPJoinable(model, optimizer)
    with Join([joinable, ShadowCollectives()]):
        for step in range(counts(world_size)[rank]):
            optimizer.zero_grad()
            loss = loss_fn(model, *batch(rank, step))
            synced = loss.detach().clone()
            dist.all_reduce(synced)  # a loop collective beside the clip's
            loss.backward()
            if kind == "value":
                joinable.clip_grad_value_(CLIP_VALUE)
            else:
                norm = joinable.clip_grad_norm_(CLIP_NORM[kind], float(kind))
                assert norm > CLIP_NORM[kind]  # every step clips
            optimizer.step()
    return _full_state(model)


CLIP_NORM: dict[str, float] = {"2.0": 0.2, "inf": 0.05}  # below every step's norm
CLIP_VALUE: float = 0.02


def _clipped_reference(world_size: int, kind: str) -> torch.Tensor:
    """reference(), with the averaged gradient of each step clipped."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = counts(world_size)
    for step in range(max(steps)):
        model.zero_grad()
        for rank in range(world_size):
            if step < steps[rank]:
                (loss_fn(model, *batch(rank, step)) / world_size).backward()
        if kind == "value":
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM[kind], float(kind))
        optimizer.step()
    return flat_params(model)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["2.0", "inf", "value"])
def test_clipped_gradients_of_uneven_ranks_match_the_single_process_reference(kind: str) -> None:
    world_size = 3
    results = run_ranks(_train_clipped, world_size, kind, timeout=120)
    plain = make_model()
    plain.load_state_dict(results[0])
    torch.testing.assert_close(flat_params(plain), _clipped_reference(world_size, kind), rtol=1e-5, atol=1e-6)
    for rank, state in enumerate(results):
        for key in state:
            assert torch.equal(state[key], results[0][key]), f"rank {rank}: {key}"


def _refusals(rank: int, world_size: int) -> list[str]:
    model = _sharded_model(torch.device("cpu"), nested=False)
    joinable = FSDPJoinable(model, torch.optim.SGD(model.parameters(), lr=0.1))
    messages = []
    for call in (
        lambda: joinable.clip_grad_norm_(-1.0),
        lambda: joinable.clip_grad_norm_(1.0, 0.0),
        lambda: joinable.clip_grad_value_(-0.5),
    ):
        try:
            call()
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_clip_arguments_out_of_range_are_refused() -> None:
    (messages,) = run_ranks(_refusals, 1, timeout=60)
    assert messages == [
        "FSDPJoinable.clip_grad_norm_(max_norm=-1.0): give a norm of at least 0",
        "FSDPJoinable.clip_grad_norm_(norm_type=0.0): give a p greater than 0 (2.0 for the Euclidean "
        "norm, float('inf') for the largest absolute value)",
        "FSDPJoinable.clip_grad_value_(clip_value=-0.5): give a value of at least 0",
    ]
