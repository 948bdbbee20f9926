"""The agents' ledger: a job ends, with every rank accounted for, even when an agent went down
before it said which ranks it runs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch.distributed as dist

from join_core.agent_ledger import BEAT_INTERVAL, Ledger

# torch's stubs do not re-export the store class it documents publicly.
HashStore: Any = dist.HashStore  # type: ignore[attr-defined]

TIMEOUT = 3.0


def _ledger(store: Any, group_rank: int, agents: int, ranks: list[int], world_size: int) -> Ledger:
    """The ledger of the agent of ``group_rank`` (of ``agents``) running ``ranks``."""
    workers = [SimpleNamespace(global_rank=rank, world_size=world_size) for rank in ranks]
    group = SimpleNamespace(store=store, group_rank=group_rank, group_world_size=agents, workers=workers)
    return Ledger(cast(Any, group), TIMEOUT)


def _outcome_after_the_timeout(ledger: Ledger, start: float = 0.0) -> Any:
    """The job's outcome as the ledger judges it from ``start`` (on its clock) over twice the agent
    timeout (None: still running)."""
    now, outcome = start, None
    while now < start + 2 * TIMEOUT + 2 * BEAT_INTERVAL and outcome is None:
        ledger.beat(now)
        outcome = ledger.job_outcome(now)
        now += BEAT_INTERVAL
    return outcome


@pytest.mark.parametrize("wrote_its_ranks", [False, True])
def test_the_ranks_of_an_agent_lost_before_or_after_saying_which_it_runs_count_as_lost(
    wrote_its_ranks: bool,
) -> None:
    store = HashStore()
    survivor = _ledger(store, 0, 3, [0, 1], 5)
    _ledger(store, 1, 3, [2], 5)  # answers no more once made
    if wrote_its_ranks:
        _ledger(store, 2, 3, [3, 4], 5)
    for rank, local_rank in ((0, 0), (1, 1)):
        survivor.record(rank, local_rank, 100 + rank, 0, "")
    outcome = _outcome_after_the_timeout(survivor)
    assert outcome is not None, "the job never ends: the lost agents' workers are never counted"
    verdicts = {end.rank: end.verdict for end in outcome.ends}
    assert verdicts == {0: "succeeded", 1: "succeeded", 2: "lost", 3: "lost", 4: "lost"}


def test_ranks_no_agent_claims_wait_while_an_agent_that_has_not_claimed_any_still_answers() -> None:
    store = HashStore()
    survivor = _ledger(store, 0, 3, [0], 3)
    survivor.record(0, 0, 100, 0, "")
    # Agent 1 beats but has not written its ranks yet; agent 2 went down before it did.
    now, outcome = 0.0, None
    while now < 2 * TIMEOUT + 2 * BEAT_INTERVAL:
        store.add("join_core/launch/agent/1/beat", 1)
        outcome = survivor.job_outcome(now)
        now += BEAT_INTERVAL
    assert outcome is None
    _ledger(store, 1, 3, [1], 3)  # agent 1 writes its ranks and goes down
    outcome = _outcome_after_the_timeout(survivor, start=now)
    assert outcome is not None
    assert {end.rank: end.verdict for end in outcome.ends} == {0: "succeeded", 1: "lost", 2: "lost"}
