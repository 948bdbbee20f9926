"""The collective recorder: the last collectives of this process, in memory.

:func:`record_collectives` wraps the collective methods of torch's
``ProcessGroup`` class and ``Work.wait``, once per process. Every collective
reaches those methods however it is called (``dist.all_reduce``, a function
imported by name, FSDP2's and our DDP's own calls, async or not), on gloo and
NCCL alike, so each one is numbered per process group and kept in a ring of
the last :data:`DEFAULT_CAPACITY`: op, group, sequence number, shapes,
dtypes, the user's call site, start and end times. Every rank issues a
group's collectives in the same order, so a sequence number names the same
collective on every rank (counted from when recording began: every rank must
begin at the same point of its program, which the entry points that begin it,
``Join`` and our wrappers' constructors, are).

A collective costs a few microseconds more: a frame walk to the first frame
outside torch and our packages (cached per code object) and one small record.
Line numbers and descriptions are worked out only when a record is read.

A watch (:mod:`join_core.collective_watch`) that has judged the ranks' state
fatal (a lost rank, a desync) sets a verdict here: a collective then issued on
that group raises it at once, and a collective that fails on it is re-raised
as that verdict.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import sys
import threading
import time
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Final

import torch
import torch.distributed as dist

from join_core import handoff

__all__ = [
    "DEFAULT_CAPACITY",
    "CollectiveRecord",
    "CollectiveRecorder",
    "record_collectives",
    "recorder",
]

#: How many collectives the recorder keeps (across all groups).
DEFAULT_CAPACITY: Final = 2048
#: How many works may be pending before completed ones are swept out (doubling with those that stay).
_SWEEP_AT: Final = 8
#: The environment variable that turns recording off when "0".
RECORD_VARIABLE: Final = "JOIN_CORE_RECORD"
#: How long a failed collective waits for a watch's verdict to explain it.
VERDICT_GRACE_S: Final = 3.0

# ProcessGroup method -> (the name users know, which positional arguments hold
# the tensors every rank passes with the same shapes; None: compare dtypes only).
_METHODS: Final[dict[str, tuple[str, tuple[int, ...] | None]]] = {
    "allreduce": ("all_reduce", (0,)),
    "allreduce_coalesced": ("all_reduce_coalesced", (0,)),
    "broadcast": ("broadcast", (0,)),
    "reduce": ("reduce", (0,)),
    "allgather": ("all_gather", (0, 1)),
    "allgather_coalesced": ("all_gather_coalesced", (0, 1)),
    "all_gather_single": ("all_gather_into_tensor", (0, 1)),
    "_allgather_base": ("all_gather_into_tensor", (0, 1)),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor_coalesced", (0, 1)),
    "all_gather_single_coalesced": ("all_gather_into_tensor_coalesced", (0, 1)),
    "reduce_scatter": ("reduce_scatter", (0, 1)),
    "reduce_scatter_single": ("reduce_scatter_tensor", (0, 1)),
    "_reduce_scatter_base": ("reduce_scatter_tensor", (0, 1)),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor_coalesced", (0, 1)),
    "reduce_scatter_single_coalesced": ("reduce_scatter_tensor_coalesced", (0, 1)),
    "gather": ("gather", (1,)),  # the root alone passes output lists
    "scatter": ("scatter", (0,)),  # the root alone passes input lists
    "alltoall": ("all_to_all", None),  # split sizes may differ per rank
    "alltoall_base": ("all_to_all_single", None),
    "all_to_all_single": ("all_to_all_single", None),
    "barrier": ("barrier", ()),
}

# Where frames are not the user's: torch, and the packages that issue collectives for the user.
_INTERNAL_PACKAGES: Final = (
    "torch",
    "typing_extensions",
    "join_core",
    "ddp_join",
    "lightning_join",
    "lightning",
    "torchmetrics",
)


@dataclass(eq=False, slots=True)
class CollectiveRecord:
    """One collective as this rank issued it.

    Attributes:
        seq: its number on its group, from 1, the same on every rank.
        op: the collective, as ``torch.distributed`` names it (``all_reduce``).
        group: the process group's name.
        shapes: the shapes of the tensors every rank passes alike.
        dtypes: their dtypes (``float32``).
        started: when it was issued (``time.time()``).
        ended: when it was seen complete, or None while pending.
        failed: the error it ended with, if any.
    """

    seq: int
    op: str
    group: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    started: float
    ended: float | None = None
    failed: str | None = None
    _code: CodeType | None = None
    _offset: int = 0
    _function: str = ""

    @property
    def call_site(self) -> str:
        """``file.py:LINE function()`` of the user's code that issued it."""
        return _site(self._code, self._offset)

    @property
    def fingerprint(self) -> int:
        """What every rank's record of this collective has in common: op, shapes, dtypes."""
        return zlib.crc32(repr((self.op, self.shapes, self.dtypes)).encode())

    def describe(self) -> str:
        """``all_reduce #12 (float32[4])``."""
        if self.shapes:
            tensors = ", ".join(f"{d}{list(s)}" for s, d in zip(self.shapes, self.dtypes))
        else:
            tensors = ", ".join(self.dtypes)
        return f"{self.op} #{self.seq} ({tensors})" if tensors else f"{self.op} #{self.seq}"

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values."""
        return {
            "seq": self.seq,
            "op": self.op,
            "group": self.group,
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "call_site": self.call_site,
            "started": self.started,
            "ended": self.ended,
            "failed": self.failed,
            "fingerprint": self.fingerprint,
        }


class CollectiveRecorder:
    """The ring of this process's last collectives and those still pending.

    Use :func:`recorder` for the process's one instance.

    Attributes:
        enabled: False stops recording (and with it hang reports and desync
            errors) until set True again; ``JOIN_CORE_RECORD=0`` in the
            environment starts it False.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.enabled: bool = os.environ.get(RECORD_VARIABLE, "1") != "0"
        self._records: deque[CollectiveRecord] = deque(maxlen=capacity)
        self._capacity = capacity
        # id(group) -> its name, its numbers; while it lives: a destroyed group (its sockets and
        # threads) is not kept alive here.
        self._groups: dict[int, tuple[str, Iterator[int]]] = {}
        self._pending: dict[int, tuple[Any, CollectiveRecord]] = {}  # id(work) -> (work, record)
        # group name -> the fatal verdict, and the group it is on, weakly (None: any of that name)
        self._verdicts: dict[str, tuple[BaseException, weakref.ref[dist.ProcessGroup] | None]] = {}
        # group name -> what may explain a failed wait at once (a watch judging a closed connection)
        self._explainers: dict[str, Callable[[BaseException], None]] = {}
        self._lock = threading.Lock()
        self._work_types: set[type] = {dist.Work}  # whose wait() reports to the recorder
        self._sweep_at = _SWEEP_AT

    def records(self, group: str | None = None) -> list[CollectiveRecord]:
        """The kept records, oldest first (of ``group`` only, if given)."""
        self._sweep()
        found = list(self._records)
        return found if group is None else [r for r in found if r.group == group]

    def latest(self, group: str, count: int) -> list[CollectiveRecord]:
        """The last ``count`` records of ``group``, oldest first (without copying the ring)."""
        for _ in range(3):
            found: list[CollectiveRecord] = []
            try:
                for record in reversed(self._records):
                    if len(found) == count:
                        break
                    if record.group == group:
                        found.append(record)
            except RuntimeError:  # a collective was recorded meanwhile
                continue
            return found[::-1]
        return [r for r in list(self._records) if r.group == group][-count:]

    def pending(self, group: str | None = None) -> list[CollectiveRecord]:
        """The collectives issued and not yet seen complete, oldest first."""
        self._sweep()
        found = sorted((r for _, r in list(self._pending.values())), key=lambda r: r.seq)
        return found if group is None else [r for r in found if r.group == group]

    def median_duration(self, record: CollectiveRecord) -> float | None:
        """The median time of the completed collectives like ``record`` (same op, shapes, dtypes)."""
        times = sorted(
            r.ended - r.started
            for r in list(self._records)
            if r.ended is not None and r.op == record.op and r.shapes == record.shapes
        )
        return times[len(times) // 2] if times else None

    def set_verdict(
        self, group: str, error: BaseException, process_group: dist.ProcessGroup | None = None
    ) -> None:
        """Make every later collective on ``group`` raise ``error``, and a failed one re-raise as it.

        With ``process_group``, only on that group: a group made later under the same name
        (``destroy_process_group()`` and a new default group, to go on in the same process) is
        not concerned.
        """
        known = self._verdicts.get(group)
        if known is None or (
            process_group is not None and (known[1] is None or known[1]() is not process_group)
        ):
            # The first, or one on a replaced group.
            self._verdicts[group] = (error, None if process_group is None else weakref.ref(process_group))

    def verdict(self, group: str) -> BaseException | None:
        """The fatal verdict on ``group``, if a watch reached one."""
        found = self._verdicts.get(group)
        return None if found is None else found[0]

    def set_explainer(self, group: str, explain: Callable[[BaseException], None] | None) -> None:
        """Have ``explain(error)`` called first when a wait on ``group`` fails
        (it may set the verdict at once); None removes it."""
        if explain is None:
            self._explainers.pop(group, None)
        else:
            self._explainers[group] = explain

    def clear_verdict(self, group: str) -> None:
        """Forget ``group``'s verdict (its watch ended, the group is being replaced)."""
        self._verdicts.pop(group, None)

    # Called by the wrappers.

    def _begin(
        self,
        group: dist.ProcessGroup,
        op: str,
        tensors: Sequence[torch.Tensor],
        dtypes_only: bool,
        caller: FrameType,
    ) -> CollectiveRecord:
        known = self._groups.get(id(group))
        if known is None:
            with self._lock:  # two threads' first collectives on a group: one numbering
                known = self._groups.get(id(group))
                if known is None:
                    known = self._groups[id(group)] = (group.group_name, itertools.count(1))
                    weakref.finalize(group, self._groups.pop, id(group), None)
        name = known[0]
        verdict = self._verdicts.get(name)
        if verdict is not None:
            if verdict[1] is None or verdict[1]() is group:
                raise verdict[0]
            self._verdicts.pop(name, None)  # on a group that was replaced by this one
        code, offset, function = _user_frame(caller)
        if len(tensors) == 1:  # the common case, without the generators
            tensor = tensors[0]
            shapes: tuple[tuple[int, ...], ...] = () if dtypes_only else (tuple(tensor.shape),)
            dtypes: tuple[str, ...] = (_DTYPE_NAMES.get(tensor.dtype) or _dtype_name(tensor.dtype),)
        else:
            shapes = () if dtypes_only else tuple(tuple(t.shape) for t in tensors)
            dtypes = tuple(_DTYPE_NAMES.get(t.dtype) or _dtype_name(t.dtype) for t in tensors)
        record = CollectiveRecord(
            next(known[1]), op, name, shapes, dtypes, time.time(), None, None, code, offset, function
        )
        self._records.append(record)
        return record

    def _issued(self, work: Any, record: CollectiveRecord) -> None:
        if work is None:  # the backend completed it in the call
            record.ended = time.time()
            return
        kind = type(work)
        if kind not in self._work_types:
            self._work_types.add(kind)
            _see_waits_of(self, kind)
        pending = self._pending
        pending[id(work)] = (work, record)
        if len(pending) > self._sweep_at:
            self._sweep()
            # Works nobody waits on and whose backend never says they completed:
            # forgotten, oldest first, so neither memory nor the sweep grows.
            for key in list(itertools.islice(pending, max(0, len(pending) - self._capacity))):
                pending.pop(key, None)
            self._sweep_at = max(_SWEEP_AT, 2 * len(pending))

    def _waited(self, work: Any, error: BaseException | None) -> None:
        entry = self._pending.pop(id(work), None)
        if entry is not None and entry[0] is work:
            entry[1].ended = time.time()
            if error is not None:
                entry[1].failed = f"{type(error).__name__}: {error}"[:500]

    def _sweep(self) -> None:
        now = time.time()
        for key, (work, record) in list(self._pending.items()):
            try:
                done = work.is_completed()
            except Exception:  # noqa: BLE001 - a work torch already released
                done = True
            if done:
                self._pending.pop(key, None)
                record.ended = record.ended or now


_recorder: CollectiveRecorder | None = None
_install_lock = threading.Lock()
_DTYPE_NAMES: Final[dict[torch.dtype, str]] = {}
# Keyed by id(code), the code kept beside its answer so the id is not reused:
# hashing a code object hashes its bytecode and constants, every time.
_internal_code: dict[int, tuple[CodeType, bool]] = {}
_internal_dirs: list[str] = []
_TORCH_DIRS: list[int] = [0]  # how many of _internal_dirs are torch's
_torch_code: dict[int, tuple[CodeType, bool]] = {}
#: Past this many code objects (code made at run time, one per call), a cache starts again.
_CODE_CACHE_LIMIT: Final = 50_000


def recorder() -> CollectiveRecorder | None:
    """The process's recorder, or None until :func:`record_collectives` was called."""
    return _recorder


def record_collectives(capacity: int = DEFAULT_CAPACITY) -> CollectiveRecorder:
    """Start recording every collective of this process (once; later calls
    return the same recorder). ``Join`` and our DDP, ZeRO and FSDPJoinable
    call it; a plain torch script calls it once after
    ``init_process_group``, or :func:`join_core.watch_collectives` for hang
    reports and desync errors too.

    Args:
        capacity: how many collectives to keep (the first call's value holds).
    """
    global _recorder
    with _install_lock:
        if _recorder is not None:
            return _recorder
        if capacity < 1:
            raise ValueError(f"record_collectives(capacity={capacity}): must be at least 1")
        if not _internal_dirs:
            _internal_dirs.extend(_package_dirs())
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32):
            _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
        rec = CollectiveRecorder(capacity)
        issue = _Issuer(rec)
        methods = issue.methods
        process_group: Any = dist.ProcessGroup
        for method, (op, positions) in _METHODS.items():
            original = getattr(process_group, method, None)
            if original is not None:
                methods[method] = (original, op, positions)
                setattr(process_group, method, _wrap_collective(issue, original, method, op))
        handoff.set_issuer(issue)
        work_class: Any = dist.Work
        work_class.wait = _wrap_wait(rec, work_class.wait)
        _recorder = rec
        return rec


class _Issuer:
    """How a call is issued: recorded, then passed to the original method."""

    def __init__(self, rec: CollectiveRecorder) -> None:
        self.rec = rec
        self.methods: dict[str, tuple[Callable[..., Any], str, tuple[int, ...] | None]] = {}

    def __call__(
        self,
        group: dist.ProcessGroup,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        caller: FrameType,
    ) -> Any:
        original, op, positions = self.methods[method]
        if not self.rec.enabled:
            return original(group, *args, **kwargs)
        # All-to-all: split sizes may differ per rank, so only the dtype is compared.
        tensors = _tensors([args[i] for i in positions if i < len(args)] if positions else args[:1])
        record = self.rec._begin(group, op, tensors, positions is None, caller)
        try:
            work = original(group, *args, **kwargs)
        except BaseException as error:
            record.ended, record.failed = time.time(), f"{type(error).__name__}: {error}"[:500]
            raise
        self.rec._issued(work, record)
        return work


def _wrap_collective(
    issue: Callable[[dist.ProcessGroup, str, tuple[Any, ...], dict[str, Any], FrameType], Any],
    original: Callable[..., Any],
    method: str,
    op: str,
) -> Callable[..., Any]:
    getframe = sys._getframe
    handlers = handoff.handlers
    new = tuple.__new__  # a NamedTuple's own constructor costs a microsecond more

    def collective(self: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        if handlers:
            handler = handlers.get(self)
            if handler is not None:
                return handler(new(handoff.Call, (op, method, self, args, kwargs, getframe(1), issue)))
        return issue(self, method, args, kwargs, getframe(1))

    collective.__name__ = collective.__qualname__ = original.__name__
    collective.__doc__ = original.__doc__
    collective.__wrapped__ = original  # type: ignore[attr-defined]
    return collective


def _wrap_wait(rec: CollectiveRecorder, original: Callable[..., Any]) -> Callable[..., Any]:
    def wait(self: dist.Work, *args: Any, **kwargs: Any) -> Any:
        entry = rec._pending.get(id(self))  # before: a sweep may take a failed work out meanwhile
        try:
            result = original(self, *args, **kwargs)
        except Exception as error:
            rec._waited(self, error)
            group = entry[1].group if entry is not None else _only_watched_group()
            if group is not None:
                explain = rec._explainers.get(group)
                if explain is not None:
                    with contextlib.suppress(Exception):  # only a faster verdict; the watch judges anyway
                        explain(error)
                verdict = _await_verdict(rec, group)
                if verdict is not None:
                    raise verdict from error
            raise
        rec._waited(self, None)
        return result

    wait.__name__ = wait.__qualname__ = "wait"
    wait.__doc__ = original.__doc__
    wait.__wrapped__ = original  # type: ignore[attr-defined]
    return wait


def _see_waits_of(rec: CollectiveRecorder, kind: type) -> None:
    """Make ``kind.wait()`` report to ``rec`` when ``kind`` (a backend's own
    ``Work``, torch's fake one) defines its own, which ``Work.wait``'s wrapper
    does not see; a class that refuses is left to the sweep."""
    own = kind.__dict__.get("wait")
    if own is None or getattr(own, "__wrapped__", None) is not None:
        return
    with contextlib.suppress(TypeError, AttributeError):
        kind.wait = _wrap_wait(rec, own)  # type: ignore[attr-defined]


def _only_watched_group() -> str | None:
    groups = [group for group, count in _watched_groups.items() if count > 0]
    return groups[0] if len(groups) == 1 else None


def _await_verdict(rec: CollectiveRecorder, group: str) -> BaseException | None:
    """A failed collective most often failed because a watch acted on a
    verdict (it shuts the connections down): give it a moment to be set."""
    deadline = time.monotonic() + VERDICT_GRACE_S
    while True:
        verdict = rec.verdict(group)
        if verdict is not None or time.monotonic() > deadline or not _watched(group):
            return verdict
        time.sleep(0.05)


_watched_groups: dict[str, int] = {}
_watched_lock = threading.Lock()


def _watched(group: str) -> bool:
    return _watched_groups.get(group, 0) > 0


def watching(group: str, delta: int) -> None:
    """Count a watch of ``group`` starting (+1) or ending (-1); while none
    watches it, a failed collective waits for no verdict."""
    with _watched_lock:  # a Join's watch ends on its own thread while the next one's starts
        _watched_groups[group] = _watched_groups.get(group, 0) + delta


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensors(values: Sequence[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += _tensors(value)
    return found


def _package_dirs() -> list[str]:
    dirs: list[str] = []
    for name in _INTERNAL_PACKAGES:
        if name == "join_core":
            _TORCH_DIRS[0] = len(dirs)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            dirs += [os.path.join(os.path.realpath(p), "") for p in spec.submodule_search_locations]
        elif spec.origin:
            dirs.append(os.path.realpath(spec.origin))
    return dirs


def is_torch(code: CodeType) -> bool:
    """Whether ``code`` is torch's (or a decorator's torch uses)."""
    known = _torch_code.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    if not _internal_dirs:
        _internal_dirs.extend(_package_dirs())
    path = os.path.realpath(code.co_filename)
    found = any(path.startswith(d) for d in _internal_dirs[: _TORCH_DIRS[0]])
    if len(_torch_code) > _CODE_CACHE_LIMIT:
        _torch_code.clear()
    _torch_code[id(code)] = (code, found)
    return found


def is_internal(code: CodeType) -> bool:
    """Whether ``code`` is torch's or ours, not the user's."""
    known = _internal_code.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    path = code.co_filename
    if not _internal_dirs:
        _internal_dirs.extend(_package_dirs())
    found = path.startswith("<") or any(os.path.realpath(path).startswith(d) for d in _internal_dirs)
    if len(_internal_code) > _CODE_CACHE_LIMIT:
        _internal_code.clear()
    _internal_code[id(code)] = (code, found)
    return found


def _user_frame(frame: FrameType | None) -> tuple[CodeType | None, int, str]:
    """The first frame outside torch and our packages: its code, instruction and function."""
    first = frame
    known = _internal_code
    while frame is not None:
        code = frame.f_code
        seen = known.get(id(code))
        if not (seen[1] if seen is not None and seen[0] is code else is_internal(code)):
            return code, frame.f_lasti, code.co_name
        frame = frame.f_back
    if first is not None:
        return first.f_code, first.f_lasti, first.f_code.co_name
    return None, 0, ""


def _site(code: CodeType | None, offset: int) -> str:
    if code is None:
        return "?"
    line = code.co_firstlineno
    for start, end, number in code.co_lines():
        if start <= offset < end and number is not None:
            line = number
            break
    return f"{os.path.basename(code.co_filename)}:{line} {code.co_name}()"
