"""The gradient reducer of DistributedDataParallel: gradients gathered into
buckets by autograd hooks, each bucket all-reduced as soon as it is full
while backward goes on, and the averages written back when it ends.

One iteration, as the reducer sees it: the module wrapper opens it before a
synchronizing forward (:meth:`Reducer.reset_iteration`); the parameters'
hooks fill the buckets and launch their reductions in bucket order; the end
of backward waits for each in turn and writes ``.grad``. A joined rank issues
the same reductions with zeros (:meth:`Reducer.reduce_zeros`). Under
``Join(on_rank_lost="continue")`` a reduction a lost rank broke is done again
on the survivors' group (:meth:`Reducer.recover`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Concatenate, Final, TypeVar

import torch
import torch.distributed as dist
from torch.autograd import Variable
from typing_extensions import ParamSpec

from ddp_join._bucket import Bucket, aligned, group_parameters
from ddp_join._dist_autograd import distributed_autograd_loaded, distributed_backward_running
from ddp_join._groups import global_rank
from ddp_join.comm_hooks import CommHook, GradBucket
from join_core import Join, Joinable, RankLostError, Recovery, ShadowCollectives

# Float types that represent the heartbeat and flag counts exactly.
_EXACT_COUNT_DTYPES: Final = (torch.float32, torch.float64)

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S")


def _unrecorded(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """``method`` with autograd recording off: ``backward(create_graph=True)`` runs the hooks
    with it on, and the copies into the buckets are no part of the gradients' graph."""

    def run(reducer: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not torch.is_grad_enabled():
            return method(reducer, *args, **kwargs)
        with torch.no_grad():
            return method(reducer, *args, **kwargs)

    return run


#: The stages of one iteration, as Join numbers them (``regroup_phases``): the
#: module wrapper's buffer broadcast before the reduction, and the reduction.
BROADCASTING: Final = 0
REDUCING: Final = 1


class Reducer:
    """Averages the gradients of ``params`` over ``process_group``, during backward.

    ``joinable`` is the module wrapper, the one Join knows: the heartbeat and
    the recovery from a lost rank are asked for in its name.
    """

    def __init__(
        self,
        joinable: Joinable,
        params: list[torch.nn.Parameter],
        process_group: dist.ProcessGroup,
        device: torch.device,
        caps: list[int],
        *,
        reduce_dtype: torch.dtype | None,
        gradient_as_bucket_view: bool,
        find_unused_parameters: bool,
        static_graph: bool,
    ) -> None:
        self.joinable = joinable
        #: The group reduced over; the survivors' group after a rank was lost.
        self.process_group = process_group
        self._sum_options = dist.AllreduceOptions()  # reduceOp: SUM by default
        self._params = params
        self._device = device
        self._reduce_dtype = reduce_dtype
        self.static_graph = static_graph
        self.rank = dist.get_rank(process_group)
        self._world_size = dist.get_world_size(process_group)
        self._param_index = {id(p): i for i, p in enumerate(params)}
        self.comm_hook: CommHook | None = None  # None: the built-in averaging all-reduce
        self.comm_state: Any = None
        self._used_since_sync = [False] * len(params)  # find_unused_parameters, across no_sync
        # static_graph: the used flags ride in the metadata (known at the forward).
        self._flags_in_meta = static_graph
        # find_unused_parameters: whether each gradient arrived (since the last reduction, so
        # across no_sync) rides at the end of the last bucket, launched once all are known.
        self._flags_in_tail = find_unused_parameters and not static_graph
        self._arrived = [False] * len(params)
        # static_graph: how many times each gradient is accumulated per backward; None until learned.
        self._static_counts: list[int] | None = None
        self.divide_by_initial_world_size = True
        self.buffer_src = 0  # group rank whose buffers the next forward takes
        self._meta_cache: dict[tuple[float, bool, torch.dtype], torch.Tensor] = {}
        # Join(on_rank_lost="continue"): buckets keep copies (see Bucket), and a failed
        # collective is redone on the survivors' group.
        self.keeps_copies = False
        self._reductions = 0  # reductions completed on this rank (training or shadowing)
        self._reductions_at_entry = 0  # _reductions when the current Join was entered
        self._launched_training = True  # whether bucket 0 was last launched by a training rank
        self._handoff = False  # this reduction's result came from a survivor that had finished it

        self._buckets = self._make_buckets(caps, gradient_as_bucket_view)
        self._where = {}  # param index -> (bucket, position)
        for bucket in self._buckets:
            for position, param in enumerate(bucket.params):
                self._where[self._param_index[id(param)]] = (bucket, position)
        # The hooks reach this reducer through a weak reference, and go with it: a dropped
        # wrapper is freed, as torch's, instead of living on in its parameters' hooks.
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_grad_hook(index))
            for index, param in enumerate(self._params)
        ]
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        # Added once distributed autograd is loaded: a hook per gradient costs every backward.
        self._captures = False
        self.reset_iteration()

    def _make_buckets(self, caps: list[int], gradient_as_bucket_view: bool) -> list[Bucket]:
        """Buckets of parameters in reverse order (see :func:`group_parameters`),
        bucket 0 with room for the metadata when it rides there."""
        groups = group_parameters(self._params, caps)
        meta_used = 1 + self._world_size + (len(self._params) if self._flags_in_meta else 0)
        self._meta_len = aligned(meta_used)  # zeros after the metadata keep the gradients aligned
        self._meta_rides = (self._reduce_dtype or groups[0][0].dtype) in _EXACT_COUNT_DTYPES
        buckets = []
        for index, params in enumerate(groups):
            offsets, total = [], 0
            for param in params:
                offsets.append(total)
                total += aligned(param.numel())
            meta_len = self._meta_len if index == 0 and self._meta_rides else 0
            tail_len = aligned(len(self._params)) if index == len(groups) - 1 and self._flags_in_tail else 0
            dtype = self._reduce_dtype or params[0].dtype
            buffer = torch.zeros(meta_len + total + tail_len, dtype=dtype, device=self._device)
            bucket = Bucket(index, params, offsets, meta_len, buffer, tail_len)
            bucket.as_view = gradient_as_bucket_view and dtype == params[0].dtype
            if bucket.as_view:
                # As torch: a gradient already there becomes a view of the bucket; the others
                # do when they arrive (one never used stays None, so optimizers skip it).
                for position, param in enumerate(params):
                    if param.grad is not None:
                        view = bucket.grad_view(position)
                        view.copy_(param.grad)
                        param.grad = view
            buckets.append(bucket)
        return buckets

    # One iteration.

    @property
    def iteration_open(self) -> bool:
        """Whether a synchronizing forward opened an iteration whose backward has not ended."""
        return self._open

    @property
    def carries(self) -> bool:
        """Whether the metadata (and Join's heartbeat) ride in bucket 0."""
        return self._meta_rides and self.comm_hook is None

    def reset_iteration(self, opening: bool = False) -> None:
        """Forget the iteration in progress; ``opening``: a synchronizing
        forward starts the next one, whose backward reduces."""
        self._open = opening
        if opening and not self._captures and distributed_autograd_loaded():
            self._captures = True
            self._hook_handles += [
                param.register_hook(self._make_capture_hook(index))
                for index, param in enumerate(self._params)
            ]
        self._callback_queued = False
        self._next_launch = 0
        self._meta_future: torch.futures.Future[torch.Tensor] | None = None
        self._arrivals_future: torch.futures.Future[torch.Tensor] | None = None  # with a comm hook
        self._used = [True] * len(self._params)
        self._unused_now: list[int] = []  # find_unused_parameters: not reached by this forward
        self._hook_counts = [0] * len(self._params)  # static_graph: accumulations this backward
        self._backward_started = False
        self._accumulated = 0  # gradients accumulated into .grad this backward
        self._unused_marked = False  # see _mark_unused
        # A distributed autograd backward: the gradients it computes for its
        # context, by parameter index (filled with the averages at the end).
        self._distributed = False
        self._captured: dict[int, torch.Tensor] = {}
        for bucket in self._buckets:
            bucket.pending = len(bucket.params)
            bucket.ready = [False] * len(bucket.params)
            bucket.future = None
            bucket.work = None

    def _make_grad_hook(self, index: int) -> Any:
        reducer = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            alive = reducer()
            if alive is not None:
                alive._grad_accumulated(index, param)

        return hook

    @_unrecorded
    def _grad_accumulated(self, index: int, param: torch.Tensor) -> None:
        if param.grad is not None:  # (an undefined gradient leaves a None there)
            self._arrived[index] = True
        if not self._open:
            return
        self._accumulated += 1
        self.start_backward()
        self._mark_unused()
        if self.static_graph:
            self._hook_counts[index] += 1
            # Learning: every bucket is reduced at the end of backward. Later:
            # a gradient accumulated several times is ready at its last time.
            if self._static_counts is None or self._hook_counts[index] < self._static_counts[index]:
                return
            if self._hook_counts[index] > self._static_counts[index]:
                # Its bucket went (or goes) without it: the ranks' gradients would drift apart.
                raise RuntimeError(_graph_changed(index, param, self._static_counts[index]))
        else:
            bucket, position = self._where[index]
            if bucket.ready[position]:
                raise RuntimeError(_ready_twice(index, param))
        self._grad_ready(index, param.grad)

    def _make_capture_hook(self, index: int) -> Any:
        reducer = weakref.ref(self)

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            alive = reducer()
            return None if alive is None else alive._capture(index, grad)

        return hook

    @_unrecorded
    def _capture(self, index: int, grad: torch.Tensor) -> torch.Tensor | None:
        param = self._params[index]
        if not self._open or not distributed_backward_running():
            return None  # a local backward: the post-accumulate hook takes it
        self.start_backward()
        if not self._callback_queued:  # a later pass of the same distributed backward
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        if index in self._captured:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {index} (shape {tuple(param.shape)}) got a "
                "second gradient in one distributed backward; a parameter's gradient may reach "
                "DDP in one pass only (it is already being reduced)"
            )
        self._arrived[index] = True
        # The context keeps this tensor; the average is written into it at the end.
        dense = torch.empty_like(param, memory_format=torch.preserve_format)
        if grad.layout == torch.strided:
            dense.copy_(grad)
            mine = dense
        else:
            # Reduced dense, kept in the layout autograd expects: every row present.
            dense.copy_(grad.to_dense())
            rows = torch.arange(param.shape[0], device=param.device).unsqueeze(0)
            mine = torch.sparse_coo_tensor(rows, dense, param.shape, is_coalesced=True)
            dense = mine._values()
        self._captured[index] = dense
        self._grad_ready(index, dense)
        return mine

    def check_prior_reduction(self) -> None:
        """Raise torch's error when a distributed backward left parameters unreduced."""
        if not (self._open and self._distributed and self._backward_started):
            return
        missing = [index for index in range(len(self._params)) if index not in self._captured]
        self.reset_iteration()
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new one: "
            f"the last distributed autograd backward gave no gradient to parameters {missing}. "
            "Pass find_unused_parameters=True when a forward does not use every parameter"
        )

    def start_backward(self, _: object = None) -> None:
        """A syncing backward reached an output or a parameter: schedule its end."""
        if self._backward_started or not self._open:
            return
        self._backward_started = True
        self._distributed = distributed_backward_running()
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        if self._distributed:
            self._mark_unused()

    def _mark_unused(self) -> None:
        """At a backward's first gradient: count the parameters this forward did not reach as
        ready, so that their buckets go early. Not before: a pass that accumulates no gradient
        (torch.autograd.grad) must launch nothing (see _finish_backward)."""
        if self._unused_marked:
            return
        self._unused_marked = True
        for index in self._unused_now:
            self._grad_ready(index, None)

    def _grad_ready(self, index: int, grad: torch.Tensor | None) -> None:
        bucket, position = self._where[index]
        if bucket.ready[position]:
            return
        view = bucket.grad_view(position)
        param = bucket.params[position]
        if grad is None:
            grad = param.grad  # no gradient this backward: what no_sync accumulated, if anything
        if grad is not None and grad.layout != torch.strided:
            grad = grad.to_dense()  # a sparse gradient (e.g. Embedding(sparse=True)) is reduced dense
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            if bucket.as_view and not self._distributed:
                param.grad = view
        bucket.ready[position] = True
        bucket.pending -= 1
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch], training=True)
            self._next_launch += 1

    def _signal_meta(self, training: bool, dtype: torch.dtype) -> torch.Tensor:
        """This rank's contribution to the metadata, on the module's device:
        [heartbeat, active flag per rank, used flag per parameter
        (find_unused_parameters or static_graph only)]."""
        signal = Join.heartbeat_signal(self.joinable)
        key = (signal, training, dtype)
        cached = None if self._flags_in_meta else self._meta_cache.get(key)
        if cached is not None:
            return cached
        values = [0.0] * self._meta_len
        values[0] = signal
        if training:
            values[1 + self.rank] = 1.0
            if self._flags_in_meta:
                values[1 + self._world_size : 1 + self._world_size + len(self._used)] = [
                    float(used) for used in self._used
                ]
        meta = torch.tensor(values, dtype=dtype, device=self._device)
        if not self._flags_in_meta:
            self._meta_cache[key] = meta
        return meta

    def _divisor(self, meta: list[float]) -> int:
        if self.divide_by_initial_world_size or not meta:
            return self._world_size
        return max(1, round(sum(meta[1 : 1 + self._world_size])))

    def _divides_first(self, bucket: Bucket) -> bool:
        """Whether the built-in reduction of ``bucket`` divides by the world size before it
        sums (as torch's does): float16, whose sum over the ranks would overflow where the
        average does not, and gradient views, where it costs the same pass as after."""
        return bucket.as_view or bucket.buffer.dtype == torch.float16

    def _rides(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` is reduced whole, the metadata or arrival flags with its gradients."""
        return self.comm_hook is None and (bucket.meta_len > 0 or bucket.tail_len > 0)

    def _carries_meta(self, bucket: Bucket) -> bool:
        return bucket.meta_len > 0 and self.carries

    def _arrival_flags(self, training: bool, like: torch.Tensor) -> torch.Tensor:
        """This rank's arrival flags (none on a joined rank), as ``like``'s first elements."""
        flags = torch.zeros_like(like)
        if training:
            flags[: len(self._arrived)] = torch.tensor(self._arrived, dtype=like.dtype)
        return flags

    def _launch(self, bucket: Bucket, training: bool) -> None:
        rides = self._rides(bucket)
        if bucket.tail_len:
            if rides:
                bucket.tail.copy_(self._arrival_flags(training, bucket.tail))
            else:  # a hook reduces the gradients: the flags go in an all-reduce of their own
                flags = self._arrival_flags(training, torch.empty(bucket.tail_len, device=self._device))
                work = dist.all_reduce(flags, group=self.process_group, async_op=True)
                self._arrivals_future = work.get_future().then(lambda f: f.value()[0])
        if bucket.index == 0:
            self._launched_training = training
            if self._carries_meta(bucket):
                bucket.meta.copy_(self._signal_meta(training, bucket.buffer.dtype))
            elif self._flags_in_meta or Join.is_active(self.joinable):
                # The metadata cannot ride with these gradients: its own all-reduce, first.
                separate = self._signal_meta(training, torch.float32).clone()
                work = dist.all_reduce(separate, group=self.process_group, async_op=True)
                self._meta_future = work.get_future().then(lambda f: f.value()[0])
        if rides or self.comm_hook is None:
            # The built-in reduction, in place: waited for through its work, no callback.
            bucket.reduced = bucket.buffer if rides else bucket.grads
            if bucket.backup is not None:
                bucket.backup.copy_(bucket.buffer)  # gradient views: .grad is this buffer
            if self._divides_first(bucket):
                bucket.grads.div_(self._world_size)
            bucket.work = self._all_reduce(bucket.reduced)
            return
        if bucket.backup is not None:
            bucket.backup.copy_(bucket.buffer)  # the hook may reduce in place
        if self._meta_future is not None and not self.divide_by_initial_world_size:
            divisor = self._divisor(self._meta_future.wait().tolist())
        else:
            divisor = self._world_size
        is_last = bucket.index == len(self._buckets) - 1
        grad_bucket = GradBucket(
            bucket.index, bucket.grads, bucket.params, is_last, divisor, self.process_group, bucket.offsets
        )
        bucket.future = self.comm_hook(self.comm_state, grad_bucket)

    @_unrecorded
    def _finish_backward(self) -> None:
        """End of backward: reduce what is left, wait, and write the averaged
        gradients to ``.grad`` (or the distributed autograd context's); then
        hand Join the heartbeat."""
        if self._distributed and any(bucket.pending for bucket in self._buckets):
            # Gradients still to come in later passes of this distributed backward.
            self._callback_queued = False
            return
        if not self._distributed and self._accumulated == 0 and len(self._unused_now) < len(self._params):
            # A pass that accumulated no gradient though the forward reached parameters:
            # torch.autograd.grad (a gradient penalty) or backward(inputs=...). The
            # iteration's backward is still to come.
            self._backward_started = False
            self._callback_queued = False
            return
        if self.static_graph and self._static_counts is None:
            self._static_counts = list(self._hook_counts)
            self._used = [count > 0 for count in self._hook_counts]
        for index in range(len(self._params)):
            bucket, position = self._where[index]
            if not bucket.ready[position]:
                self._grad_ready(index, None)
        total = self._complete(shadow=False)
        self.reset_iteration()
        self._used_since_sync = [False] * len(self._params)
        self._arrived = [False] * len(self._params)
        if total is not None:
            Join.heartbeat_result(self.joinable, total)

    def _complete(self, shadow: bool) -> float | None:
        """Wait for each bucket in turn and write its gradients while later ones
        are still reduced; remember which rank's buffers to take next; return the
        carried heartbeat, if any."""
        if self.keeps_copies:
            self._await_reductions()
        first = self._buckets[0]
        first_result = first.result()
        meta: list[float] = []
        if self._carries_meta(first):
            if self._flags_in_meta or Join.is_active(self.joinable):
                meta = first.meta.tolist()  # riding: first_result is first.buffer
            else:
                # Outside a Join every rank trained: the metadata tells nothing new, and
                # reading it would make the host wait for the GPU every step.
                self.buffer_src = 0
        elif self._meta_future is not None:
            meta = self._meta_future.wait().tolist()
        divisor = self._divisor(meta)
        used = (
            [count > 0 for count in meta[1 + self._world_size : 1 + self._world_size + len(self._params)]]
            if self._flags_in_meta and meta
            else self._arrivals()
        )
        for bucket in self._buckets:
            result = first_result if bucket is first else bucket.result()
            builtin = bucket.work is not None  # reduced in place, into this bucket's buffer
            scale: float = 1  # hooks divide themselves
            if builtin:
                scale = divisor / self._world_size if self._divides_first(bucket) else divisor
            grads = bucket.grads if builtin else result
            if bucket.as_view:
                if grads.data_ptr() != bucket.grads.data_ptr():
                    bucket.grads.copy_(grads)
                if scale != 1 and not self._handoff:  # a handed-over buffer was divided by its sender
                    bucket.grads.div_(scale)
            elif (
                builtin
                and used is None
                and grads.device.type != "cpu"
                and not (self._distributed or self.keeps_copies)
            ):
                targets = [param.grad for param in bucket.params if param.grad is not None]
                if len(targets) == len(bucket.params) and all(
                    grad.layout == torch.strided and grad.dtype == grads.dtype for grad in targets
                ):
                    # On an accelerator, where each call launches a kernel: two calls for the
                    # bucket rather than one per parameter (on the CPU, one pass over the
                    # memory, dividing into .grad, costs less than two).
                    if scale != 1:
                        grads.div_(scale)
                    torch._foreach_copy_(targets, bucket.views)
                    continue
            for position, param in enumerate(bucket.params):
                index = self._param_index[id(param)]
                if used is not None and not used[index]:
                    # No rank used it: .grad stays as it was, except on a joined
                    # rank, where an old value must not reach the optimizer.
                    if shadow:
                        param.grad = None
                    continue
                if self._distributed:
                    self._write_captured(index, bucket, position, grads, scale, builtin)
                    continue
                if bucket.as_view:
                    param.grad = bucket.views[position]
                    continue
                if builtin:
                    reduced = bucket.views[position]
                else:
                    offset = bucket.offsets[position]
                    reduced = grads[offset : offset + param.numel()].view_as(param)
                if param.grad is None or param.grad.layout != torch.strided:
                    param.grad = (reduced / scale).to(param.dtype)  # cast back from a reduce_dtype
                elif scale == 1:
                    param.grad.copy_(reduced)
                else:
                    torch.div(reduced, scale, out=param.grad)
        self._note_buffer_source(meta)
        self._reductions += 1
        if self.keeps_copies:
            for bucket in self._buckets:
                bucket.keep_reduced()
        return meta[0] if meta and self._carries_meta(first) else None

    def _arrivals(self) -> list[bool] | None:
        """With find_unused_parameters: whether each parameter's gradient arrived on any rank
        (the last bucket's reduction is waited for); None otherwise."""
        if not self._flags_in_tail:
            return None
        if self._arrivals_future is not None:
            counts = self._arrivals_future.wait()
        else:
            last = self._buckets[-1]
            last.result()
            counts = last.tail
        return [count > 0 for count in counts[: len(self._params)].tolist()]

    def _note_buffer_source(self, meta: list[float]) -> None:
        """The next forward takes the buffers of the first rank that trained in this reduction."""
        if meta and meta[1] > 0 and not self._handoff:
            self.buffer_src = 0  # the common case, without the loop
        elif meta and not self._handoff:  # a handed-over result's flags are by the former group's ranks
            for rank, flag in enumerate(meta[1 : 1 + self._world_size]):
                if flag > 0:
                    self.buffer_src = rank
                    break
        self._handoff = False

    def _write_captured(
        self, index: int, bucket: Bucket, position: int, grads: torch.Tensor, scale: float, builtin: bool
    ) -> None:
        """Put parameter ``index``'s average into the gradient its distributed
        autograd context keeps (``.grad`` is left alone, as torch's)."""
        target = self._captured.get(index)
        if target is None:
            return  # reached by no pass here (find_unused_parameters): the context has none
        if bucket.as_view or builtin:
            reduced = bucket.views[position]
        else:
            offset = bucket.offsets[position]
            reduced = grads[offset : offset + target.numel()].view_as(target)
        if bucket.as_view:
            target.copy_(reduced)  # already divided in the bucket
        else:
            torch.div(reduced, scale, out=target)

    def find_unused(self, output: Any, syncing: bool) -> None:
        """Note which parameters the autograd graph of ``output`` reaches.

        Usage accumulates over ``no_sync`` forwards until the next reduction.
        For a syncing forward, the parameters it did not reach are reduced
        with what they hold once its backward starts."""
        reached: set[int] = set()
        seen: set[Any] = set()
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)
            if variable is not None:
                reached.add(id(variable))
            stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
        for index, param in enumerate(self._params):
            if id(param) in reached:
                self._used_since_sync[index] = True
            elif syncing:
                self._unused_now.append(index)
        if syncing:
            self._used = list(self._used_since_sync)

    def use_static_counts(self) -> None:
        """static_graph, once learned: this forward uses what the first
        synchronizing backward used (no graph traversal)."""
        if self._static_counts is not None:
            self._used = [count > 0 for count in self._static_counts]
            self._unused_now.extend(i for i, count in enumerate(self._static_counts) if count == 0)

    # On a joined rank, and on a failing one.

    def reduce_zeros(self) -> None:
        """Shadow one iteration's reduction: every bucket (zeros) through the
        same collectives as a training rank's."""
        for bucket in self._buckets:
            if bucket.as_view:
                bucket.lend_zeros()  # .grad views the real buffer: it keeps its values
            else:
                bucket.grads.zero_()
        try:
            writes = self._reduce_lent_zeros()
        except BaseException:
            for bucket in self._buckets:
                bucket.take_back(keep_result=False)
            raise
        if writes:
            self._complete(shadow=True)
        self.reset_iteration()

    def _reduce_lent_zeros(self) -> bool:
        """:meth:`reduce_zeros` once the buckets hold zeros: whether ``.grad`` is to be
        written with the result, which the buckets then hold (their own buffers back)."""
        # Every bucket at once, as a training rank issues them. When all ranks
        # have joined, all of them are here issuing the same, so nothing is
        # left unmatched even though nobody needed the result.
        for bucket in self._buckets:
            self._launch(bucket, training=False)
        if self.keeps_copies:
            self._await_reductions()
        if self.carries:
            training = Join.heartbeat_result(self.joinable, float(self._buckets[0].result()[0]))
            if not training or not (self.keeps_copies or self._writes_gradients_when_joined()):
                # Every rank has joined, or nothing on this rank reads the gradients before the
                # Join ends (the model's post-hook then takes the last joiner's parameters).
                for bucket in self._buckets[1:]:
                    bucket.result()
                self._note_buffer_source(self._buckets[0].meta.tolist())
                for bucket in self._buckets:
                    bucket.take_back(keep_result=False)
                self._reductions += 1
                return False
        for bucket in self._buckets:
            if bucket.lent is not None:
                bucket.result()
                bucket.take_back(keep_result=True)
        return True

    def _writes_gradients_when_joined(self) -> bool:
        """Whether a joined rank writes each shadowed iteration's averages to
        ``.grad``: when another joinable of the Join may read them (a sharded
        optimizer steps there with them)."""
        return any(not isinstance(other, ShadowCollectives) for other in Join.companions(self.joinable))

    def abort(self) -> None:
        """The rank failed between an iteration's forward and the end of its
        backward: reduce the buckets it still owes (zeros for missing gradients)."""
        if not self._open:
            return
        for index in range(len(self._params)):
            bucket, position = self._where[index]
            if not bucket.ready[position]:
                self._grad_ready(index, None)
        total = self._complete(shadow=True)
        self.reset_iteration()
        self._arrived = [False] * len(self._params)
        if total is not None:
            Join.heartbeat_result(self.joinable, total)

    # Going on without a lost rank (Join(on_rank_lost="continue")).

    def enter_join(self) -> None:
        """A Join was entered: its iterations are counted from here."""
        self._reductions_at_entry = self._reductions

    def keep_copies(self, keep: bool) -> None:
        """Keep what it takes to redo a reduction without a lost rank (inside
        a Join that continues on a loss), or stop keeping it."""
        self.keeps_copies = keep
        for bucket in self._buckets:
            bucket.keep_copies(keep)

    def _await_reductions(self) -> None:
        """Wait for every bucket's reduction; when one fails because a rank was
        lost, complete it on the survivors' group."""
        while True:
            try:
                for bucket in self._buckets:
                    bucket.result()
                break
            except Exception as failure:  # noqa: BLE001 - Join.recover re-raises what it cannot recover
                self.recover(failure, REDUCING)

    def recover(self, failure: BaseException, phase: int) -> None:
        """Go on without the lost ranks (or raise): once the survivors agreed
        and moved onto their group (see :meth:`regroup`), a result handed over
        stands; otherwise this stage is done again on the new group: a
        reduction from the buffers as launched, a broadcast by its caller."""
        # Counted from the Join's entry, as ZeRO counts its rounds: the last Join's final
        # heartbeat was a reduction without a step.
        Join.recover(self.joinable, self._reductions - self._reductions_at_entry, phase, failure)
        if phase == REDUCING and not self._handoff:
            self._relaunch()

    def _relaunch(self) -> None:
        """Reduce every bucket again, as launched, on the survivors' group."""
        for bucket in self._buckets:
            if bucket.backup is not None:
                bucket.buffer.copy_(bucket.backup)
            else:
                self._refill(bucket)
            if self._divides_first(bucket):
                bucket.grads.div_(self._world_size)
            if self._carries_meta(bucket):
                meta = self._signal_meta(self._launched_training, bucket.buffer.dtype)
                bucket.meta.copy_(meta)
            if bucket.tail_len and self._rides(bucket):
                bucket.tail.copy_(self._arrival_flags(self._launched_training, bucket.tail))
            bucket.reduced = bucket.buffer if self._rides(bucket) else bucket.grads
            bucket.work = self._all_reduce(bucket.reduced)

    def _all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        """``dist.all_reduce(tensor, group=self.process_group, async_op=True)``,
        issued on the group itself: a bucket needs none of its checks, and
        its two Python frames cost each gradient reduction microseconds.

        When the Join goes on without a lost rank and already knows of one, the
        collective is refused at its issue (inside autograd's hook): the refusal
        is kept for the wait at the end of backward, where the survivors recover.
        """
        try:
            return self.process_group.allreduce([tensor], self._sum_options)
        except RankLostError as lost:
            if not self.keeps_copies:
                raise
            return _Refused(lost)

    def _refill(self, bucket: Bucket) -> None:
        """Write this rank's gradients into ``bucket`` again, as :meth:`_grad_ready` did:
        nothing has been written back to .grad (or the captured gradients) yet. A
        joined rank's buckets hold zeros."""
        if not self._launched_training:
            bucket.grads.zero_()
            return
        for position, param in enumerate(bucket.params):
            index = self._param_index[id(param)]
            grad = self._captured.get(index) if self._distributed else param.grad
            view = bucket.grad_view(position)
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad if grad.layout == torch.strided else grad.to_dense())

    def regroup(self, recovery: Recovery, first_phase: int) -> None:
        """Issue every later collective on the survivors' group (gradients are
        still divided by the initial world size, or by the ranks training).

        Survivors that finished a reduction the others failed in hand them
        its result: each then holds the same gradients for that iteration, the
        lost ranks' part included. A buffer broadcast some finished and
        others did not cannot be made whole (the buffers moved on since):
        raise."""
        self.process_group = recovery.group
        self.rank = recovery.rank
        self.buffer_src = 0
        self._meta_cache.clear()
        positions = recovery.positions
        broadcasts = [recovery.completed(position, first_phase + BROADCASTING) for position in positions]
        reductions = [recovery.completed(position, first_phase + REDUCING) for position in positions]
        low, high = min(reductions), max(reductions)
        broadcast_split = any(
            position % recovery.period == first_phase + BROADCASTING and done < max(broadcasts)
            for position, done in zip(positions, broadcasts)
        )
        behind_elsewhere = any(
            done == low and position != recovery.position(low, first_phase + REDUCING)
            for position, done in zip(positions, reductions)
        )
        if broadcast_split or high - low > 1 or (high > low and behind_elsewhere):
            where = ", ".join(
                f"rank {rank} in stage {position % recovery.period} of iteration {position // recovery.period}"
                for rank, position in zip(recovery.members, positions)
            )
            raise RankLostError(
                dict(recovery.lost),
                detail=f"DistributedDataParallel: the survivors cannot complete the interrupted step exactly "
                f"({where}); restart from a checkpoint",
            )
        if high == low:
            return
        src = global_rank(recovery.group, reductions.index(high))
        behind = reductions[recovery.rank] == low
        handoff = []
        for bucket in self._buckets:
            target = bucket.buffer if behind else bucket.completed
            assert target is not None
            handoff.append(dist.broadcast(target, src=src, group=recovery.group, async_op=True))
        if not behind:
            for work in handoff:
                work.wait()
            return
        # This reduction's result is what the survivors ahead got: take it as is.
        for bucket, work in zip(self._buckets, handoff):
            bucket.work = work
            bucket.reduced = bucket.buffer if self._rides(bucket) else bucket.grads
        self._handoff = True


def _graph_changed(index: int, param: torch.Tensor, learned: int) -> str:
    return (
        "Your training graph has changed in this iteration, e.g., one parameter is unused in first "
        "iteration, but then got used in the second iteration. this is not compatible with "
        f"static_graph set to True: parameter {index} (shape {tuple(param.shape)}) got a gradient "
        f"more than the {learned} time(s) the first iteration's backward gave it; pass "
        "static_graph=False (with find_unused_parameters=True if some parameters go unused)"
    )


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, a tensor or lists, tuples, dicts and dataclasses of them (as
    torch's DDP looks for them in a module's output)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name))


class _Refused(dist.Work):
    """A reduction the group refused at its issue: waiting raises why."""

    def __init__(self, failure: RankLostError) -> None:
        super().__init__()
        self.failure = failure

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        raise self.failure


def _ready_twice(index: int, param: torch.Tensor) -> str:
    return (
        f"Expected to mark a variable ready only once: DistributedDataParallel parameter {index} "
        f"(shape {tuple(param.shape)}) got a second gradient in one backward, after it was counted "
        "(reduced, or found unused by find_unused_parameters). It is used outside forward(), or in "
        "several reentrant backward passes (torch.utils.checkpoint(..., use_reentrant=True)); pass "
        "static_graph=True if the graph is the same every iteration, or use use_reentrant=False"
    )


def _remove_hooks(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
