"""The recorder sees every collective end, whatever ``Work`` its backend
returns, and keeps neither memory nor per-call cost growing with works it
cannot see end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# torch's fake backend: its FakeWork defines its own wait() and never reports
# itself completed, as a backend written outside torch may.
_SCRIPT = """
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import join_core
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
rec = join_core.record_collectives(capacity=64)
t = torch.ones(4)
for _ in range(500):
    dist.all_reduce(t)
dist.all_reduce(t, async_op=True).wait()
waited = [r.ended is not None for r in rec.records()]
pending_after_waits = len(rec.pending())
for _ in range(500):
    dist.all_reduce(t, async_op=True)  # never waited on
print(json.dumps({"waited": waited, "pending_after_waits": pending_after_waits,
                  "pending_unwaited": len(rec.pending())}))
"""


@pytest.mark.timeout(120)
def test_works_with_their_own_wait_are_seen_complete_and_unwaited_ones_stay_bounded() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["waited"] and all(found["waited"]), found["waited"]
    assert found["pending_after_waits"] == 0
    # Never waited and never completed: forgotten past the capacity (64).
    assert found["pending_unwaited"] <= 2 * 64, found["pending_unwaited"]


_DESTROYED_SCRIPT = """
import gc, json, os, weakref, torch, torch.distributed as dist
import join_core
join_core.record_collectives()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
before = len(os.listdir("/proc/self/fd"))
groups = []
for _ in range(5):
    group = dist.new_group([0])
    dist.all_reduce(torch.ones(1), group=group)
    groups.append(weakref.ref(group))
    dist.destroy_process_group(group)
    del group
gc.collect()
print(json.dumps({"alive": sum(g() is not None for g in groups),
                  "descriptors": len(os.listdir("/proc/self/fd")) - before}))
"""


@pytest.mark.timeout(120)
def test_a_destroyed_process_group_is_not_kept_alive_with_its_sockets() -> None:
    # The recorder held every group it had seen: a job that makes a group per phase (or
    # regroups after a loss) kept each one's connections open.
    out = subprocess.run(
        [sys.executable, "-c", _DESTROYED_SCRIPT], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"alive": 0, "descriptors": 0}
