"""How the workers of a job under :class:`~join_core.survivor_agent.SurvivorAgent` ended.

Each worker's end gets a verdict: **succeeded** (exit code 0), **lost** (an
error while other workers of the job still ran and none had finished) or
**failed** (an error after a worker finished, or as the last one running);
the job succeeded when at least one worker did and none failed
(:class:`JobOutcome`). :func:`judge_error` and :attr:`JobOutcome.succeeded`
are those rules; the agents' ledger (:mod:`join_core.agent_ledger`) counts,
across hosts, what they are applied to.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from typing import Final, Literal

# WorkerEnd and JobOutcome are public as join_core.survivor_agent's.
__all__: list[str] = []

Verdict = Literal["succeeded", "lost", "failed"]
_VERDICTS: Final[dict[str, Verdict]] = {"succeeded": "succeeded", "lost": "lost", "failed": "failed"}


@dataclass(frozen=True)
class WorkerEnd:
    """How one worker (one rank) of the job ended."""

    rank: int
    local_rank: int
    host: str
    pid: int
    exitcode: int  # negative: killed by that signal; UNKNOWN_EXIT: its agent was lost with it
    verdict: Verdict
    detail: str  # what was seen, e.g. "killed by SIGKILL while 2 other workers still ran"

    def describe(self) -> str:
        """One line: the rank, where it ran, its verdict and what was seen."""
        where = (f"local rank {self.local_rank} " if self.local_rank >= 0 else "") + f"on {self.host}"
        where += f", pid {self.pid}" if self.pid > 0 else ""
        return f"rank {self.rank} ({where}): {self.verdict}" + (f": {self.detail}" if self.detail else "")

    def to_json(self) -> str:
        """This end as the agents keep it in the rendezvous store."""
        return json.dumps(
            {
                "rank": self.rank,
                "local_rank": self.local_rank,
                "host": self.host,
                "pid": self.pid,
                "exitcode": self.exitcode,
                "verdict": self.verdict,
                "detail": self.detail,
            }
        )

    @staticmethod
    def from_json(raw: bytes | str) -> WorkerEnd:
        """An end read from the store (:meth:`to_json`); raises ValueError, KeyError or
        TypeError on anything else."""
        data = json.loads(raw)
        return WorkerEnd(
            int(data["rank"]),
            int(data["local_rank"]),
            str(data["host"])[:200],
            int(data["pid"]),
            int(data["exitcode"]),
            _VERDICTS[str(data["verdict"])],
            str(data["detail"])[:2000],
        )


#: WorkerEnd.exitcode of a worker whose agent was lost with it.
UNKNOWN_EXIT: Final = -1000


@dataclass(frozen=True)
class JobOutcome:
    """Every worker's end, by rank; the same on every agent of the job."""

    ends: tuple[WorkerEnd, ...]

    @property
    def succeeded(self) -> bool:
        """At least one worker succeeded and none failed (lost ones may have)."""
        verdicts = [end.verdict for end in self.ends]
        return "succeeded" in verdicts and "failed" not in verdicts

    @property
    def lost(self) -> tuple[WorkerEnd, ...]:
        """The lost workers, by rank."""
        return tuple(end for end in self.ends if end.verdict == "lost")

    def summary(self) -> str:
        """A headline, then one line per rank."""
        count = {v: sum(end.verdict == v for end in self.ends) for v in ("succeeded", "lost", "failed")}
        total = len(self.ends)
        if self.succeeded:
            head = f"job succeeded: {count['succeeded']} of {total} workers finished"
            if count["lost"]:
                head += f"; {count['lost']} lost, and the survivors went on without them"
        elif count["succeeded"] == 0 and count["failed"]:
            head = f"job failed: no worker of {total} finished"
        else:
            head = (
                f"job failed: {count['failed']} of {total} workers failed after the job could no longer "
                "go on without them (another worker had finished, or none was left running)"
            )
        return "\n".join([head, *(f"  {end.describe()}" for end in self.ends)])


def describe_exit(exitcode: int) -> str:
    """``exited with code 1`` or ``killed by SIGKILL``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exited with code {exitcode}"


def judge_error(exitcode: int, message: str, running: int, finished: int) -> tuple[Verdict, str]:
    """The verdict on a worker that ended with an error, and what was seen.

    Args:
        exitcode: its exit code (negative: the signal that killed it).
        message: the last line of the error it recorded, or "".
        running: how many other workers of the job still run.
        finished: how many workers of the job finished successfully.
    """
    seen = describe_exit(exitcode) + (f" ({message})" if message else "")
    if finished:
        return "failed", f"{seen} after {finished} worker(s) had finished"
    if running <= 0:
        return "failed", f"{seen}, the last worker running"
    return "lost", f"{seen} while {running} other worker(s) still ran"
