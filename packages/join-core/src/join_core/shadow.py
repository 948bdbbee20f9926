"""ShadowCollectives: a joined rank shadows the collectives no joinable owns.

SyncBatchNorm's statistics, a loss all-reduced for logging, a layer that
syncs its own state: collectives issued on the Join's process group by code
that is no joinable. While the Join is entered, :mod:`join_core.intercept`
shows this module every collective on that group. A training rank records
the sequence of one iteration (from one ``notify_join_context`` of the first
joinable to the next); once it has joined, it replays its last iteration with
neutral contributions, slotting each op in where the training ranks issue it:
before each collective the other joinables' hooks issue, it first issues the
recorded ones that come before that one.

Healthy iterations issue nothing extra: recording is local. From the moment
the training ranks learn that a rank joined (the first heartbeat counting
fewer than all ranks), every rank checks each collective on the group with a
small all-gather of its fingerprint, so a sequence that changes raises
:class:`CollectiveMismatchError` on every rank, naming the ops that differ.

A collective is placed in the recorded sequence by its name, tensors and
call site. A joinable whose collectives torch issues from wherever the user
calls it (FSDP2's, from the model's forward and the loss's backward) replays
them from its own hook, another call site: it marks them with
:class:`OwnedCollectives`, and they are matched by their owner instead.
"""

from __future__ import annotations

import os
import zlib
from contextlib import AbstractContextManager
from types import CodeType, FrameType
from typing import Any, Final, NamedTuple

import torch
import torch.distributed as dist

from join_core import intercept
from join_core.hook import JoinHook
from join_core.join import Join, _lookup
from join_core.recorder import is_torch

__all__ = ["CollectiveMismatchError", "OwnedCollectives", "ShadowCollectives"]

# The file name Join's own collectives are issued from, as its code objects carry it.
_JOIN_FILE: Final = Join.notify_join_context.__code__.co_filename
# The ops that can be shadowed, by ProcessGroup method.
_SHADOWABLE: Final = {
    "allreduce": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "all_gather",
    "all_gather_single": "all_gather_into_tensor",
    "_allgather_base": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "gather": "gather",
    "scatter": "scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all_single",
    "alltoall_base": "all_to_all_single",
    "barrier": "barrier",
}
_KINDS: Final = [*sorted(set(_SHADOWABLE.values())), "other"]
_DTYPES: Final = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_ROLES: Final = ("training", "joined", "failing")
# The check's fields: fingerprint, kind, elements, dtype, role, status.
_FIELDS: Final = 6
_OK, _CANNOT_SHADOW, _NOT_RECORDED, _OWNED = 0, 1, 2, 3
# Comparing ReduceOps costs more than recording the rest: the common one by identity.
_SUM: Final = dist.ReduceOp.SUM
_AVG: Final = dist.ReduceOp.AVG

_Spec = tuple[torch.Size, torch.dtype, torch.device]
#: The owner of the collectives issued now on each process group, and whether
#: only those of a backward pass are its (see OwnedCollectives).
_owners: dict[dist.ProcessGroup, tuple[str, bool]] = {}

# Public in torch.distributed.distributed_c10d, though its stubs do not re-export it.
AllgatherOptions: Any = dist.distributed_c10d.AllgatherOptions  # type: ignore[attr-defined]


class CollectiveMismatchError(dist.DistError):
    """The ranks' collectives on a Join's process group stopped matching while
    a rank shadowed them, or a collective cannot be shadowed.

    Raised on every rank of the group at the same collective once the
    training ranks check (``on_every_rank``); before they do, on the joined
    rank alone, whose Join then tells the others through the store (they
    raise ``RankLostError`` naming it and this error).

    Attributes:
        on_every_rank: whether every rank of the group raises it.
    """

    def __init__(self, message: str, on_every_rank: bool = True) -> None:
        super().__init__(message)
        self.on_every_rank = on_every_rank


class _Op(NamedTuple):
    """One recorded collective: enough to match it and to issue it with neutral data."""

    name: str  # as torch.distributed names it
    method: str  # the ProcessGroup method it was issued with
    specs: tuple[_Spec, ...]
    reduce_op: Any  # a ReduceOp, or None
    root: int | None  # the source or destination, a rank of the group
    # The caller's code and instruction; (None, 0) for Join's own collectives;
    # (None, -1) for those of a thread running torch's code alone (autograd's
    # device threads); (owner, 0) for those of an OwnedCollectives.
    origin: tuple[CodeType | str | None, int]
    options: Any  # the options object it was issued with
    splits: tuple[list[int], list[int]] | None  # an all-to-all's output and input split sizes


class OwnedCollectives:
    """Marks the collectives a joinable issues itself on a joined rank but
    cannot issue from one place: those torch issues on its behalf, from
    wherever the user calls the model (FSDP2's all-gathers in the forward,
    reduce-scatters in the backward).

    :class:`ShadowCollectives` places a collective in a rank's recorded
    iteration by its call site, and a joined rank's hook replays the
    joinable's collectives from another one (the hook). Collectives issued on
    ``process_group`` between :meth:`begin` and :meth:`end` (from any
    thread) are matched by ``owner`` instead, are left to the joinable's hook
    on a joined rank (never issued again with neutral data), and may use any
    reduce op (``ReduceOp.AVG`` too: the hook knows its divisor). Begin and
    end at the same points of an iteration on a training rank and in the
    hook on a joined one::

        owned = OwnedCollectives("MyJoinable", group)
        with owned:  # or owned.begin() ... owned.end() in a module's hooks
            model(x)

    ``begin(backward=True)`` after the forward claims only the collectives
    a backward pass issues (autograd's hooks: FSDP's gradient
    reduce-scatters), so that those the loop issues between the forward and
    the backward (a loss all-reduced for logging) are still the loop's.

    Without a :class:`ShadowCollectives` on the group, marking costs a
    dictionary write and changes nothing.

    Args:
        owner: the name the collectives are matched (and reported) by.
        process_group: the group of the collectives (default: the world).
    """

    def __init__(self, owner: str, process_group: dist.ProcessGroup | None = None) -> None:
        if not owner:
            raise ValueError("OwnedCollectives(owner=''): name the joinable that owns the collectives")
        if process_group is None:
            process_group = dist.group.WORLD
        assert process_group is not None, "the default process group is not initialized"
        self.owner: str = owner
        self.process_group: dist.ProcessGroup = process_group

    def begin(self, backward: bool = False) -> None:
        """From now on the group's collectives are the owner's (with
        ``backward=True``: those issued inside a backward pass)."""
        _owners[self.process_group] = (self.owner, backward)

    def end(self) -> None:
        """From now on the group's collectives are matched by call site again."""
        owned = _owners.get(self.process_group)
        if owned is not None and owned[0] == self.owner:
            del _owners[self.process_group]

    def __enter__(self) -> OwnedCollectives:
        self.begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


class ShadowCollectives:
    """A Joinable that makes a joined rank shadow the collectives no other
    joinable owns: those of SyncBatchNorm, of metric syncs in the loop, of any
    layer, on the Join's process group.

    Put it last in the list; nothing else in the loop changes::

        with Join([model, ShadowCollectives()]):
            for x, y in batches:                 # fewer on some ranks
                loss = loss_fn(model(x), y)      # the model may all-reduce inside
                loss.backward(); optimizer.step()
                dist.all_reduce(stats)           # a metric sync in the loop

    A joined rank contributes a neutral value to each: 0 to a SUM, the
    identity to MIN, MAX, PRODUCT and the bitwise ops, zeros to an all-gather
    (SyncBatchNorm then counts no samples for it); it receives into scratch
    buffers, so its own tensors are untouched. Supported: ``all_reduce``,
    ``broadcast``, ``reduce``, ``all_gather``, ``all_gather_into_tensor``,
    ``reduce_scatter``, ``reduce_scatter_tensor``, ``gather``, ``scatter``,
    ``all_to_all``, ``all_to_all_single`` and ``barrier``, however they are
    called (``dist.all_reduce``, a function imported by name, ``async_op=True``
    with its ``Work`` waited on later). ``ReduceOp.AVG`` cannot be shadowed
    (the joined rank would count in the divisor), nor a broadcast or scatter
    from a rank that joined, nor the coalesced variants.

    How it works: while the Join is entered, the collectives of its group are
    handed to it at the ``ProcessGroup`` methods every call reaches, from any
    thread; other groups' pass straight on (:mod:`join_core.intercept`). A training rank records one
    iteration's sequence locally; a joined rank replays its last iteration.
    The sequence must be the same every iteration while a rank has joined:
    once the training ranks know of the join, each collective on the group is
    preceded by a small all-gather that compares the ranks' ops, and a
    difference raises :class:`CollectiveMismatchError` on every rank. A rank
    that runs out before its first iteration has nothing to replay: it still
    shadows the other joinables, and a collective of the loop raises.

    Args:
        process_group: the group to shadow, that of the other joinables
            (default: the world).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ShadowCollectives: the default process group is not initialized; "
                "call torch.distributed.init_process_group() first"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None
        self.process_group: dist.ProcessGroup = group
        self._context: AbstractContextManager[None] | None = None

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that starts and stops shadowing with the Join."""
        return _ShadowHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the checks' tensors (Join uses the first joinable's,
        and this one is never first)."""
        if dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The process group whose collectives are shadowed."""
        return self.process_group

    def _enter(self) -> None:
        found = _lookup(self)
        assert found is not None, "enter_hook runs inside an entered Join"
        if found[1]:
            raise ValueError(
                "Join(joinables[0]=ShadowCollectives): it cannot be first, it issues no heartbeat; "
                "put it after the joinables, e.g. Join([model, ShadowCollectives()])"
            )
        shadowing = _Shadowing(self, found[0])
        context = intercept.intercept(self.process_group, shadowing.handle)
        context.__enter__()
        self._context = context

    def _exit(self) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)


class _ShadowHook(JoinHook):
    """Shadowing happens inside the other hooks' collectives and between them,
    so the per-iteration hooks have nothing of their own to issue."""

    def __init__(self, shadow: ShadowCollectives) -> None:
        self.shadow = shadow

    def enter_hook(self) -> None:
        self.shadow._enter()

    def exit_hook(self) -> None:
        self.shadow._exit()


class _Shadowing:
    """The state of one entered Join: recording on a training rank, replaying
    on a joined or failing one.

    It reads the Join's progress from its attributes, as a part of the same
    package: through the public static methods it would cost a few
    microseconds per collective of a healthy step."""

    def __init__(self, shadow: ShadowCollectives, join: Join) -> None:
        self.shadow = shadow
        self.join = join
        self.group = shadow.process_group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = shadow.join_device
        self.stopped = False  # after a mismatch, or once nothing is left to shadow
        # Recording: the iteration in progress and the last complete one, each
        # with the position of the first op after its heartbeat (None: none yet).
        self.iteration = 0
        self.current: list[_Op] = []
        self.current_heartbeat: int | None = None
        self.last: list[_Op] = []
        self.last_heartbeat: int | None = None
        # Replaying.
        self.replaying = False
        self.cycle: list[_Op] = []
        self.cursor = 0  # position in cycle of the next op
        self.step = 0  # ops replayed or matched, counted from the cycle's start
        self.switch_at = 0  # step from which the training ranks know this rank joined
        self.base_checking = False
        self.joined = False
        self.heartbeats_at_join = 0

    def handle(self, call: intercept.Call) -> Any:
        # Every collective of a healthy step comes through here, after a
        # backward pass has left the caches cold: the training path is kept
        # to a few lines, with one call of its own.
        join = self.join
        total = join._last_total
        if self.stopped or (total is not None and total <= 0):
            # After a mismatch; or every rank has joined, or a rank failed: no iterations left.
            return call.proceed()
        if join._signal() <= 0:
            return self._replay(call, total)
        iteration = join._iterations
        if iteration != self.iteration:
            if self.iteration > 0:
                self.last, self.last_heartbeat = self.current, self.current_heartbeat
            self.iteration = iteration
            self.current, self.current_heartbeat = [], None
        if self.current_heartbeat is None and 0 < iteration <= join._reported:
            self.current_heartbeat = len(self.current)  # this iteration's heartbeat arrived
        op = _op_of(call)
        reduce_op = op.reduce_op
        if reduce_op is not None and reduce_op is not _SUM and reduce_op == _AVG and not _owned(op):
            raise ValueError(
                f"{_describe(op)}: ShadowCollectives cannot shadow ReduceOp.AVG (a joined rank would "
                "count in the divisor); all-reduce with ReduceOp.SUM and divide by the ranks that took part"
            )
        if total is not None and total < self.world_size:
            self._check(op, _OK, "training")
        self.current.append(op)
        return call.proceed()

    # Joined or failing.

    def _start_replay(self, total: float | None) -> None:
        self.replaying = True
        self.joined = self.join._signal() == 0
        if self.joined:
            # Its body ended after a whole iteration: replay that one, from the start.
            cycle = self.current if self.iteration > 0 else []
            heartbeat, start = self.current_heartbeat, 0
        else:
            # Failed inside an iteration: go on from where it stopped in the last whole one.
            cycle, heartbeat = self.last, self.last_heartbeat
            start = len(self.current) % len(cycle) if cycle else 0
        self.cycle = cycle
        self.cursor = start
        self.step = start
        at = len(cycle) if heartbeat is None else heartbeat
        self.switch_at = at if at >= start else at + len(cycle)
        self.base_checking = total is not None and total < self.world_size
        self.heartbeats_at_join = self.join._reported

    def _checking(self, step: int) -> bool:
        # Until the training ranks see the heartbeat that counts this rank out,
        # they check only if an earlier join made them.
        if self.base_checking:
            return True
        if not self.cycle:
            # Nothing recorded: its own hooks tell when that heartbeat went by.
            return self.joined and self.join._reported > self.heartbeats_at_join
        return self.joined and step >= self.switch_at

    def _replay(self, call: intercept.Call, total: float | None) -> Any:
        if not self.replaying:
            self._start_replay(total)
        role = "joined" if self.joined else "failing"
        op = _op_of(call)
        ahead = self._find(op)
        if ahead is not None:
            for offset in range(ahead):
                self._issue_neutral(
                    self.cycle[(self.cursor + offset) % len(self.cycle)], self.step + offset, role
                )
            step = self.step + ahead
            self.cursor = (self.cursor + ahead + 1) % len(self.cycle)
            self.step += ahead + 1
        else:
            step = self.step
        if self._checking(step):
            self._check(op, _OK if self.cycle or self.iteration > 0 else _NOT_RECORDED, role)
        return call.proceed()

    def _find(self, op: _Op) -> int | None:
        """How many recorded ops come before ``op``'s place in the cycle."""
        size = len(self.cycle)
        for ahead in range(size):
            recorded = self.cycle[(self.cursor + ahead) % size]
            if recorded.name == op.name and recorded.specs == op.specs and recorded.origin == op.origin:
                return ahead
        return None

    def _issue_neutral(self, op: _Op, step: int, role: str) -> None:
        sources = op.name in ("broadcast", "scatter") or op.name not in _SHADOWABLE.values()
        status = (
            _CANNOT_SHADOW
            if sources and (op.root == self.rank or op.root is None) and op.name != "barrier"
            else _OK
        )
        if _owned(op):
            status = _OWNED  # its owner's hook issues it, and did not this time
        if self._checking(step):
            self._check(op, status, role)
        if status == _OWNED:
            self.stopped = True
            raise CollectiveMismatchError(
                f"ShadowCollectives: rank {self.rank} ({role}) skipped {_describe(op)}: "
                f"{op.origin[0]}'s hook on this rank did not issue it where its last iteration did; "
                f"{op.origin[0]} must issue the same collectives every iteration",
                on_every_rank=False,
            )
        if status != _OK:
            self.stopped = True
            raise CollectiveMismatchError(
                f"ShadowCollectives: rank {self.rank} ({role}) cannot shadow {_describe(op)}: it is the "
                "source of the data; take it from a rank that is still training",
                on_every_rank=False,
            )
        _neutral_call(op, self.group, self.rank, self.world_size)

    # Both.

    def _check(self, op: _Op, status: int, role: str) -> None:
        """Compare this collective with the other ranks'; raise on every rank if they differ."""
        mine = torch.tensor(
            [
                _fingerprint(op),
                _KINDS.index(op.name),
                _numel(op),
                _dtype_index(op),
                _ROLES.index(role),
                status,
            ],
            dtype=torch.int64,
            device=self.device,
        )
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        intercept.issue(self.group, "allgather", [rows], [mine], AllgatherOptions()).wait()
        values = [tuple(int(v) for v in row.tolist()) for row in rows]
        if all(v[:4] == values[0][:4] and v[5] not in (_CANNOT_SHADOW, _OWNED) for v in values):
            return
        self.stopped = True
        raise CollectiveMismatchError(_mismatch_message(self.rank, op, values))


def _spec(tensor: torch.Tensor) -> _Spec:
    return (tensor.shape, tensor.dtype, tensor.device)


def _origin(frame: FrameType | None) -> tuple[CodeType | None, int]:
    """The first frame outside torch that issued a collective; (None, 0) for Join's
    own, (None, -1) where the thread runs torch's code alone."""
    while frame is not None and is_torch(frame.f_code):
        frame = frame.f_back
    if frame is None:
        return (None, -1)  # on CUDA, autograd runs a backward on a thread of its own
    code = frame.f_code
    # Join's heartbeat comes from one place on a training rank, another on a joined one.
    return (None, 0) if code.co_filename == _JOIN_FILE else (code, frame.f_lasti)


def _owned(op: _Op) -> bool:
    return isinstance(op.origin[0], str)


def _op_of(call: intercept.Call) -> _Op:
    name, method, group, args, kwargs, caller, _ = call
    origin: tuple[CodeType | str | None, int] = _origin(caller)
    if _owners and (origin[0] is not None or origin[1]):  # Join's own heartbeats stay Join's
        owned = _owners.get(group)
        if owned is not None and (not owned[1] or torch._C._current_graph_task_id() != -1):
            origin = (owned[0], 0)
    if kwargs or name not in _SHADOWABLE.values():
        return tuple.__new__(_Op, ("other", method, (), None, None, origin, None, None))
    if method == "allreduce":  # the common one, without the general look-ups
        tensors, options = args
        specs: tuple[_Spec, ...] = tuple((t.shape, t.dtype, t.device) for t in tensors)
        return tuple.__new__(_Op, (name, method, specs, options.reduceOp, None, origin, options, None))
    options = args[-1]
    reduce_op = getattr(options, "reduceOp", None)
    root = getattr(options, "rootRank", None)
    splits = None
    if method in ("broadcast", "reduce", "alltoall"):
        specs = tuple(_spec(t) for t in (*args[0], *(args[1] if method == "alltoall" else ())))
    elif method == "allgather":
        specs = (*(_spec(t) for t in args[0][0]), _spec(args[1][0]))
    elif method == "reduce_scatter":
        specs = (_spec(args[0][0]), *(_spec(t) for t in args[1][0]))
    elif method == "gather":
        specs = (_spec(args[1][0]),)
    elif method == "scatter":
        specs = (_spec(args[0][0]),)
    elif method == "barrier":
        specs = ()
    else:  # one output and one input tensor, and for all-to-all their split sizes
        specs = (_spec(args[0]), _spec(args[1]))
        if name == "all_to_all_single":
            splits = (list(args[2]), list(args[3]))
    return tuple.__new__(_Op, (name, method, specs, reduce_op, root, origin, options, splits))


def _line(op: _Op) -> tuple[str, int]:
    """The file name and line an op is issued from (derived here: a frame's
    line number costs more than the rest of recording)."""
    code, offset = op.origin
    if code is None:
        return ("torch", 0) if offset else ("join", 0)
    if isinstance(code, str):
        return (code, 0)
    line = code.co_firstlineno
    for start, end, number in code.co_lines():
        if start <= offset < end and number is not None:
            line = number
            break
    return (os.path.basename(code.co_filename), line)


def _neutral_value(reduce_op: Any, dtype: torch.dtype) -> float | int | bool:
    ops = dist.ReduceOp
    # The options' ReduceOp on the left: a RedOpType does not compare equal to a ReduceOp.
    if reduce_op is None or any(reduce_op == o for o in (ops.SUM, ops.BOR, ops.BXOR)):
        return 0
    if reduce_op == ops.PRODUCT:
        return 1
    if reduce_op == ops.BAND:
        return True if dtype == torch.bool else -1
    high = bool(reduce_op == ops.MIN)
    if dtype == torch.bool:
        return high
    if dtype.is_floating_point:
        return float("inf") if high else float("-inf")
    info = torch.iinfo(dtype)
    return int(info.max if high else info.min)


def _neutral_call(op: _Op, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
    """Issue ``op`` with this rank's neutral contribution, into scratch buffers, and wait for it."""

    def filled(spec: _Spec) -> torch.Tensor:
        return torch.full(spec[0], _neutral_value(op.reduce_op, spec[1]), dtype=spec[1], device=spec[2])

    def scratch(spec: _Spec) -> torch.Tensor:
        return torch.empty(spec[0], dtype=spec[1], device=spec[2])

    options = type(op.options)()
    for field in ("reduceOp", "rootRank", "rootTensor"):
        if hasattr(op.options, field):
            setattr(options, field, getattr(op.options, field))
    method, specs = op.method, op.specs
    args: tuple[Any, ...]
    if method in ("allreduce", "reduce"):
        args = ([filled(s) for s in specs],)
    elif method == "broadcast":
        args = ([scratch(s) for s in specs],)
    elif method == "allgather":
        args = ([[scratch(s) for s in specs[:-1]]], [filled(specs[-1])])
    elif method == "reduce_scatter":
        args = ([scratch(specs[0])], [[filled(s) for s in specs[1:]]])
    elif method == "gather":
        args = (
            [[scratch(specs[0]) for _ in range(world_size)]] if op.root == rank else [],
            [filled(specs[0])],
        )
    elif method == "scatter":
        args = ([scratch(specs[0])], [])
    elif method == "alltoall":
        half = len(specs) // 2
        args = ([scratch(s) for s in specs[:half]], [filled(s) for s in specs[half:]])
    elif method == "barrier":
        args = ()
    else:
        args = (scratch(specs[0]), filled(specs[1]))
        if op.splits is not None:
            args += (op.splits[0], op.splits[1])
    work = intercept.issue(group, method, *args, options)
    if work is not None:
        work.wait()


def _fingerprint(op: _Op) -> int:
    shapes = [(tuple(shape), str(dtype)) for shape, dtype, _ in op.specs]
    where = _line(op)
    return zlib.crc32(repr((op.name, shapes, _reduce_name(op.reduce_op), op.root, op.splits, where)).encode())


def _reduce_name(reduce_op: Any) -> str | None:
    """``SUM``, ``MAX``, ...: a ReduceOp object's repr names no op."""
    if reduce_op is None:
        return None
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        known = getattr(dist.ReduceOp, name, None)
        if known is not None and reduce_op == known:
            return name
    return "custom"


def _numel(op: _Op) -> int:
    return sum(spec[0].numel() for spec in op.specs)


def _dtype_index(op: _Op) -> int:
    if not op.specs:
        return -1
    dtype = op.specs[-1][1]
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _describe(op: _Op) -> str:
    tensors = ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for shape, dtype, _ in op.specs)
    extra = ""
    if op.reduce_op is not None:
        extra += f", op={_reduce_name(op.reduce_op)}"
    if op.root is not None:
        key = "src" if op.name in ("broadcast", "scatter") else "dst"
        extra += f", {key}={op.root}"
    file, line = _line(op)
    if op.origin[0] is None:
        where = "torch's own thread (no caller outside torch)" if op.origin[1] else "Join's heartbeat"
    elif isinstance(op.origin[0], str):
        where = f"{file}'s own collectives"
    else:
        where = f"{file}:{line}"
    return f"{op.name}({tensors}{extra}) at {where}"


def _mismatch_message(rank: int, op: _Op, rows: list[tuple[int, ...]]) -> str:
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, row in enumerate(rows):
        groups.setdefault(row[:4] + row[5:], []).append(r)
    parts = []
    for key, ranks in groups.items():
        fingerprint, kind, numel, dtype, status = key
        roles = sorted({_ROLES[rows[r][4]] for r in ranks})
        dtype_name = str(_DTYPES[dtype]).removeprefix("torch.") if dtype >= 0 else "no"
        what = f"{_KINDS[kind]} of {numel} {dtype_name} elements (fingerprint {fingerprint:08x})"
        if status == _CANNOT_SHADOW:
            what += ", which they cannot shadow: they are its source"
        elif status == _OWNED:
            what += ", which they left to its owner's hook, and it did not issue it"
        elif status == _NOT_RECORDED:
            what += ", having recorded no iteration before joining"
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {', '.join(map(str, ranks))} ({'/'.join(roles)}): {what}")
    return (
        "ShadowCollectives: the ranks' collectives on the Join's process group differ, so the ranks that "
        f"joined cannot shadow them. At this collective, {'; '.join(parts)}. Rank {rank} issues "
        f"{_describe(op)}. A joined rank replays the collectives of its last iteration: issue the same "
        "collectives every iteration, put those that vary on another process group, or use "
        "Join(..., throw_on_early_termination=True)"
    )
