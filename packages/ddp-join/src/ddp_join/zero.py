"""ZeroRedundancyOptimizer: optimizer state sharded across ranks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any, Final, overload

import torch
import torch.distributed as dist

from ddp_join._groups import PeerFailedError, gather_bytes, global_rank, pass_bytes, resolve_group
from ddp_join.optimizer_state import decode_state, encode_state, state_limit
from join_core import Join, JoinHook, RankLostError, Recovery, install_exit_grace, record_collectives

__all__ = ["ZeroRedundancyOptimizer"]

#: Without bucket views, parameters are broadcast in place, except that runs
#: of smaller ones go together through a flat buffer of at most this size:
#: one collective for many small tensors, and never a copy of a whole shard.
COALESCE_BYTES: Final = 1 << 20


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_class`` so that each rank keeps the state of only its
    shard of the parameters.

    ``step()`` updates this rank's shard with the local optimizer, then every
    shard is broadcast from its owner, so all ranks end the step with the full,
    identical parameters. Works under ``join_core.Join([model, optimizer])``:
    a joined rank keeps stepping its shard (with the gradients the joined
    model received) and broadcasting it.

    Args:
        params: the parameters, or parameter groups (dicts), as for any
            torch optimizer.
        optimizer_class: the optimizer each rank runs on its shard, e.g.
            ``torch.optim.Adam``.
        process_group: the group to shard over (default: the world).
        parameters_as_bucket_view: keep each rank's parameters as views into
            one flat buffer per dtype, so a shard is broadcast without copies.
        overlap_with_ddp: step each DDP bucket's shard as soon as the bucket
            is reduced, from the communication hook
            :func:`ddp_join.hook_with_zero_step` (register it on the model);
            ``step()`` then steps nothing again.
        shard_replicas: (keyword, ours) 1: each rank also keeps, and steps, a replica of the
            shard of the rank one host lower (``LOCAL_WORLD_SIZE`` ranks
            lower, as torchrun numbers ranks host by host; the next lower
            rank without it): its optimizer state, as the gradients and
            parameters are there already. So the state survives the loss of
            its owner, or of the owner's whole host, under
            ``Join(on_rank_lost="continue")``: the replica's holder takes the
            shard over. Costs one more shard of optimizer state and of
            optimizer compute per rank, one small all-reduce at construction,
            and no communication per step. 0 (the default): no replica.
        defaults: keyword arguments of ``optimizer_class`` (``lr=...``).

    Attributes:
        optim: the local optimizer, over this rank's shard.
        rank: this rank in ``process_group``.
        global_rank: this rank in the default process group.
        world_size: the size of ``process_group``.
        initialized: True once construction is done (``add_param_group`` then
            shards the group it adds), as torch's.

    Example::

        model = ddp_join.DistributedDataParallel(net)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        with join_core.Join([model, optimizer]):
            for batch in my_batches:
                model(batch).sum().backward()
                optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        # Ours, taken from the keywords so that the signature stays torch's.
        shard_replicas = defaults.pop("shard_replicas", 0)
        if shard_replicas not in (0, 1):
            raise ValueError(
                f"ZeroRedundancyOptimizer(shard_replicas={shard_replicas!r}): must be 0 or 1 "
                "(one replica of each shard, on the next rank)"
            )
        if shard_replicas and overlap_with_ddp:
            raise ValueError(
                "ZeroRedundancyOptimizer(shard_replicas=1, overlap_with_ddp=True): replicas are stepped in "
                "step(); use overlap_with_ddp=False"
            )
        self.shard_replicas: int = shard_replicas
        self.overlap_with_ddp = overlap_with_ddp
        self.process_group: dist.ProcessGroup
        self.process_group = group = resolve_group(process_group, "ZeroRedundancyOptimizer")
        record_collectives()  # numbered from here on every rank: hang reports and desyncs name them
        self.rank: int = dist.get_rank(group)
        self.global_rank: int = global_rank(group, self.rank)
        self.world_size: int = dist.get_world_size(group)
        self.optimizer_class = optimizer_class
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._owner: dict[int, int] = {}  # id(param) -> rank that steps it
        self._load = [0] * self.world_size  # elements owned per rank
        self.initialized: bool = False
        self._consolidated: list[dict[int, Any]] | None = None
        self._kept_keys: set[str] = set()  # group keys the local optimizer's step sets
        self._stepped = 0  # heartbeats of the current Join when step() last finished
        # Going on without a lost rank (Join(on_rank_lost="continue")).
        self._continues = False
        self._steps = 0  # broadcast rounds completed (training or shadowing)
        self._steps_at_entry = 0  # _steps when the current Join was entered
        self._members: tuple[int, ...] = ()  # global rank of each rank of the group (while continuing)
        self._replicas_valid = True  # False from a loss until every shard has a replica again
        self._handed_over = False  # the interrupted round's parameters came from a survivor past it
        super().__init__(params, defaults)
        install_exit_grace()  # the optimizer holds the process group's threads to interpreter exit
        for param_group in self.param_groups:
            self._assign(param_group["params"])
        self._defaults = defaults
        self._replica_offset = _host_offset(group) if shard_replicas else 1  # holder of r's replica: r + this
        self.optim: torch.optim.Optimizer = self._optimizer_of(self.rank)
        for global_group, local_group in zip(self.param_groups, self.optim.param_groups):
            _fill_defaults(global_group, local_group)
        self._replica: torch.optim.Optimizer | None = (  # alone, a rank's replica would be its own shard
            self._optimizer_of(self._predecessor()) if shard_replicas and self.world_size > 1 else None
        )
        self.initialized = True
        self._make_bucket_views()

    # Sharding.

    def _assign(self, params: list[torch.Tensor]) -> None:
        """Give each parameter to the rank with the fewest elements so far
        (largest first, so shards stay balanced); the same on every rank."""
        for param in sorted(params, key=lambda p: -p.numel()):
            if id(param) in self._owner:
                raise ValueError("ZeroRedundancyOptimizer: a parameter appears in more than one group")
            owner = min(range(self.world_size), key=lambda r: self._load[r])
            self._owner[id(param)] = owner
            self._load[owner] += param.numel()

    def _local_params(self, param_group: dict[str, Any], rank: int | None = None) -> list[torch.Tensor]:
        owner = self.rank if rank is None else rank
        return [p for p in param_group["params"] if self._owner[id(p)] == owner]

    def _optimizer_of(self, rank: int) -> torch.optim.Optimizer:
        """A new ``optimizer_class`` over the shard of ``rank``, with every group's settings."""
        return self.optimizer_class(
            [{**g, "params": self._local_params(g, rank)} for g in self.param_groups], **self._defaults
        )

    def _predecessor(self) -> int:
        """The rank whose shard this one replicates."""
        return (self.rank - self._replica_offset) % self.world_size

    def _owned_by(self, rank: int) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if self._owner[id(p)] == rank]

    def _make_bucket_views(self) -> None:
        self._buckets: list[tuple[int, torch.Tensor]] = []
        if not self.parameters_as_bucket_view:
            return
        for rank in range(self.world_size):
            for params in _by_dtype(self._owned_by(rank)).values():
                flat = torch.cat([p.detach().reshape(-1) for p in params])
                offset = 0
                for param in params:
                    param.data = flat[offset : offset + param.numel()].view_as(param)
                    offset += param.numel()
                self._buckets.append((rank, flat))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; its parameters are sharded like the others.

        Raises:
            RuntimeError: with ``overlap_with_ddp=True``, as torch's: the
                hook steps DDP's buckets, which hold none of the added parameters.
        """
        if self.initialized and self.overlap_with_ddp:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a single parameter group: "
                "add_param_group() would add parameters that hook_with_zero_step never steps; give every "
                "parameter group to the constructor, or build with overlap_with_ddp=False"
            )
        super().add_param_group(param_group)
        if not self.initialized:
            return
        added = self.param_groups[-1]
        self._assign(added["params"])
        self.optim.add_param_group({**added, "params": self._local_params(added)})
        _fill_defaults(added, self.optim.param_groups[-1])
        if self._replica is not None:
            self._replica.add_param_group({**added, "params": self._local_params(added, self._predecessor())})
        self._make_bucket_views()

    # Stepping.

    @overload
    def step(self, closure: None = None, **kwargs: Any) -> None: ...

    @overload
    def step(self, closure: Callable[[], float], **kwargs: Any) -> float: ...

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's shard, then broadcast every shard from its owner.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            kwargs: passed to the local optimizer's ``step()``, for optimizers
                whose step takes more arguments.
        """
        Join.notify_join_context(self)
        if self.overlap_with_ddp:
            # hook_with_zero_step stepped and broadcast every bucket during backward.
            if closure is not None or kwargs:
                given = ", ".join(["closure=..."] * (closure is not None) + [f"{k}=..." for k in kwargs])
                raise ValueError(
                    f"ZeroRedundancyOptimizer.step({given}): with overlap_with_ddp=True the step runs "
                    "during backward; call step() without arguments"
                )
            self._stepped = Join.heartbeats(self)
            return None
        loss = self._local_step(closure, **kwargs)
        self._broadcast_shards()
        self._stepped = Join.heartbeats(self)
        return loss

    def _local_step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        optimizers = [self.optim] if self._replica is None else [self.optim, self._replica]
        for optimizer in optimizers:
            for global_group, local_group in zip(self.param_groups, optimizer.param_groups):
                for key, value in global_group.items():
                    # e.g. a learning-rate scheduler's change; the replica keeps the values its
                    # optimizer keeps in its groups itself (those of its own shard)
                    if key != "params" and (optimizer is self.optim or key not in self._kept_keys):
                        local_group[key] = value
        if self._replica is not None and closure is not None:
            raise ValueError(
                "ZeroRedundancyOptimizer.step(closure=...): with shard_replicas=1 the replica is stepped "
                "with the same gradients, which a closure would change; call step() without one"
            )
        before = [dict(group) for group in self.optim.param_groups]
        loss = self.optim.step(closure, **kwargs) if closure is not None else self.optim.step(**kwargs)
        if self._replica is not None:
            self._replica.step(**kwargs)  # the same update its owner makes, on the same values
        for global_group, local_group, previous in zip(self.param_groups, self.optim.param_groups, before):
            for key, value in local_group.items():
                if key != "params":
                    if key not in previous or previous[key] is not value:
                        self._kept_keys.add(key)  # a value the optimizer keeps (Prodigy's d and k)
                    global_group[key] = value
        return loss

    def _step_bucket(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        """overlap_with_ddp: step this rank's parameters among ``params`` with
        the reduced ``grads``, then broadcast each parameter from its owner."""
        local = [p for g in self.optim.param_groups for p in g["params"]]
        saved = [p.grad for p in local]
        mine = [(p, g) for p, g in zip(params, grads) if self._owner[id(p)] == self.rank]
        if mine:
            for param in local:
                param.grad = None  # the optimizer skips them: only this bucket steps
            for param, grad in mine:
                param.grad = grad
            with torch.no_grad():
                self._local_step()
            for param, grad in zip(local, saved):
                param.grad = grad
        with torch.no_grad():
            for rank in range(self.world_size):
                owned: list[torch.Tensor] = [p for p in params if self._owner[id(p)] == rank]
                for same in _by_dtype(owned).values():
                    flat = torch.cat([p.detach().reshape(-1) for p in same])
                    dist.broadcast(flat, src=global_rank(self.process_group, rank), group=self.process_group)
                    if rank != self.rank:
                        offset = 0
                        for param in same:
                            param.copy_(flat[offset : offset + param.numel()].view_as(param))
                            offset += param.numel()

    def _broadcast_shards(self) -> None:
        """Broadcast every shard from its owner; in continue mode, go on
        without a lost owner (its replica's holder owns its shard from then).

        The replicas are made again after the first round on the survivors'
        group. A survivor handed this round's parameters by one that finished
        it waits for its next round, as the one ahead does (it is already in
        the next iteration): their collectives stay in step."""
        handed_over = False
        while True:
            try:
                self._broadcast_shards_once()
                break
            except Exception as failure:
                if not self._continues:
                    raise
                Join.recover(self, self._steps - self._steps_at_entry, 0, failure)
                if self._handed_over:
                    handed_over = True
                    break
        self._handed_over = False
        self._steps += 1
        if not self._replicas_valid and not handed_over:
            self._refresh_replicas()

    def _broadcast_shards_once(self) -> None:
        with torch.no_grad():
            if self.parameters_as_bucket_view:
                for rank, flat in self._buckets:
                    dist.broadcast(flat, src=global_rank(self.process_group, rank), group=self.process_group)
                return
            for rank in range(self.world_size):
                src = global_rank(self.process_group, rank)
                for params in _by_dtype(self._owned_by(rank)).values():
                    for run in _runs(params, COALESCE_BYTES):
                        if len(run) == 1 and run[0].is_contiguous():
                            dist.broadcast(run[0].detach(), src=src, group=self.process_group)
                            continue
                        flat = torch.cat([p.detach().reshape(-1) for p in run])
                        dist.broadcast(flat, src=src, group=self.process_group)
                        if rank != self.rank:
                            offset = 0
                            for param in run:
                                param.copy_(flat[offset : offset + param.numel()].view_as(param))
                                offset += param.numel()
                        del flat  # before the next run's buffer exists

    # Going on without a lost rank.

    def _regroup(self, recovery: Recovery, first_phase: int) -> None:
        """Move onto the survivors' group: a lost rank's shard goes to the
        holder of its replica (its state moves from the replica optimizer to
        the holder's own); survivors that finished the interrupted broadcast
        round hand the others its parameters. Every shard gets a replica again
        after the next round."""
        if not self._replicas_valid:
            lost = sorted(set(self._members) - set(recovery.members))
            raise RankLostError(
                dict(recovery.lost),
                detail=f"ZeroRedundancyOptimizer: rank(s) {lost} were lost before every shard had a replica "
                "again after the previous loss: their optimizer state is gone; restart from a checkpoint",
            )
        old_members, old_rank = self._members, self.rank
        index = {member: rank for rank, member in enumerate(recovery.members)}
        new_owner: dict[int, int] = {}
        for owner, member in enumerate(old_members):
            if member in index:
                new_owner[owner] = index[member]
                continue
            holder = old_members[(owner + self._replica_offset) % len(old_members)]
            if holder not in index:
                raise RankLostError(
                    dict(recovery.lost),
                    detail=f"ZeroRedundancyOptimizer: rank {member} and the holder of its shard's replica, "
                    f"rank {holder}, were both lost: that optimizer state is gone; restart from a checkpoint",
                )
            new_owner[owner] = index[holder]
        adopted = {  # parameters of a lost shard whose replica this rank holds
            id(p)
            for g in self.param_groups
            for p in g["params"]
            if self._owner[id(p)] != old_rank and new_owner[self._owner[id(p)]] == recovery.rank
        }
        previous, replica = self.optim, self._replica
        self._owner = {key: new_owner[owner] for key, owner in self._owner.items()}
        self._load = [0] * len(recovery.members)
        for group in self.param_groups:
            for param in group["params"]:
                self._load[self._owner[id(param)]] += param.numel()
        self.process_group = recovery.group
        self.rank = recovery.rank
        self.world_size = len(recovery.members)
        self._members = recovery.members
        self.optim = self._optimizer_of(self.rank)
        for param in _params_of(self.optim):
            source = replica if id(param) in adopted else previous
            assert source is not None
            if param in source.state:
                self.optim.state[param] = source.state[param]
        self._replica_offset = 1  # the survivors' ranks are not laid out host by host any more
        self._replica = self._optimizer_of(self._predecessor()) if self.world_size > 1 else None
        self._replicas_valid = self._replica is None
        self._make_bucket_views()
        self._hand_over(recovery, first_phase)

    def _hand_over(self, recovery: Recovery, first_phase: int) -> None:
        """Survivors past the interrupted broadcast round send every parameter
        to those that failed in it."""
        positions = recovery.positions
        rounds = [recovery.completed(position, first_phase) for position in positions]
        low, high = min(rounds), max(rounds)
        if high == low:
            return
        if high - low > 1 or any(
            done == low and position != recovery.position(low, first_phase)
            for position, done in zip(positions, rounds)
        ):
            raise RankLostError(
                dict(recovery.lost),
                detail=f"ZeroRedundancyOptimizer: the survivors cannot complete the interrupted step exactly "
                f"(broadcast rounds finished, by rank: {dict(zip(recovery.members, rounds))}); restart "
                "from a checkpoint",
            )
        src = global_rank(recovery.group, rounds.index(high))
        with torch.no_grad():
            for params in _by_dtype([p for g in self.param_groups for p in g["params"]]).values():
                for run in _runs(params, COALESCE_BYTES):
                    flat = torch.cat([p.detach().reshape(-1) for p in run])
                    dist.broadcast(flat, src=src, group=recovery.group)
                    offset = 0
                    for param in run:
                        param.copy_(flat[offset : offset + param.numel()].view_as(param))
                        offset += param.numel()
        self._handed_over = rounds[recovery.rank] == low

    def _refresh_replicas(self) -> None:
        """Give every shard a replica again: each rank sends its shard's state to
        the rank that replicates it and keeps the one of the rank before it: no
        rank holds the state of more than its own shard and one other."""
        index = self._global_index()
        owned = _params_of(self.optim)
        mine: bytes | TypeError
        try:
            mine = encode_state(
                {index[id(p)]: dict(self.optim.state[p]) for p in owned if p in self.optim.state}
            )
        except TypeError as exc:
            mine = exc  # announced to the others, who would wait for this rank's state
        limits = [state_limit(self._owned_by(rank)) for rank in range(self.world_size)]
        successor = (self.rank + self._replica_offset) % self.world_size  # it replicates this shard
        try:
            shard = pass_bytes(
                mine, successor, self._predecessor(), self.join_device, self.process_group, limits
            )
        except PeerFailedError as exc:
            raise TypeError(
                f"ZeroRedundancyOptimizer: cannot replicate the optimizer state of {exc}"
            ) from None
        assert self._replica is not None
        by_index = {i: p for p, i in ((p, index[id(p)]) for p in _params_of(self._replica))}
        for position, state in decode_state(shard).items():
            param = by_index.get(position)
            if param is None:
                raise RuntimeError(
                    f"ZeroRedundancyOptimizer: rank {self._predecessor()} sent optimizer state of parameter "
                    f"{position}, which it does not own"
                )
            self._replica.state[param] = {
                key: value.to(param.device) if isinstance(value, torch.Tensor) else value
                for key, value in state.items()
            }
        self._replicas_valid = True

    # State.

    def _global_index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every shard's optimizer state on rank ``to`` (a collective:
        call it on every rank); then ``state_dict()`` works there."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict(to={to}): must be a rank in [0, {self.world_size})")
        index = self._global_index()
        local = self.optim.state_dict()
        local_params = [p for g in self.optim.param_groups for p in g["params"]]
        mine: bytes | TypeError
        try:
            mine = encode_state({index[id(local_params[i])]: state for i, state in local["state"].items()})
        except TypeError as exc:
            mine = exc  # announced to the others, who would wait for this rank's state
        limits = [state_limit(self._owned_by(r)) for r in range(self.world_size)]
        try:
            gathered = gather_bytes(mine, to, self.join_device, self.process_group, limits)
        except ValueError as exc:
            raise ValueError(
                f"ZeroRedundancyOptimizer.consolidate_state_dict: optimizer state: {exc}"
            ) from None
        except PeerFailedError as exc:
            raise TypeError(
                f"ZeroRedundancyOptimizer.consolidate_state_dict: cannot send the optimizer state of {exc}"
            ) from None
        self._consolidated = None if gathered is None else [decode_state(shard) for shard in gathered]

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, as a plain ``optimizer_class`` state dict
        over all parameters. Needs ``consolidate_state_dict(to=this rank)``."""
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict: rank {self.rank} holds no consolidated state; "
                f"call consolidate_state_dict(to={self.rank}) on every rank first"
            )
        state: dict[int, Any] = {}
        for shard in self._consolidated:
            state.update(shard)
        index = self._global_index()
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for g in self.param_groups
        ]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or of ``optimizer_class``
        over the same parameters); each rank keeps its shard's part, and the
        replica its shard's (``shard_replicas=1``)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the state dict has {len(groups)} parameter groups, "
                f"this optimizer {len(self.param_groups)}"
            )
        for number, (group, saved) in enumerate(zip(self.param_groups, groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    "load_state_dict: loaded state dict contains a parameter group that doesn't match the size "
                    f"of optimizer's group: group {number} has {len(saved['params'])} parameters there, "
                    f"{len(group['params'])} here; load the state dict of an optimizer over the same groups"
                )
        saved_index = {
            id(param): index
            for group, saved in zip(self.param_groups, groups)
            for param, index in zip(group["params"], saved["params"])
        }
        for global_group, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params":
                    global_group[key] = value
        self._load_shard(self.optim, self.rank, state_dict["state"], saved_index)
        if self._replica is not None:
            self._load_shard(self._replica, self._predecessor(), state_dict["state"], saved_index)

    def _load_shard(
        self, optimizer: torch.optim.Optimizer, rank: int, state: dict[int, Any], saved_index: dict[int, int]
    ) -> None:
        """Load into ``optimizer``, over the shard of ``rank``, that shard's part of ``state``."""
        local_state: dict[int, Any] = {}
        local_groups = []
        position = 0
        for global_group in self.param_groups:
            ids = []
            for param in self._local_params(global_group, rank):
                saved_state = state.get(saved_index[id(param)])
                if saved_state is not None:
                    local_state[position] = saved_state
                ids.append(position)
                position += 1
            local_groups.append({**{k: v for k, v in global_group.items() if k != "params"}, "params": ids})
        optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})

    # Joinable.

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that keeps a joined rank stepping and broadcasting its shard."""
        self._stepped = 0
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the first parameter."""
        device: torch.device = next(p.device for g in self.param_groups for p in g["params"])
        return device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The process group the shards are broadcast over."""
        return self.process_group


class _ZeroJoinHook(JoinHook):
    """On a joined rank: step the shard with the gradients the joined model
    received, and broadcast every shard, as the ranks still training do."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def enter_hook(self) -> None:
        zero = self.zero
        zero._steps_at_entry = zero._steps  # a Join's rounds are counted from its entry
        zero._continues = Join.continues_on_loss(zero)
        if zero._continues and not zero.shard_replicas:
            raise ValueError(
                "Join(on_rank_lost='continue'): ZeroRedundancyOptimizer needs shard_replicas=1, so that a "
                "lost rank's optimizer state survives it"
            )
        zero._members = tuple(
            global_rank(zero.process_group, rank) for rank in range(dist.get_world_size(zero.process_group))
        )

    def exit_hook(self) -> None:
        self.zero._continues = False

    def regroup_hook(self, recovery: Recovery, first_phase: int) -> None:
        self.zero._regroup(recovery, first_phase)

    def main_hook(self) -> None:
        if self.zero.overlap_with_ddp:
            return  # the model's join hook stepped the shard through hook_with_zero_step
        self.zero._local_step()
        self.zero._broadcast_shards()

    def abort_hook(self) -> None:
        # The rank failed after this iteration's heartbeat (its gradients were
        # reduced) but before step() finished: the others broadcast shards.
        if not self.zero.overlap_with_ddp and Join.heartbeats(self.zero) > self.zero._stepped:
            self.zero._broadcast_shards()


def _host_offset(group: dist.ProcessGroup) -> int:
    """How many ranks on a rank one host over is: ``LOCAL_WORLD_SIZE`` when every rank
    reads the same value and it divides the world into more than one host, else 1."""
    world_size = dist.get_world_size(group)
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    seen = torch.tensor([local, -local], dtype=torch.int64)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    same = int(seen[0]) == -int(seen[1]) == local
    return local if same and 1 < local < world_size and world_size % local == 0 else 1


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _by_dtype(params: list[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in params:
        groups.setdefault((param.dtype, param.device), []).append(param)
    return groups


def _runs(params: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """``params`` in order, cut into runs of at most ``max_bytes`` (a larger
    parameter is a run of its own); the same on every rank."""
    runs: list[list[torch.Tensor]] = []
    size = max_bytes
    for param in params:
        nbytes = param.numel() * param.element_size()
        if size + nbytes > max_bytes:
            runs.append([])
            size = 0
        runs[-1].append(param)
        size += nbytes
    return runs


def _fill_defaults(global_group: dict[str, Any], local_group: dict[str, Any]) -> None:
    """Show the local optimizer's defaults (e.g. momentum) in the global group."""
    for key, value in local_group.items():
        if key != "params":
            global_group.setdefault(key, value)
