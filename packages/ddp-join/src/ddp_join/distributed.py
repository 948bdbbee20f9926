"""DistributedDataParallel: gradient buckets all-reduced during backward,
correct under join_core.Join when ranks have uneven inputs."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from ddp_join._bucket import ALIGN_ELEMENTS as ALIGN_ELEMENTS
from ddp_join._bucket import Bucket, aligned, group_parameters
from ddp_join._dist_autograd import distributed_backward_running
from ddp_join._groups import global_rank, resolve_group
from ddp_join.comm_hooks import CommHook, GradBucket, allreduce_hook
from join_core import (
    DEFAULT_HANG_TIMEOUT,
    DEFAULT_LIVENESS_TIMEOUT,
    Join,
    JoinHook,
    RankLostError,
    Recovery,
    install_exit_grace,
    record_collectives,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DistributedDataParallel", "MixedPrecisionConfig"]

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)

#: With the default bucket size, the first bucket is small so its all-reduce
#: starts early in backward.
FIRST_BUCKET_BYTES: Final = 1024 * 1024
#: The size of a gradient bucket when ``bucket_cap_mb`` is None, as torch's.
DEFAULT_BUCKET_CAP_MB: Final = 25
# Float types that represent the heartbeat and flag counts exactly.
_EXACT_COUNT_DTYPES: Final = (torch.float32, torch.float64)


class MixedPrecisionConfig(Protocol):
    """What ``DistributedDataParallel(mixed_precision=...)`` reads: any object
    with these attributes, such as torch's ``MixedPrecision`` dataclasses.

    Only ``reduce_dtype`` is implemented (gradients are reduced in that dtype
    and cast back); ``param_dtype`` and ``buffer_dtype`` must be None or the
    module's own dtype (for low-precision compute, use ``torch.autocast``).
    """

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype of parameters in forward and backward."""

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are all-reduced in."""

    @property
    def buffer_dtype(self) -> torch.dtype | None:
        """The dtype of buffers."""


#: Attributes of DistributedDataParallel set during every step (never a parameter, buffer or module).
_PER_STEP_STATE: Final = frozenset(
    {
        "_open",
        "_callback_queued",
        "_next_launch",
        "_backward_started",
        "_meta_future",
        "_used",
        "_unused_now",
        "_hook_counts",
        "_buffer_src",
        "_used_since_sync",
        "_distributed",
        "_captured",
        "_reductions",
        "_launched_training",
        "_handoff",
    }
)


class DistributedDataParallel(torch.nn.Module, Generic[ModuleT]):
    """Data-parallel training of ``module`` across the ranks of a process group.

    Parameters and buffers are broadcast from rank 0 at construction. During
    backward, gradients are gathered into buckets (parameters in reverse
    order, about ``bucket_cap_mb`` MiB each), and each bucket is all-reduced
    as soon as it is full; when ``backward()`` returns, every ``.grad`` holds
    the average over the ranks.

    With uneven inputs, train under ``with model.join():`` (or
    ``join_core.Join([model, optimizer])``): ranks that run out shadow the
    others' collectives, receive the reduced gradients (so a sharded
    optimizer on a joined rank steps with the right ones), and at the end
    every rank takes the model of the last rank to join. A healthy iteration
    issues no collective beyond the buckets: the count of ranks still
    training rides in the first bucket.

    Under rpc-registry's distributed autograd (``dist_autograd.backward``
    inside ``dist_autograd.context()``), the gradients of the context are
    the ones averaged, as torch's: ``dist_autograd.get_gradients`` returns
    the averages and ``.grad`` is left alone. Gradients that reach this
    rank in later passes of the same backward (through RPC) wait for
    each other; the reduction ends in the pass that brings the last one.
    Sparse gradients (``Embedding(sparse=True)``) are reduced dense, and
    ``.grad`` is then dense.

    The arguments are torch's, in torch's order, with torch's defaults.

    Args:
        module: the model replicated on every rank; its parameters must all
            be on one device.
        device_ids: None for CPU modules or ``[i]`` for a module on ``cuda:i``.
        output_device: accepted for compatibility; outputs stay where the
            module puts them.
        dim: the dimension :meth:`scatter` splits inputs along and
            :meth:`gather` joins outputs along.
        broadcast_buffers: deprecated in torch 2.13 (a ``FutureWarning``), use
            ``forward_sync_buffers``; ``False`` also leaves buffers out of the
            broadcast at construction. None means True.
        init_sync: False skips the broadcast of parameters and buffers at
            construction; every rank must then already hold the same values.
        process_group: the group to train over (default: the world).
        bucket_cap_mb: the size of a gradient bucket in MiB (None: 25, with a
            smaller first bucket).
        find_unused_parameters: find the parameters a forward does not use,
            so their buckets need not wait for the end of backward, and leave
            ``.grad`` untouched for parameters no rank used. Either way a
            parameter without a gradient is reduced as zeros; nothing hangs.
        check_reduction: deprecated in torch and without effect (a
            ``FutureWarning`` when True).
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket,
            saving a copy and the memory of one set of gradients (not for
            buckets reduced in another dtype, see ``mixed_precision``).
        static_graph: the set of parameters used, and how often each one's
            gradient is accumulated, is the same every iteration. The first
            synchronizing backward learns both (so reentrant activation
            checkpointing, even of a parameter used twice, reduces the full
            gradient); later ones never traverse the autograd graph, and
            unused parameters behave as with ``find_unused_parameters``.
        delay_all_reduce_named_params: not supported: must be None.
        param_to_hook_all_reduce: not supported: must be None.
        mixed_precision: an object with ``param_dtype``, ``reduce_dtype`` and
            ``buffer_dtype`` (:class:`MixedPrecisionConfig`); gradients are
            all-reduced in ``reduce_dtype`` and cast back to the parameters'
            dtype. ``param_dtype`` and ``buffer_dtype`` must be None or the
            module's dtype.
        device_mesh: a 1-D ``DeviceMesh`` whose group to train over, instead
            of ``process_group``.
        skip_all_reduce_unused_params: not supported: must be False (unused
            parameters are reduced as zeros inside their bucket, at no extra
            collective).
        bucket_cap_mb_list: the cap of each bucket in MiB, in bucket order
            (the last repeats); overrides ``bucket_cap_mb``.
        batched_grad_copy: accepted, without effect: it only tunes kernel
            launches of torch's reducer.
        forward_sync_buffers: broadcast buffers (e.g. BatchNorm statistics)
            from one rank before each forward that synchronizes gradients,
            and after a Join. None means True. Buffers are still broadcast at
            construction (unless ``init_sync=False``).

    Example::

        model = DistributedDataParallel(torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for x, y in my_batches:  # may be fewer on some ranks
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
    """

    def __init__(
        self,
        module: ModuleT,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, torch.Tensor]] | None = None,
        param_to_hook_all_reduce: torch.Tensor | None = None,
        mixed_precision: MixedPrecisionConfig | None = None,
        device_mesh: DeviceMesh | None = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        super().__init__()
        install_exit_grace()  # this module holds the process group's threads to interpreter exit
        _reject_unsupported(
            delay_all_reduce_named_params, param_to_hook_all_reduce, skip_all_reduce_unused_params
        )
        if process_group is not None and device_mesh is not None:
            raise RuntimeError(
                "DistributedDataParallel(process_group=..., device_mesh=...): give one of them, not both"
            )
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(
                    f"DistributedDataParallel(device_mesh={device_mesh}): only a 1-D mesh is supported; "
                    "pass device_mesh[dim_name] for the data-parallel dimension"
                )
            process_group = device_mesh.get_group(mesh_dim=0)
        self.device_mesh = device_mesh
        self.process_group: dist.ProcessGroup
        self.process_group = group = resolve_group(process_group, "DistributedDataParallel")
        self._sum_options = dist.AllreduceOptions()  # reduceOp: SUM by default
        record_collectives()  # numbered from here on every rank: hang reports and desyncs name them
        self.module: ModuleT = module
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError(
                "DistributedDataParallel: the module has no parameter that requires a gradient; "
                "there is nothing to synchronize"
            )
        self.device: torch.device = self._check_device(module, device_ids)
        self.device_type: str = self.device.type
        self.device_ids: list[int | torch.device] | None
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.output_device = output_device
        self.dim = dim
        caps = _bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        if broadcast_buffers is not None:
            warnings.warn(
                "DistributedDataParallel(broadcast_buffers=...) is deprecated, as in torch: use "
                "forward_sync_buffers (which, unlike broadcast_buffers=False, still broadcasts "
                "buffers at construction)",
                FutureWarning,
                stacklevel=2,
            )
        if forward_sync_buffers is not None:
            self.forward_sync_buffers: bool = forward_sync_buffers
            init_sync_buffers = True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers is not False
        if check_reduction:
            warnings.warn(
                "DistributedDataParallel(check_reduction=True) is deprecated, as in torch, and has no "
                "effect: every bucket is reduced even when some parameters get no gradient",
                FutureWarning,
                stacklevel=2,
            )
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = mixed_precision
        self._reduce_dtype = _reduce_dtype(mixed_precision, self._params)
        #: False inside ``no_sync()``: gradients accumulate locally.
        self.require_backward_grad_sync: bool = True
        #: Whether forwards broadcast buffers (with ``forward_sync_buffers``).
        self.require_forward_param_sync = True

        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._buffers_list = list(module.buffers())
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self._comm_hook: CommHook | None = None  # None: the built-in averaging all-reduce
        self._comm_state: Any = None
        self._hook_registered = False
        self._used_since_sync = [False] * len(self._params)  # find_unused_parameters, across no_sync
        # Used flags ride in the metadata: with find_unused_parameters or static_graph.
        self._flags_in_meta = find_unused_parameters or static_graph
        # static_graph: how many times each gradient is accumulated per backward; None until learned.
        self._static_counts: list[int] | None = None
        self._divide_by_initial_world_size = True
        self._buffer_src = 0  # group rank whose buffers the next forward takes
        self._meta_cache: dict[tuple[float, bool, torch.dtype], torch.Tensor] = {}
        # Join(on_rank_lost="continue"): buckets keep copies (see Bucket), and a failed
        # collective is redone on the survivors' group.
        self._keeps_copies = False
        self._reductions = 0  # reductions completed on this rank (training or shadowing)
        self._launched_training = True  # whether bucket 0 was last launched by a training rank
        self._handoff = False  # this reduction's result came from a survivor that had finished it

        if init_sync:
            synced = list(module.parameters()) + (self._buffers_list if init_sync_buffers else [])
            self._broadcast_coalesced(synced, global_rank(group, 0))
        self._buckets = self._make_buckets(caps)
        self._where = {}  # param index -> (bucket, position)
        for bucket in self._buckets:
            for position, param in enumerate(bucket.params):
                self._where[self._param_index[id(param)]] = (bucket, position)
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_grad_hook(index))
            for index, param in enumerate(self._params)
        ] + [param.register_hook(self._make_capture_hook(index)) for index, param in enumerate(self._params)]
        self._reset_iteration()

    # Construction.

    @staticmethod
    def _check_device(
        module: torch.nn.Module, device_ids: Sequence[int | torch.device] | None
    ) -> torch.device:
        devices = {p.device for p in module.parameters()}
        if len(devices) != 1:
            found = ", ".join(sorted(map(str, devices))) or "none"
            raise ValueError(
                f"DistributedDataParallel(module): parameters must be on exactly one device, found {found}; "
                "move the module with module.to(device) first"
            )
        device = devices.pop()
        if device_ids is not None:
            if device.type == "cpu":
                raise ValueError(
                    f"DistributedDataParallel(device_ids={device_ids}): must be None for a module on the CPU"
                )
            if len(device_ids) != 1 or torch.device("cuda", torch.device(device_ids[0]).index or 0) != device:
                raise ValueError(
                    f"DistributedDataParallel(device_ids={device_ids}): must be [{device.index}], "
                    f"the device of the module's parameters ({device})"
                )
        return device

    def _make_buckets(self, caps: list[int]) -> list[Bucket]:
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
            dtype = self._reduce_dtype or params[0].dtype
            buffer = torch.zeros(meta_len + total, dtype=dtype, device=self.device)
            bucket = Bucket(index, params, offsets, meta_len, buffer)
            bucket.as_view = self.gradient_as_bucket_view and dtype == params[0].dtype
            if bucket.as_view:
                for position, param in enumerate(params):
                    param.grad = bucket.grad_view(position)
            buckets.append(bucket)
        return buckets

    # Public API.

    def __setattr__(self, name: str, value: Any) -> None:
        # The per-step bookkeeping is set many times a step: nn.Module's own
        # __setattr__ (a parameter, buffer or module check, ~4 us each) cost
        # about 6 % of a small model's step.
        if name in _PER_STEP_STATE:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; before, if this forward will synchronize gradients,
        tell the Join context and broadcast buffers."""
        syncing = torch.is_grad_enabled() and self.require_backward_grad_sync
        if syncing:
            self._check_prior_reduction()
            Join.notify_join_context(self)
            self._reset_iteration()
            self._open = True
            if self.will_sync_module_buffers():
                self._sync_buffers()
        output = self.module(*inputs, **kwargs)
        if self.static_graph:
            if syncing and self._static_counts is not None:
                # Learned in the first synchronizing backward: no graph traversal.
                self._used = [count > 0 for count in self._static_counts]
                self._unused_now.extend(i for i, count in enumerate(self._static_counts) if count == 0)
        elif self.find_unused_parameters and torch.is_grad_enabled():
            self._find_unused(output, syncing)
        if syncing:
            # Backward may reach no parameter of this rank at all, or reach the
            # first ones inside a nested (reentrant) backward: its end is
            # scheduled from the outputs, on the outermost backward.
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._start_backward)
        return output

    def will_sync_module_buffers(self) -> bool:
        """Whether a synchronizing forward broadcasts the module's buffers."""
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self._buffers_list) > 0

    def to_kwargs(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_id: int
    ) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
        """``inputs`` and ``kwargs`` with every tensor moved to device
        ``device_id`` of this module's device type, as one-element tuples
        (torch's layout: one entry per device)."""
        device = torch.device(self.device_type, device_id) if self.device_type != "cpu" else self.device
        moved_inputs = tuple(_to_device(value, device) for value in inputs)
        moved_kwargs = {key: _to_device(value, device) for key, value in (kwargs or {}).items()}
        return (moved_inputs,), (moved_kwargs,)

    def scatter(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_ids: Sequence[int | torch.device]
    ) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
        """Split ``inputs`` and ``kwargs`` along ``dim`` across ``device_ids``
        (``torch.nn.parallel.scatter_gather.scatter_kwargs``)."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: int | torch.device) -> Any:
        """Concatenate ``outputs`` along ``dim`` on ``output_device``
        (``torch.nn.parallel.scatter_gather.gather``; -1 means the CPU)."""
        return gather(outputs, output_device, dim=self.dim)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside issue no
        collective; the first one outside reduces the accumulated sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` instead of the
        default averaging all-reduce. Register before training, once.

        Joined ranks call the hook too, with zeros, so it must issue the same
        collectives whatever the values. Hooks other than :func:`allreduce_hook`
        cost one small all-reduce more per iteration under Join (the count of
        ranks still training can no longer ride in the first bucket).
        """
        if self._hook_registered:
            raise RuntimeError("DistributedDataParallel.register_comm_hook: a hook is already registered")
        if Join.is_active(self):
            raise RuntimeError("DistributedDataParallel.register_comm_hook: register before entering a Join")
        if not callable(hook):
            raise TypeError(f"DistributedDataParallel.register_comm_hook(hook={hook!r}): not callable")
        self._hook_registered = True
        if hook is allreduce_hook and state in (None, self.process_group):
            return  # the built-in reduction, which also carries the metadata
        self._comm_hook = hook
        self._comm_state = state

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
        *,
        liveness_timeout: timedelta | None = DEFAULT_LIVENESS_TIMEOUT,
        hang_timeout: timedelta | None = DEFAULT_HANG_TIMEOUT,
        on_rank_lost: Literal["raise", "continue"] = "raise",
    ) -> Join:
        """A :class:`join_core.Join` over this model alone.

        Args:
            divide_by_initial_world_size: True: each iteration's gradient is
                the sum over the ranks still training divided by the world
                size; False: divided by the number of ranks still training.
            enable: False turns join logic off (for inputs known to be even).
            throw_on_early_termination: raise on every rank as soon as one
                runs out of inputs.
            liveness_timeout: as :class:`join_core.Join`'s: a rank silent
                this long is lost and named on every other rank; None turns
                the watch off.
            hang_timeout: as :class:`join_core.Join`'s: a collective waiting
                this long makes every rank log a hang report naming the
                culprit; None turns the reports off.
            on_rank_lost: as :class:`join_core.Join`'s: ``"continue"`` lets
                the surviving ranks go on without a lost one.
        """
        return Join(
            [self],
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            liveness_timeout=liveness_timeout,
            hang_timeout=hang_timeout,
            on_rank_lost=on_rank_lost,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows this model's collectives on a joined rank.

        Args:
            divide_by_initial_world_size: see :meth:`join` (default True).
        """
        self._divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        return _DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the module's parameters."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The process group gradients are reduced over."""
        return self.process_group

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name of :attr:`forward_sync_buffers`; setting it sets that."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The inner module's state dict (keys without a ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict of the inner module."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # One iteration.

    @property
    def _carries(self) -> bool:
        """Whether the metadata (and Join's heartbeat) ride in bucket 0."""
        return self._meta_rides and self._comm_hook is None

    def _reset_iteration(self) -> None:
        self._open = False
        self._callback_queued = False
        self._next_launch = 0
        self._meta_future: torch.futures.Future[torch.Tensor] | None = None
        self._used = [True] * len(self._params)
        self._unused_now: list[int] = []  # find_unused_parameters: not reached by this forward
        self._hook_counts = [0] * len(self._params)  # static_graph: accumulations this backward
        self._backward_started = False
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
        def hook(param: torch.Tensor) -> None:
            if not self._open:
                return
            self._start_backward()
            if self.static_graph:
                self._hook_counts[index] += 1
                # Learning: every bucket is reduced at the end of backward. Later:
                # a gradient accumulated several times is ready at its last time.
                if self._static_counts is None or self._hook_counts[index] < self._static_counts[index]:
                    return
            self._grad_ready(index, param.grad)

        return hook

    def _make_capture_hook(self, index: int) -> Any:
        param = self._params[index]

        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            if not self._open or not distributed_backward_running():
                return None  # a local backward: the post-accumulate hook takes it
            self._start_backward()
            if not self._callback_queued:  # a later pass of the same distributed backward
                self._callback_queued = True
                Variable._execution_engine.queue_callback(self._finish_backward)
            if index in self._captured:
                raise RuntimeError(
                    f"DistributedDataParallel: parameter {index} (shape {tuple(param.shape)}) got a "
                    "second gradient in one distributed backward; a parameter's gradient may reach "
                    "DDP in one pass only (it is already being reduced)"
                )
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

        return hook

    def _check_prior_reduction(self) -> None:
        """Raise torch's error when a distributed backward left parameters unreduced."""
        if not (self._open and self._distributed and self._backward_started):
            return
        missing = [index for index in range(len(self._params)) if index not in self._captured]
        self._reset_iteration()
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new one: "
            f"the last distributed autograd backward gave no gradient to parameters {missing}. "
            "Pass find_unused_parameters=True when a forward does not use every parameter"
        )

    def _start_backward(self, _: object = None) -> None:
        """First gradient of a syncing backward: schedule the end, and count
        parameters this forward did not reach as ready."""
        if self._backward_started or not self._open:
            return
        self._backward_started = True
        self._distributed = distributed_backward_running()
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
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
        signal = Join.heartbeat_signal(self)
        key = (signal, training, dtype)
        cached = None if self._flags_in_meta else self._meta_cache.get(key)
        if cached is not None:
            return cached
        values = [0.0] * self._meta_len
        values[0] = signal
        if training:
            values[1 + self._rank] = 1.0
            if self._flags_in_meta:
                values[1 + self._world_size : 1 + self._world_size + len(self._used)] = [
                    float(used) for used in self._used
                ]
        meta = torch.tensor(values, dtype=dtype, device=self.device)
        if not self._flags_in_meta:
            self._meta_cache[key] = meta
        return meta

    def _divisor(self, meta: list[float]) -> int:
        if self._divide_by_initial_world_size or not meta:
            return self._world_size
        return max(1, round(sum(meta[1 : 1 + self._world_size])))

    def _rides(self, bucket: Bucket) -> bool:
        return bucket.meta_len > 0 and self._carries

    def _launch(self, bucket: Bucket, training: bool) -> None:
        rides = self._rides(bucket)
        if bucket.index == 0:
            self._launched_training = training
            if rides:
                bucket.buffer[: bucket.meta_len].copy_(self._signal_meta(training, bucket.buffer.dtype))
            elif self._flags_in_meta or Join.is_active(self):
                # The metadata cannot ride with these gradients: its own all-reduce, first.
                separate = self._signal_meta(training, torch.float32).clone()
                work = dist.all_reduce(separate, group=self.process_group, async_op=True)
                self._meta_future = work.get_future().then(lambda f: f.value()[0])
        if rides or self._comm_hook is None:
            # The built-in reduction, in place: waited for through its work, no callback.
            bucket.reduced = bucket.buffer if rides else bucket.grads
            if bucket.backup is not None:
                bucket.backup.copy_(bucket.buffer)  # gradient views: .grad is this buffer
            bucket.work = self._all_reduce(bucket.reduced)
            return
        if self._meta_future is not None and not self._divide_by_initial_world_size:
            divisor = self._divisor(self._meta_future.wait().tolist())
        else:
            divisor = self._world_size
        is_last = bucket.index == len(self._buckets) - 1
        grad_bucket = GradBucket(
            bucket.index, bucket.grads, bucket.params, is_last, divisor, self.process_group, bucket.offsets
        )
        bucket.future = self._comm_hook(self._comm_state, grad_bucket)

    def _finish_backward(self) -> None:
        """End of backward: reduce what is left, wait, and write the averaged
        gradients to ``.grad`` (or the distributed autograd context's); then
        hand Join the heartbeat."""
        if self._distributed and any(bucket.pending for bucket in self._buckets):
            # Gradients still to come in later passes of this distributed backward.
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
        self._reset_iteration()
        self._used_since_sync = [False] * len(self._params)
        if total is not None:
            Join.heartbeat_result(self, total)

    def _complete(self, shadow: bool) -> float | None:
        """Wait for each bucket in turn and write its gradients while later ones
        are still reduced; remember which rank's buffers to take next; return the
        carried heartbeat, if any."""
        if self._keeps_copies:
            self._await_reductions()
        first = self._buckets[0]
        first_result = first.result()
        meta: list[float] = []
        if self._rides(first):
            meta = first_result[: first.meta_len].tolist()
        elif self._meta_future is not None:
            meta = self._meta_future.wait().tolist()
        divisor = self._divisor(meta)
        used = (
            [count > 0 for count in meta[1 + self._world_size : 1 + self._world_size + len(self._params)]]
            if self._flags_in_meta and meta
            else None
        )
        for bucket in self._buckets:
            result = first_result if bucket is first else bucket.result()
            builtin = bucket.work is not None  # reduced in place, into this bucket's buffer
            scale = divisor if builtin else 1  # hooks divide themselves
            grads = bucket.grads if builtin else result
            if bucket.as_view:
                if grads.data_ptr() != bucket.grads.data_ptr():
                    bucket.grads.copy_(grads)
                if scale != 1:
                    bucket.grads.div_(scale)
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
                else:
                    torch.div(reduced, scale, out=param.grad)
        if meta and not self._handoff:  # a handed-over result's flags are by the former group's ranks
            for rank, flag in enumerate(meta[1 : 1 + self._world_size]):
                if flag > 0:
                    self._buffer_src = rank
                    break
        self._handoff = False
        self._reductions += 1
        if self._keeps_copies:
            for bucket in self._buckets:
                bucket.keep_reduced()
        return meta[0] if self._rides(first) else None

    def _write_captured(
        self, index: int, bucket: Bucket, position: int, grads: torch.Tensor, scale: int, builtin: bool
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

    def _find_unused(self, output: Any, syncing: bool) -> None:
        """Note which parameters the autograd graph of ``output`` reaches.

        Usage accumulates over ``no_sync`` forwards until the next reduction.
        For a syncing forward, the parameters it did not reach are reduced
        with what they hold once its backward starts."""
        reached: set[int] = set()
        seen: set[Any] = set()
        outputs = [t for t in _tensors(output) if t.requires_grad]
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

    # Going on without a lost rank (Join(on_rank_lost="continue")).

    def _await_reductions(self) -> None:
        """Wait for every bucket's reduction; when one fails because a rank was
        lost, complete it on the survivors' group."""
        while True:
            try:
                for bucket in self._buckets:
                    bucket.result()
                break
            except Exception as failure:  # noqa: BLE001 - Join.recover re-raises what it cannot recover
                self._recover(failure, _REDUCING)

    def _recover(self, failure: BaseException, phase: int) -> None:
        """Go on without the lost ranks (or raise): once the survivors agreed
        and moved onto their group (see :meth:`_regroup`), a result handed over
        stands; otherwise this stage is done again on the new group: a
        reduction from the buffers as launched, a broadcast by its caller."""
        Join.recover(self, self._reductions, phase, failure)
        if phase == _REDUCING and not self._handoff:
            self._relaunch()

    def _relaunch(self) -> None:
        """Reduce every bucket again, as launched, on the survivors' group."""
        for bucket in self._buckets:
            if bucket.backup is not None:
                bucket.buffer.copy_(bucket.backup)
            else:
                self._refill(bucket)
            if self._rides(bucket):
                meta = self._signal_meta(self._launched_training, bucket.buffer.dtype)
                bucket.buffer[: bucket.meta_len].copy_(meta)
            bucket.reduced = bucket.buffer if self._rides(bucket) else bucket.grads
            bucket.work = self._all_reduce(bucket.reduced)

    def _all_reduce(self, tensor: torch.Tensor) -> dist.Work:
        """``dist.all_reduce(tensor, group=self.process_group, async_op=True)``,
        issued on the group itself: a bucket needs none of its checks, and
        its two Python frames cost each gradient reduction microseconds."""
        return self.process_group.allreduce([tensor], self._sum_options)

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

    def _regroup(self, recovery: Recovery, first_phase: int) -> None:
        """Issue every later collective on the survivors' group (gradients are
        still divided by the initial world size, or by the ranks training).

        Survivors that finished a reduction the others failed in hand them
        its result: each then holds the same gradients for that iteration, the
        lost ranks' part included. A buffer broadcast some finished and
        others did not cannot be made whole (the buffers moved on since):
        raise."""
        self.process_group = recovery.group
        self._rank = recovery.rank
        self._buffer_src = 0
        self._meta_cache.clear()
        positions = recovery.positions
        broadcasts = [recovery.completed(position, first_phase + _BROADCASTING) for position in positions]
        reductions = [recovery.completed(position, first_phase + _REDUCING) for position in positions]
        low, high = min(reductions), max(reductions)
        broadcast_split = any(
            position % recovery.period == first_phase + _BROADCASTING and done < max(broadcasts)
            for position, done in zip(positions, broadcasts)
        )
        behind_elsewhere = any(
            done == low and position != recovery.position(low, first_phase + _REDUCING)
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

    # Collectives outside backward.

    def _sync_buffers(self) -> None:
        while self._buffers_list:
            try:
                src = global_rank(self.process_group, self._buffer_src)
                self._broadcast_coalesced(self._buffers_list, src)
                return
            except Exception as failure:
                if not self._keeps_copies:
                    raise
                self._recover(failure, _BROADCASTING)  # then again, from the survivors' rank 0

    def _broadcast_coalesced(self, tensors: list[torch.Tensor], src: int) -> None:
        """Broadcast tensors from global rank ``src``, one collective per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                dist.broadcast(flat, src=src, group=self.process_group)
                offset = 0
                for tensor in group:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()


_BROADCASTING: Final = 0  # position phases: the buffer broadcast before a reduction,
_REDUCING: Final = 1  # and the reduction


def _reject_unsupported(
    delay_all_reduce_named_params: object,
    param_to_hook_all_reduce: object,
    skip_all_reduce_unused_params: bool,
) -> None:
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise ValueError(
            "DistributedDataParallel(delay_all_reduce_named_params="
            f"{'...' if delay_all_reduce_named_params is not None else None}, param_to_hook_all_reduce="
            f"{'...' if param_to_hook_all_reduce is not None else None}): delaying some parameters' "
            "all-reduce to another parameter's hook is not supported; leave both None (every gradient "
            "is reduced in its bucket during backward)"
        )
    if skip_all_reduce_unused_params:
        raise ValueError(
            "DistributedDataParallel(skip_all_reduce_unused_params=True): not supported; leave it False "
            "and use find_unused_parameters=True or static_graph=True: unused parameters are then reduced "
            "as zeros inside their bucket, at no extra collective, and keep their .grad"
        )


def _bucket_caps(bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None) -> list[int]:
    """Byte caps of buckets 0, 1, ... (the last repeats), as torch computes them."""
    mib = 1024 * 1024
    if bucket_cap_mb is not None and bucket_cap_mb <= 0:
        raise ValueError(f"DistributedDataParallel(bucket_cap_mb={bucket_cap_mb}): must be positive")
    if bucket_cap_mb_list is not None:
        if not bucket_cap_mb_list or any(cap <= 0 for cap in bucket_cap_mb_list):
            raise ValueError(
                f"DistributedDataParallel(bucket_cap_mb_list={list(bucket_cap_mb_list)}): "
                "must be a non-empty list of positive sizes in MiB, or None"
            )
        return [int(cap * mib) for cap in bucket_cap_mb_list]
    if bucket_cap_mb is None:
        return [FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * mib]
    return [int(bucket_cap_mb * mib)]


def _reduce_dtype(
    config: MixedPrecisionConfig | None, params: list[torch.nn.Parameter]
) -> torch.dtype | None:
    """The dtype to reduce gradients in, or None for the parameters' own."""
    if config is None:
        return None
    dtypes = {p.dtype for p in params}
    for name in ("param_dtype", "buffer_dtype"):
        value = getattr(config, name, None)
        if value is not None and dtypes != {value}:
            raise ValueError(
                f"DistributedDataParallel(mixed_precision.{name}={value}): only reduce_dtype is supported; "
                f"set {name}=None, and for low-precision compute run the forward under torch.autocast"
            )
    reduce_dtype = getattr(config, "reduce_dtype", None)
    if reduce_dtype is not None and not (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        raise ValueError(
            f"DistributedDataParallel(mixed_precision.reduce_dtype={reduce_dtype!r}): must be a floating "
            "torch.dtype such as torch.bfloat16, or None"
        )
    return reduce_dtype if reduce_dtype is not None and dtypes != {reduce_dtype} else None


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to_device(item, device) for item in value)
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _DDPJoinHook(JoinHook):
    """Shadows one DistributedDataParallel iteration on a joined rank: the
    buffer broadcast, then every bucket (zeros) through the same reduction."""

    regroup_phases = 2  # the buffer broadcast, then the gradient reduction

    def __init__(self, ddp: DistributedDataParallel[Any]) -> None:
        self.ddp = ddp

    @property
    def carries_heartbeat(self) -> bool:  # type: ignore[override]
        return self.ddp._carries

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._reset_iteration()
        if ddp.will_sync_module_buffers():
            ddp._sync_buffers()
        self._reduce_zeros()

    def _reduce_zeros(self) -> None:
        ddp = self.ddp
        for bucket in ddp._buckets:
            bucket.grads.zero_()
        # Every bucket at once, as a training rank issues them. When all ranks
        # have joined, all of them are here issuing the same, so nothing is
        # left unmatched even though nobody needed the result.
        for bucket in ddp._buckets:
            ddp._launch(bucket, training=False)
        if ddp._keeps_copies:
            ddp._await_reductions()
        if self.carries_heartbeat and not Join.heartbeat_result(ddp, float(ddp._buckets[0].result()[0])):
            for bucket in ddp._buckets[1:]:
                bucket.result()
            ddp._reset_iteration()
            ddp._reductions += 1
            return  # every rank has joined
        ddp._complete(shadow=True)
        ddp._reset_iteration()

    def enter_hook(self) -> None:
        ddp = self.ddp
        ddp._keeps_copies = Join.continues_on_loss(ddp)
        for bucket in ddp._buckets:
            bucket.keep_copies(ddp._keeps_copies)

    def exit_hook(self) -> None:
        ddp = self.ddp
        ddp._keeps_copies = False
        for bucket in ddp._buckets:
            bucket.keep_copies(False)

    def regroup_hook(self, recovery: Recovery, first_phase: int) -> None:
        self.ddp._regroup(recovery, first_phase)

    def abort_hook(self) -> None:
        ddp = self.ddp
        if not ddp._open:
            return
        # The rank failed between this iteration's forward and the end of its
        # backward: reduce the buckets it still owes (zeros for missing gradients).
        for index in range(len(ddp._params)):
            bucket, position = ddp._where[index]
            if not bucket.ready[position]:
                ddp._grad_ready(index, None)
        total = ddp._complete(shadow=True)
        ddp._reset_iteration()
        if total is not None:
            Join.heartbeat_result(ddp, total)

    def post_hook(self, is_last_joiner: bool) -> None:
        # Every rank takes the model of the highest-ranked last joiner.
        ddp = self.ddp
        candidate = torch.tensor([ddp._rank if is_last_joiner else -1], device=ddp.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=ddp.process_group)
        src = global_rank(ddp.process_group, int(candidate.item()))
        buffers = ddp._buffers_list if ddp.forward_sync_buffers else []
        ddp._broadcast_coalesced(list(ddp.module.parameters()) + buffers, src)
        ddp._buffer_src = 0  # after the Join, buffers come from rank 0 again
