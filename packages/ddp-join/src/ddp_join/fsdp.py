"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under Join.

A rank that runs out of inputs replays the last forward and backward on an
empty slice of the last input, with the loss multiplied by zero: FSDP issues
the same all-gathers and reduce-scatters as on the ranks still training, the
joined rank adds nothing to the reduced gradient, and it steps its own shard
with that gradient, so every shard stays current.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final, TypeAlias

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ddp_join._groups import all_gather_bytes
from join_core import Join, JoinHook, OwnedCollectives, install_exit_grace, record_collectives

__all__ = ["FSDPJoinable"]

# Empty slices of the last forward's positional and keyword arguments, and
# whether it ran with grad enabled (a training iteration) or not (evaluation).
_Input: TypeAlias = tuple[tuple[Any, ...], dict[str, Any], bool]

#: The longest input description (JSON) a rank with no batch accepts from a peer.
_MAX_DESCRIPTION: Final = 1 << 20

#: The heartbeat's slots: Join's signal, and the number of joined ranks
#: that never ran a forward in this Join and need a peer's input to replay.
_SIGNAL: Final = 0
_NEEDS_INPUT: Final = 1


class FSDPJoinable:
    """Makes a model sharded with ``fully_shard`` a :class:`join_core.Joinable`.

    The training loop is unchanged: a forward pre-hook on ``module`` sends
    Join's heartbeat (one two-element all-reduce before FSDP's first
    all-gather of the iteration, bounded by the process group's timeout), and
    its result is handed to Join once the iteration's collectives are done:
    at the end of the backward (or, after a forward without one, at the next
    forward or optimizer step), so that with ``throw_on_early_termination``
    every rank raises between the same two collectives, also when the
    forward and backward run inside ``optimizer.step(closure)``. Put it first
    among the Join's joinables: it carries the heartbeat. FSDP's collectives
    are marked as this joinable's (:class:`join_core.OwnedCollectives`), so
    a :class:`join_core.ShadowCollectives` in the same Join shadows the
    loop's other collectives (a loss all-reduced for logging) around them. A rank that has joined runs, per iteration
    of the ranks still training: the heartbeat, ``optimizer.zero_grad()``,
    the forward of ``module`` on an empty slice (batch size 0) of its last
    input, ``backward()`` of the output's sum times zero, the gradient clips
    of its own last iteration (:meth:`clip_grad_norm_`,
    :meth:`clip_grad_value_`: use them instead of torch's), and
    ``optimizer.step()``. FSDP issues the same all-gathers and reduce-scatters
    as on the training ranks; the joined rank's gradient adds nothing, and its
    shard is stepped with the reduced gradient, so after the Join every rank
    holds current parameters and optimizer state for its shard.

    Evaluation works the same way: when the joined rank's last forward ran
    under ``torch.no_grad()``, it replays the forward alone, under
    ``no_grad``, and steps nothing.

    Requirements: one forward of ``module`` per iteration, ``zero_grad()``
    before every backward (no gradient accumulation across iterations), a
    model that accepts a batch of size 0 along dimension 0 of every input
    tensor. A rank with no batch at all in a Join replays the empty slice of
    a peer's input, exchanged once, described in JSON, between the ranks of
    the process group (a second slot of the heartbeat says when one is
    needed), and repeats that peer's gradient clips of the training iteration
    before (in the iteration it takes that input in, the ranks training
    raise ``ValueError`` if they clip otherwise; later, as any joined rank,
    it repeats those clips).

    Args:
        module: a model already passed through ``fully_shard`` (its
            submodules may be sharded too); its mesh must be one-dimensional.
        optimizer: the optimizer over the (sharded) parameters of ``module``.

    Join keyword arguments:
        divide_by_initial_world_size: True (default) divides each iteration's
            summed gradient by the world size; False by the number of ranks
            still training (through each FSDP module's
            ``set_gradient_divide_factor``).

    Example::

        with Join([FSDPJoinable(model, optimizer)]):
            for x, y in my_batches:  # fewer on some ranks
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(module, FSDPModule):
            raise TypeError(
                f"FSDPJoinable(module={type(module).__name__}): not an FSDP module; "
                "call torch.distributed.fsdp.fully_shard(module) first"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"FSDPJoinable(optimizer={type(optimizer).__name__}): not a torch.optim.Optimizer; pass the "
                "optimizer that steps the module's parameters"
            )
        install_exit_grace()  # FSDP2's module holds the process group's threads to interpreter exit
        meshes = []
        for param in module.parameters():
            if isinstance(param, DTensor) and param.device_mesh not in meshes:
                meshes.append(param.device_mesh)
        if len(meshes) != 1:
            raise ValueError(
                f"FSDPJoinable(module={type(module).__name__}): its parameters span {len(meshes)} device "
                "meshes; shard every parameter over the same one-dimensional mesh"
            )
        (mesh,) = meshes
        if mesh.ndim != 1:
            raise ValueError(
                f"FSDPJoinable(module={type(module).__name__}): its mesh has {mesh.ndim} dimensions; "
                "only one-dimensional (fully sharded) meshes are supported"
            )
        self.module = module
        self.optimizer = optimizer
        record_collectives()  # numbered from here on every rank: hang reports and desyncs name them
        self._group: dist.ProcessGroup = mesh.get_group()
        self._device = next(p for p in module.parameters() if isinstance(p, DTensor)).to_local().device
        self._world_size = dist.get_world_size(self._group)
        self._fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
        self._divide_by_initial_world_size = True
        self._divisor = float(self._world_size)
        self._last_input: _Input | None = None
        self._pending: float | None = None  # a heartbeat total not yet handed to Join
        # The output of a forward whose backward has not started: a rank that
        # fails before that backward still owes its collectives.
        self._owed_output: Any = None
        self._replaying = False
        self._in_backward = False  # between a backward's start and its end callback
        # The gradient clips of this rank's iteration, in order, which a joined rank
        # repeats between its replayed backward and optimizer step: (kind, value, norm type).
        self._clips: list[tuple[str, float, float]] = []
        # In an iteration in which a rank without any batch took a peer's input: the clips
        # that rank repeats (those of the peer's iteration before), which this one must make.
        self._promised_clips: list[tuple[str, float, float]] | None = None
        self._owned = OwnedCollectives("FSDPJoinable", self._group)
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self._post_forward),
            optimizer.register_step_pre_hook(self._pre_step),
        ]

    # The Joinable protocol.

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that replays an iteration on a joined rank.

        Args:
            divide_by_initial_world_size: see the class docstring (default True).
        """
        self._divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        # An input of an earlier Join (say, training before evaluation) must
        # not be replayed in this one.
        self._last_input = None
        self._pending = None
        self._owed_output = None
        self._in_backward = False
        self._owned.end()
        return _FSDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the local shards."""
        return self._device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The process group FSDP shards over."""
        return self._group

    def remove_hooks(self) -> None:
        """Detach this joinable from the module and optimizer."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # A training rank.

    def _pre_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._replaying or not Join.is_active(self):
            return
        self._in_backward = False  # a backward that failed left no end callback
        self._hand_over()
        self._last_input = (_empty_slice(args), _empty_slice(kwargs), torch.is_grad_enabled())
        previous_clips = self._clips
        if torch.is_grad_enabled():  # an evaluation forward clips nothing: the training ones' clips stay
            self._clips = []
        self._promised_clips = None
        Join.notify_join_context(self)  # an iteration starts (carried: no collective of Join's)
        self._owned.begin()
        try:
            total, needs_input = self._beat(Join.heartbeat_signal(self), needs_input=False)
            if total < 0:
                Join.heartbeat_result(self, total)  # raises JoinAbortedError before FSDP's collectives
            Join.check_early_termination(self, total)  # so does throw_on_early_termination
            if needs_input:
                self._promised_clips = self._share_input(previous_clips)
        except BaseException:
            self._owned.end()
            raise
        self._pending = total
        self._set_divisor(total)

    def _post_forward(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._replaying or not Join.is_active(self):
            return
        self._owned.end()  # the loss and the loop's own collectives come next
        if not torch.is_grad_enabled():
            return
        tensors: list[torch.Tensor] = []
        _collect(output, tensors.append)
        if tensors:
            # FSDP's first backward collectives come from hooks of inner
            # modules, which may run before this one's: claim the backward's
            # collectives until its end.
            self._owned.begin(backward=True)
            self._owed_output = output
            for tensor in tensors:
                tensor.register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> None:
        self._owed_output = None
        if self._in_backward or self._replaying:
            return
        self._in_backward = True
        Variable._execution_engine.queue_callback(self._after_fsdp_callbacks)

    def _after_fsdp_callbacks(self) -> None:
        # FSDP queues its own end-of-backward callback (which may still
        # reduce-scatter) in the same hooks as this one: the engine runs a
        # callback queued by a callback after those already queued.
        Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._in_backward = False
        self._owned.end()
        self._hand_over()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._replaying:
            self._keep_clip_promise(None)
            self._hand_over()

    def _hand_over(self) -> None:
        # After the iteration's collectives, so that a throw or abort leaves
        # every rank between the same two collectives.
        total, self._pending = self._pending, None
        if total is not None and Join.is_active(self):
            Join.heartbeat_result(self, total)

    # Gradient clipping.

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients of ``module``'s parameters so that their total
        norm is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``,
        and have a joined rank do the same before each replayed optimizer step.

        Call it between the backward and ``optimizer.step()`` instead of
        torch's: torch's reduces the norm of the sharded gradients with
        DTensor collectives that a joined rank neither sees nor issues. Here
        each rank adds up its shard's part and one all-reduce, marked as this
        joinable's (:class:`join_core.OwnedCollectives`), totals them; a joined
        rank issues it in its replay with its own shard of the reduced
        gradient, so the norm is that of the whole reduced gradient and every
        shard is scaled alike.

        Args:
            max_norm: the largest total norm, at least 0.
            norm_type: the p of the p-norm (``float("inf")``: the largest
                absolute value), greater than 0.

        Returns:
            The total norm of the gradients before clipping, the same on
            every rank.

        Raises:
            ValueError: ``max_norm`` is negative or ``norm_type`` not positive.
        """
        if not max_norm >= 0:
            raise ValueError(f"FSDPJoinable.clip_grad_norm_(max_norm={max_norm}): give a norm of at least 0")
        if not norm_type > 0:
            raise ValueError(
                f"FSDPJoinable.clip_grad_norm_(norm_type={norm_type}): give a p greater than 0 "
                "(2.0 for the Euclidean norm, float('inf') for the largest absolute value)"
            )
        if not self._replaying:
            self._keep_clip_promise(("norm", float(max_norm), float(norm_type)))
            self._clips.append(("norm", float(max_norm), float(norm_type)))
        with self._owned:
            return self._clip("norm", float(max_norm), float(norm_type))

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the gradients of ``module``'s parameters to
        ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_``,
        and have a joined rank do the same to its shard before each replayed
        optimizer step. Call it between the backward and ``optimizer.step()``.

        Raises:
            ValueError: ``clip_value`` is negative.
        """
        if not clip_value >= 0:
            raise ValueError(
                f"FSDPJoinable.clip_grad_value_(clip_value={clip_value}): give a value of at least 0"
            )
        if not self._replaying:
            self._keep_clip_promise(("value", float(clip_value), 0.0))
            self._clips.append(("value", float(clip_value), 0.0))
        self._clip("value", float(clip_value), 0.0)

    def _keep_clip_promise(self, clip: tuple[str, float, float] | None) -> None:
        """Check the next clip of this iteration (``None``: the optimizer step) against those a
        rank without any batch repeats in it; on a difference, issue the collectives it still
        waits in, then raise: every rank then leaves between the same two collectives."""
        promised = self._promised_clips
        if promised is None:
            return
        done = len(self._clips)
        expected = promised[done] if done < len(promised) else None
        if clip == expected:
            if clip is None:
                self._promised_clips = None
            return
        self._promised_clips = None
        with self._owned, torch.no_grad():
            for kind, _, norm_type in promised[done:]:
                if kind == "norm":
                    inf = norm_type == float("inf")
                    nothing = torch.zeros((), dtype=torch.float32, device=self._device)
                    dist.all_reduce(
                        nothing, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=self._group
                    )
        made = _clip_text([*self._clips, clip] if clip else self._clips)
        fix = (
            "clip the same way in every iteration (a Join's first iteration repeats the clips of the iteration "
            "before it), or give every rank at least one batch"
            if promised
            else "nothing was clipped before this iteration, so give every rank at least one batch in it"
        )
        raise ValueError(
            f"FSDPJoinable: a rank without any batch in this Join repeats the gradient clips of the "
            f"iteration before this one ({_clip_text(promised)}); this iteration's differ ({made}"
            f"{', then the optimizer step' if clip is None else ''}): {fix}"
        )

    def _clip(self, kind: str, value: float, norm_type: float) -> torch.Tensor:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        shards = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        with torch.no_grad():
            if kind == "value":
                for shard in shards:
                    shard.clamp_(-value, value)
                return torch.zeros((), device=self._device)
            inf = norm_type == float("inf")
            if inf:
                part = torch.zeros((), dtype=torch.float32, device=self._device)
                for shard in shards:
                    if shard.numel():
                        part = torch.maximum(part, shard.detach().abs().max().float())
            else:
                norms = [torch.linalg.vector_norm(shard.detach().float(), norm_type) for shard in shards]
                part = (
                    torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=self._device)
                )
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=self._group)
            total = part if inf else part.pow(1.0 / norm_type)
            scale = torch.clamp(value / (total + 1e-6), max=1.0)
            for shard in shards:
                shard.mul_(scale.to(shard.dtype))
            return total

    # Shared.

    def _beat(self, signal: float, needs_input: bool) -> tuple[float, bool]:
        """The heartbeat all-reduce: the total signal, and whether a joined
        rank needs a peer's input. Bounded by the process group's timeout."""
        beat = torch.zeros(2, device=self._device)
        beat[_SIGNAL] = signal
        beat[_NEEDS_INPUT] = float(needs_input)
        work = dist.all_reduce(beat, group=self._group, async_op=True)
        work.wait()
        total, needing = beat.tolist()
        return total, needing > 0

    def _share_input(self, clips: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
        """Give the last input's empty slices to the ranks that have none (a
        rank that had no batch at all in this Join), with ``clips``, the gradient
        clips of the iteration before; the clips those ranks repeat (the first
        training rank's)."""
        mine = b""
        if self._last_input is not None:
            mine = json.dumps({"input": _describe(self._last_input), "clips": clips}).encode()
        described = all_gather_bytes(mine, self._device, self._group, _MAX_DESCRIPTION)
        shared = _parse_description(next(d for d in described if d))
        if not isinstance(shared, dict) or "input" not in shared:
            raise _malformed("input", f"not a description: {str(shared)[:80]!r}")
        repeated = _parse_clips(shared.get("clips"))
        if self._last_input is None:
            rebuilt = _rebuild(shared["input"], self._device)
            if not (
                isinstance(rebuilt, tuple)
                and len(rebuilt) == 3
                and isinstance(rebuilt[0], (tuple, list))
                and isinstance(rebuilt[1], dict)
                and isinstance(rebuilt[2], bool)
            ):
                raise _malformed("input", "not (positional arguments, keyword arguments, grad enabled)")
            args, kwargs, with_grad = rebuilt
            self._last_input = (tuple(args), dict(kwargs), bool(with_grad))
        return repeated

    def _set_divisor(self, total: float) -> None:
        divisor = float(self._world_size) if self._divide_by_initial_world_size else total
        if divisor <= 0 or divisor == self._divisor:
            return
        self._divisor = divisor
        # AVG (FSDP's default) when dividing by the world size; otherwise a
        # sum then a division, which every backend supports (gloo has no
        # PREMUL_SUM).
        by_sum = divisor != self._world_size
        for fsdp_module in self._fsdp_modules:
            fsdp_module.set_gradient_divide_factor(divisor)
            fsdp_module.set_force_sum_reduction_for_comms(by_sum)

    # A joined rank.

    def _replay(self) -> None:
        assert self._last_input is not None
        args, kwargs, with_grad = self._last_input
        self._replaying = True
        try:
            if not with_grad:
                with torch.no_grad():
                    self.module(*args, **kwargs)
                return
            self.optimizer.zero_grad(set_to_none=True)
            output = self.module(*args, **kwargs)
            zero = _zero_loss(output)
            if zero is None:
                raise RuntimeError(
                    f"FSDPJoinable: the output of {type(self.module).__name__} holds no floating-point "
                    "tensor that requires grad; a joined rank has nothing to run backward() on"
                )
            zero.backward()
            for kind, value, norm_type in self._clips:
                self._clip(kind, value, norm_type)
            self.optimizer.step()
        finally:
            self._replaying = False


class _FSDPJoinHook(JoinHook):
    """Heartbeat, then one replayed iteration, on a joined rank."""

    carries_heartbeat = True

    def __init__(self, joinable: FSDPJoinable) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        joinable = self.joinable
        # A rank whose last iteration had no backward (evaluation) still
        # holds that heartbeat: hand it over before the first shadowed one,
        # as the ranks still training do at their next forward.
        joinable._hand_over()
        with joinable._owned:  # as on a training rank: heartbeat, forward and backward
            signal = Join.heartbeat_signal(joinable)
            total, needs_input = joinable._beat(
                signal, needs_input=joinable._last_input is None and signal >= 0
            )
            if not Join.heartbeat_result(joinable, total) or total < 0:
                return
            if signal < 0:
                return  # a failing rank: Join agrees on the abort next
            Join.check_early_termination(joinable, total)  # before the iteration, as the others
            if needs_input:
                had_input = joinable._last_input is not None
                repeated = joinable._share_input(joinable._clips)
                if not had_input:
                    joinable._clips = repeated
            joinable._set_divisor(total)
            joinable._replay()

    def abort_hook(self) -> None:
        # The rank failed between a forward and its backward (say, in the
        # loss): the ranks still training wait in that backward's collectives.
        joinable = self.joinable
        output, joinable._owed_output = joinable._owed_output, None
        joinable._pending = None  # the backward's end hands nothing over on a failing rank
        zero = _zero_loss(output)
        if zero is not None:
            zero.backward()
        joinable._owned.end()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.joinable._owed_output = None
        self.joinable._pending = None
        self.joinable._in_backward = False
        self.joinable._owned.end()
        self.joinable._set_divisor(float(self.joinable._world_size))


def _describe(value: Any) -> Any:
    """A JSON description of an input made of empty tensors and plain values."""
    if isinstance(value, torch.Tensor):
        scalar = value.item() if value.dim() == 0 and not value.is_complex() else None
        return {
            "tensor": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "value": scalar,
        }
    if isinstance(value, tuple):
        return {"tuple": [_describe(v) for v in value]}
    if isinstance(value, list):
        return {"list": [_describe(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _describe(v) for k, v in value.items()}}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    return {"unsupported": type(value).__name__}


#: How deeply a peer's input description may nest (an input is a few containers deep).
_MAX_DEPTH: Final = 32
_MAX_CLIPS: Final = 64
_PLAIN: Final = (type(None), bool, int, float, str)


def _clip_text(clips: list[tuple[str, float, float]]) -> str:
    if not clips:
        return "none"
    return ", ".join(
        f"clip_grad_value_({value})" if kind == "value" else f"clip_grad_norm_({value}, {norm})"
        for kind, value, norm in clips
    )


def _parse_clips(described: Any) -> list[tuple[str, float, float]]:
    """The gradient clips of a peer's input description, each field checked."""
    if not isinstance(described, list) or len(described) > _MAX_CLIPS:
        raise _malformed("clips", f"not a list of at most {_MAX_CLIPS} clips: {str(described)[:80]}")
    clips = []
    for index, clip in enumerate(described):
        if not (
            isinstance(clip, list)
            and len(clip) == 3
            and clip[0] in ("norm", "value")
            and all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in clip[1:])
        ):
            raise _malformed(f"clips[{index}]", f"not [kind, value, norm type]: {str(clip)[:80]}")
        clips.append((str(clip[0]), float(clip[1]), float(clip[2])))
    return clips


def _malformed(where: str, what: str) -> ValueError:
    return ValueError(f"FSDPJoinable: a peer's input description: {where}: {what}")


def _parse_description(text: bytes) -> Any:
    """The JSON of a peer's input description; ``ValueError`` if it is not JSON or nests too deeply."""
    try:
        return json.loads(text)
    except RecursionError:
        raise _malformed(
            "input", f"nested more than the parser allows (at most {_MAX_DEPTH} levels)"
        ) from None
    except ValueError as exc:
        raise _malformed("input", f"not JSON ({exc})") from None


def _rebuild(described: Any, device: torch.device, where: str = "input", depth: int = 0) -> Any:
    """The input a :func:`_describe` description stands for, tensors on ``device``.

    A description comes from a peer: each field is checked before it is used,
    and a wrong one raises ``ValueError`` (or ``TypeError`` for an input this
    rank cannot replay) naming it; nothing larger than the description is built.
    """
    if depth > _MAX_DEPTH:
        raise _malformed(where, f"nested more than {_MAX_DEPTH} levels")
    if not isinstance(described, dict) or len(described) == 0:
        raise _malformed(where, f"not a description: {str(described)[:80]!r}")
    if "tensor" in described:
        return _rebuild_tensor(described, device, where)
    if "tuple" in described or "list" in described:
        kind = "tuple" if "tuple" in described else "list"
        items = described[kind]
        if not isinstance(items, list):
            raise _malformed(f"{where}.{kind}", f"a {type(items).__name__}, not a list")
        rebuilt = [_rebuild(v, device, f"{where}[{i}]", depth + 1) for i, v in enumerate(items)]
        return tuple(rebuilt) if kind == "tuple" else rebuilt
    if "dict" in described:
        items = described["dict"]
        if not isinstance(items, dict):
            raise _malformed(f"{where}.dict", f"a {type(items).__name__}, not an object")
        return {str(k): _rebuild(v, device, f"{where}[{k!r}]", depth + 1) for k, v in items.items()}
    if "unsupported" in described:
        raise TypeError(
            f"FSDPJoinable: this rank had no batch in the Join and cannot replay its peers' input: it holds "
            f"a {str(described['unsupported'])[:80]}; give every rank at least one batch, or inputs made of "
            "tensors and plain values"
        )
    if "value" not in described:
        raise _malformed(where, f"none of tensor, tuple, list, dict, value in {sorted(described)[:8]}")
    value = described["value"]
    if not isinstance(value, _PLAIN):
        raise _malformed(f"{where}.value", f"a {type(value).__name__}, not a plain value")
    return value


def _rebuild_tensor(described: dict[str, Any], device: torch.device, where: str) -> torch.Tensor:
    dtype = getattr(torch, described["tensor"], None) if isinstance(described["tensor"], str) else None
    if not isinstance(dtype, torch.dtype):
        raise _malformed(f"{where}.tensor", f"unknown dtype {str(described['tensor'])[:80]!r}")
    shape = described.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DEPTH
        or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 62 for n in shape)
    ):
        raise _malformed(f"{where}.shape", f"not a list of at most {_MAX_DEPTH} sizes: {str(shape)[:80]}")
    if shape:
        if shape[0] != 0:
            raise _malformed(f"{where}.shape", f"{shape} is not empty along dimension 0")
        try:
            return torch.empty(shape, dtype=dtype, device=device)
        except RuntimeError as exc:
            raise _malformed(f"{where}.shape", f"{shape} ({exc})") from None
    value = described.get("value")
    if value is None:  # a complex scalar: described without its value
        return torch.zeros((), dtype=dtype, device=device)
    if not isinstance(value, (bool, int, float)):
        raise _malformed(f"{where}.value", f"a {type(value).__name__}, not a number for a scalar tensor")
    try:
        return torch.tensor(value, dtype=dtype, device=device)
    except (RuntimeError, OverflowError, TypeError, ValueError) as exc:
        raise _malformed(f"{where}.value", f"{value!r} does not fit {dtype} ({exc})") from None


def _empty_slice(value: Any) -> Any:
    """``value`` with every tensor of one or more dimensions cut to length 0
    along dimension 0 (a fresh tensor: the batch's memory is not kept)."""

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            return tensor.detach().clone()
        return tensor.detach().new_empty((0, *tensor.shape[1:]))

    return _map_tensors(value, cut)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


def _zero_loss(output: Any) -> torch.Tensor | None:
    """Zero times the sum of every floating-point tensor in ``output`` that
    requires grad, or None if there is none."""
    terms: list[torch.Tensor] = []
    _collect(output, terms.append)
    if not terms:
        return None
    return torch.stack([t.sum() for t in terms]).sum() * 0.0


def _collect(value: Any, add: Callable[[torch.Tensor], None]) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.requires_grad:
            add(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, add)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, add)
