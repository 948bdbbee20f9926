"""DistributedDataParallel: gradient buckets all-reduced during backward,
correct under join_core.Join when ranks have uneven inputs.

This module holds the module wrapper (its arguments, forward, the buffer
broadcast); the buckets, the autograd hooks and the all-reduces are its
reducer's (``ddp_join._reducer``), what a joined rank issues is its Join
hook's (``ddp_join._join_hook``)."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs
from torch.nn.utils.rnn import PackedSequence

from ddp_join._bucket import ALIGN_ELEMENTS as ALIGN_ELEMENTS
from ddp_join._groups import global_rank, resolve_group
from ddp_join._join_hook import DDPJoinHook
from ddp_join._reducer import BROADCASTING, Reducer, tensors_in
from ddp_join.comm_hooks import CommHook, allreduce_hook
from join_core import (
    DEFAULT_HANG_TIMEOUT,
    DEFAULT_LIVENESS_TIMEOUT,
    Join,
    JoinHook,
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

    Pickling (``torch.save(model)``) works as torch's: only over the default
    process group; loading needs ``init_process_group`` called first, gives a
    wrapper with the same arguments over the default group, broadcasts
    nothing, and drops the communication hook.

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
            so their buckets need not wait for the end of backward, and, as
            torch's, leave ``.grad`` untouched for parameters whose gradient
            arrived on no rank (an output the loss leaves out included).
            Either way a parameter without a gradient is reduced as zeros;
            nothing hangs.
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
                "Cannot specify both process_group and device_mesh arguments: DistributedDataParallel("
                "process_group=..., device_mesh=...) takes one of them, not both"
            )
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise RuntimeError(
                    f"Only 1D device mesh is supported, but got {device_mesh}: pass "
                    "device_mesh[dim_name] for the data-parallel dimension"
                )
            process_group = device_mesh.get_group(mesh_dim=0)
        self.device_mesh = device_mesh
        # What a deep copy is built with (see __deepcopy__).
        self._copy_arguments: dict[str, Any] = {
            "device_ids": device_ids,
            "output_device": output_device,
            "dim": dim,
            "process_group": process_group if device_mesh is None else None,
            "bucket_cap_mb": bucket_cap_mb,
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "mixed_precision": mixed_precision,
            "device_mesh": device_mesh,
            "bucket_cap_mb_list": bucket_cap_mb_list,
            "batched_grad_copy": batched_grad_copy,
        }
        group = resolve_group(process_group, "DistributedDataParallel")
        record_collectives()  # numbered from here on every rank: hang reports and desyncs name them
        self.module: ModuleT = module
        #: Names of parameters and buffers left alone (torch's ``_ddp_params_and_buffers_to_ignore``,
        #: see :meth:`_set_params_and_buffers_to_ignore_for_model`): not broadcast, not reduced.
        self.parameters_to_ignore: set[str] = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        params = [p for p in self._synced_parameters() if p.requires_grad]
        if not params:
            raise RuntimeError(  # torch's type and words first, which callers may match
                "DistributedDataParallel is not needed when a module doesn't have any parameter that "
                "requires a gradient: there is nothing to synchronize"
            )
        self.device: torch.device = self._check_device(module, device_ids)
        self.device_type: str = self.device.type
        self.device_ids: list[int | torch.device] | None
        self.device_ids = list(device_ids) if device_ids is not None else None
        self.is_multi_device_module: bool = False
        """Whether the module's parameters are on several devices: always False, as one device
        is required (torch's attribute)."""
        self.skip_all_reduce_unused_params: bool = skip_all_reduce_unused_params
        """The constructor's argument (only False is supported), as torch's attribute."""
        self.use_side_stream_for_tensor_copies: bool = (
            os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
        )
        """torch's attribute: whether the environment variable ``PYTORCH_DDP_USE_SIDE_STREAM`` (default
        ``"1"``) was ``"1"`` at construction. It has no effect here: torch copies inputs to the device
        on a side stream with it; ours leaves inputs where they are, and ``to_kwargs()`` copies on the
        current stream."""
        self.output_device = output_device
        self.dim = dim
        caps = _bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        # torch's bucket sizes, for code written against its wrapper (ours buckets by ``caps``).
        self.bucket_bytes_cap: int = max(caps) if bucket_cap_mb_list is not None else caps[-1]
        """The bucket size in bytes (the largest of ``bucket_cap_mb_list``), as torch's."""
        self.bucket_bytes_cap_list: list[int] = list(caps) if bucket_cap_mb_list is not None else []
        """Each bucket's size in bytes, from ``bucket_cap_mb_list`` (else empty), as torch's."""
        self.bucket_bytes_cap_default: bool = bucket_cap_mb is None and bucket_cap_mb_list is None
        """Whether the default sizes apply (a small first bucket, then 25 MiB), as torch's."""
        self.broadcast_bucket_size: int = 250 * 1024 * 1024
        """The size of the chunks torch broadcasts parameters in (250 MiB), as torch's."""
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
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = mixed_precision
        _reduce_dtype(mixed_precision, params)  # refused before the broadcast, on every rank alike
        #: False inside ``no_sync()``: gradients accumulate locally.
        self.require_backward_grad_sync: bool = True
        #: Whether forwards broadcast buffers (with ``forward_sync_buffers``).
        self.require_forward_param_sync = True

        self._buffers_list = self._synced_buffers()
        self._hook_registered = False
        self.register_load_state_dict_pre_hook(_keys_under_module)  # type: ignore[no-untyped-call]
        if init_sync:
            synced = self._synced_parameters() + (self._buffers_list if init_sync_buffers else [])
            _check_same_tensors(synced, group, self.device)
            self._broadcast_coalesced(synced, global_rank(group, 0), group)
        self._reducer = self._build_reducer(group, static_graph)

    # Construction.

    def _build_reducer(self, group: dist.ProcessGroup, static_graph: bool) -> Reducer:
        """A reducer of the module's synchronized parameters that require a gradient, over
        ``group``, as the arguments and attributes say (at construction, and when unpickled)."""
        params = [p for p in self._synced_parameters() if p.requires_grad]
        arguments = self._copy_arguments
        return Reducer(
            self,
            params,
            group,
            self.device,
            _bucket_caps(arguments["bucket_cap_mb"], arguments["bucket_cap_mb_list"]),
            reduce_dtype=_reduce_dtype(self.mixed_precision, params),
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=static_graph,
        )

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

    # Public API.

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; before, if this forward will synchronize gradients,
        tell the Join context and broadcast buffers. With ``device_ids``, the
        tensors in the inputs are moved to the module's device first (see
        :meth:`to_kwargs`), as torch's wrapper does."""
        if self.device_ids:  # as torch's: inputs go to the module's device
            (inputs,), (kwargs,) = self.to_kwargs(inputs, kwargs, self.device.index or 0)
        syncing = torch.is_grad_enabled() and self.require_backward_grad_sync
        reducer = self._reducer
        if syncing:
            reducer.check_prior_reduction()
            Join.notify_join_context(self)
            reducer.reset_iteration(opening=True)
            if self.will_sync_module_buffers():
                self._sync_buffers()
        output = self.module(*inputs, **kwargs)
        if syncing and not reducer.iteration_open:
            return output  # its backward ran inside the module's forward (see prepare_for_backward)
        if reducer.static_graph:
            if syncing:
                reducer.use_static_counts()  # learned in the first synchronizing backward
        elif self.find_unused_parameters and torch.is_grad_enabled():
            reducer.find_unused(output, syncing)
        if syncing:
            # Backward may reach no parameter of this rank at all, or reach the
            # first ones inside a nested (reentrant) backward: its end is
            # scheduled from the outputs, on the outermost backward.
            for tensor in tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(reducer.start_backward)
        return output

    def prepare_for_backward(self, output: Any) -> None:
        """Before a backward that runs inside ``forward()`` (Lightning's manual
        optimization calls the module's backward in its training step): note
        which parameters ``output``'s graph reaches, as ``forward()`` does with
        its own output afterwards, so that with ``find_unused_parameters=True``
        the others keep their ``.grad`` (None) instead of getting zeros (with
        ``static_graph``, once learned, from what the first backward used).
        torch has it as ``reducer.prepare_for_backward``; otherwise it does
        nothing."""
        reducer = self._reducer
        if not reducer.iteration_open:
            return
        if reducer.static_graph:
            reducer.use_static_counts()
        elif self.find_unused_parameters:
            reducer.find_unused(output, syncing=True)

    def will_sync_module_buffers(self) -> bool:
        """Whether a synchronizing forward broadcasts the module's buffers."""
        return self.require_forward_param_sync and self.forward_sync_buffers and len(self._buffers_list) > 0

    def to_kwargs(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None, device_id: int
    ) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
        """``inputs`` and ``kwargs`` with every tensor moved to device
        ``device_id`` of this module's device type, as one-element tuples
        (torch's layout: one entry per device). As torch's, tensors are found
        in tuples, named tuples, lists and dicts (which keep their types), and
        a ``PackedSequence`` moves whole."""
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
            raise TypeError(
                f"Communication hook must be callable: DistributedDataParallel.register_comm_hook(hook={hook!r})"
            )
        self._hook_registered = True
        if hook is allreduce_hook and state in (None, self.process_group):
            return  # the built-in reduction, which also carries the metadata
        self._reducer.comm_hook = hook
        self._reducer.comm_state = state

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
        self._reducer.divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        return DDPJoinHook(self, self._reducer)

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The process group gradients are reduced over (after Join went on
        without a lost rank: the survivors' group)."""
        return self._reducer.process_group

    @process_group.setter
    def process_group(self, value: dist.ProcessGroup) -> None:
        self._reducer.process_group = value

    @property
    def static_graph(self) -> bool:
        """Whether the set of parameters used, and how often each one's
        gradient is accumulated, is the same every iteration (see the
        constructor)."""
        return self._reducer.static_graph

    @static_graph.setter
    def static_graph(self, value: bool) -> None:
        self._reducer.static_graph = value

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

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: torch.nn.Module, params_and_buffers_to_ignore: Any
    ) -> None:
        """Leave the parameters and buffers named in ``params_and_buffers_to_ignore`` (as
        ``module.named_parameters()`` names them) out of every broadcast and reduction of a
        wrapper made of ``module`` afterwards; torch's (tensor parallelism beside DDP uses it)."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    def _synced_parameters(self) -> list[torch.nn.Parameter]:
        return [p for name, p in self.module.named_parameters() if name not in self.parameters_to_ignore]

    def _synced_buffers(self) -> list[torch.Tensor]:
        return [b for name, b in self.module.named_buffers() if name not in self.parameters_to_ignore]

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        """The module's buffers that are broadcast (those not in :attr:`parameters_to_ignore`),
        as the module holds them now (torch's attribute, which it refreshes at each broadcast)."""
        return self._synced_buffers()

    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        """:attr:`modules_buffers` by name, as ``module.named_buffers()`` names them (torch's attribute)."""
        return {name: b for name, b in self.module.named_buffers() if name not in self.parameters_to_ignore}

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedDataParallel[ModuleT]:
        """A wrapper of its own, with the same arguments and process group, around a deep copy
        of the module (e.g. for an EMA model); as torch's copy, it has no communication hook
        and broadcasts nothing when made. Every rank copies at the same point."""
        module = copy.deepcopy(self.module, memo)
        return type(self)(
            module, init_sync=False, forward_sync_buffers=self.forward_sync_buffers, **self._copy_arguments
        )

    def __getstate__(self) -> dict[str, Any]:
        """What pickling keeps, as torch's: the attributes and the module, without the reducer
        (so without a communication hook: register it again after loading). Only a wrapper over
        the default process group can be pickled."""
        if not dist.is_initialized():
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process "
                "group: no default process group is initialized (destroyed?); pickle model.module or "
                "model.state_dict() instead, or pickle the wrapper before destroy_process_group()"
            )
        if self.process_group != dist.group.WORLD:
            raise RuntimeError(
                "DDP Pickling/Unpickling are only supported when using DDP with the default process "
                "group: this DistributedDataParallel reduces over another one (its process_group or "
                "device_mesh argument, or the survivors' group after a rank was lost); pickle "
                "model.module or model.state_dict() instead, or wrap the module without process_group "
                "and device_mesh"
            )
        state = self.__dict__.copy()
        del state["_reducer"]
        state["_copy_arguments"] = {**self._copy_arguments, "process_group": None}
        state["_hook_registered"] = False
        state["static_graph"] = self.static_graph
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling, as torch's: a reducer over the default process group, with the same
        arguments; nothing is broadcast. Needs ``init_process_group`` called first."""
        group = resolve_group(None, "unpickling DistributedDataParallel")
        state = dict(state)
        static_graph: bool = state.pop("static_graph")
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        install_exit_grace()
        record_collectives()
        self._reducer = self._build_reducer(group, static_graph)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The inner module's state dict (keys without a ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict of the inner module."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # Collectives outside backward.

    def _sync_buffers(self) -> None:
        reducer = self._reducer
        # Read again: a forward may reassign a buffer (self.count = self.count + 1), and .to()
        # or .double() replace them; the old tensors are nobody's any more.
        self._buffers_list = self._synced_buffers()
        while self._buffers_list:
            try:
                group = reducer.process_group
                self._broadcast_coalesced(self._buffers_list, global_rank(group, reducer.buffer_src), group)
                return
            except Exception as failure:
                if not reducer.keeps_copies:
                    raise
                reducer.recover(failure, BROADCASTING)  # then again, from the survivors' rank 0

    def _broadcast_coalesced(self, tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup) -> None:
        """Broadcast tensors from global rank ``src`` over ``group``, one collective per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
        with torch.no_grad():
            for same_dtype in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
                dist.broadcast(flat, src=src, group=group)
                offset = 0
                for tensor in same_dtype:
                    tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

    def _take_last_joiners_model(self, is_last_joiner: bool) -> None:
        """After a Join: every rank takes the model of the highest-ranked last joiner."""
        reducer = self._reducer
        group = reducer.process_group
        candidate = torch.tensor([reducer.rank if is_last_joiner else -1], device=self.device)
        dist.all_reduce(candidate, op=dist.ReduceOp.MAX, group=group)
        src = global_rank(group, int(candidate.item()))
        buffers = self._synced_buffers() if self.forward_sync_buffers and self._buffers_list else []
        self._broadcast_coalesced(self._synced_parameters() + buffers, src, group)
        reducer.buffer_src = 0  # after the Join, buffers come from rank 0 again


def _check_same_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise on every rank of ``group`` unless all hold as many tensors, of the same shapes
    and dtypes, as rank 0 (torch checks the parameters before its broadcast too; a broadcast
    of different tensors fails, or silently mixes them up)."""
    layout = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in tensors).encode()
    mine = torch.tensor([len(tensors), zlib.crc32(layout)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    seen = [(int(count), int(digest)) for count, digest in (t.tolist() for t in everyone)]
    differ = [rank for rank, entry in enumerate(seen) if entry != seen[0]]
    if differ:
        counts = ", ".join(f"rank {rank}: {seen[rank][0]}" for rank in [0, *differ])
        raise RuntimeError(
            f"DDP expects same model across all ranks, but rank(s) {differ} hold parameters and buffers "
            f"of other shapes or dtypes than rank 0 ({counts} tensors): build the same module on every "
            "rank (or set the differing ones aside with _set_params_and_buffers_to_ignore_for_model)"
        )


def _keys_under_module(
    wrapper: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: object
) -> None:
    """A parent module loads a state dict holding this wrapper: its keys come without
    ``module.`` (see ``state_dict()``), where the inner module's loader looks for them. Keys
    that are not the inner module's own (torch's, saved with ``module.``) stay as they are."""
    inner = wrapper.get_submodule("module")
    own = set(inner.state_dict(keep_vars=True))
    for key in [key for key in state_dict if key.startswith(prefix) and key[len(prefix) :] in own]:
        state_dict[f"{prefix}module.{key[len(prefix) :]}"] = state_dict.pop(key)


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


def _is_size(value: object) -> bool:
    """Whether ``value`` is a positive, finite number of MiB."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def _bucket_caps(bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None) -> list[int]:
    """Byte caps of buckets 0, 1, ... (the last repeats), as torch computes them."""
    mib = 1024 * 1024
    if bucket_cap_mb is not None and not _is_size(bucket_cap_mb):
        raise ValueError(
            f"DistributedDataParallel(bucket_cap_mb={bucket_cap_mb!r}): must be positive (a size in MiB), or None"
        )
    if bucket_cap_mb_list is not None:
        given: object = bucket_cap_mb_list  # as passed, whatever the annotation says
        if not isinstance(given, Sequence) or not given or not all(_is_size(cap) for cap in given):
            raise ValueError(
                f"DistributedDataParallel(bucket_cap_mb_list={bucket_cap_mb_list!r}): "
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
    if isinstance(value, PackedSequence):  # whole: its batch sizes stay on the CPU
        return value.to(device)  # type: ignore[arg-type]  # (typed as Tensor.to's first overload)
    if isinstance(value, tuple):
        items = [_to_device(item, device) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    if isinstance(value, dict):
        entries = {key: _to_device(item, device) for key, item in value.items()}
        if type(value) is dict:
            return entries
        try:
            return type(value)(entries)  # as torch's (an OrderedDict, a ModelOutput)
        except TypeError:  # e.g. a defaultdict, whose first argument is its factory
            moved = copy.copy(value)
            moved.update(entries)
            return moved
    return value
