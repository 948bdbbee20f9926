"""How RPC messages are pickled: tensors travel beside the payload, RRefs as fork descriptions.

The first byte of a payload says how the rest was pickled: by the C pickler
alone when nothing in the object can be a tensor or an RRef (checked cheaply
by :func:`_is_plain`), else by :class:`_Pickler`, which takes tensors out as
persistent ids (the agent moves them) and turns RRefs into descriptions of
their forks; :class:`_Unpickler` puts them back.
"""

from __future__ import annotations

import io
import pickle
import threading
import types
from typing import Any, Final

import torch

from . import rref as _rref
from .protocols import Message, WorkerInfo
from .rref import RRef, RRefContext

# The engine's machinery, no public API (rpc_registry.api keeps pickling_for_rpc importable).
__all__: list[str] = []

# The first byte of every payload says how the rest was pickled.
_PLAIN: Final = 0  # by the C pickler alone: nothing in it is a tensor or an RRef
_WITH_REFS: Final = 1  # by _Pickler: tensors and RRefs are persistent ids


def _plain_payload(obj: object) -> bytes:
    return b"\x00" + pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


# Set while this thread pickles an RPC message (objects that refuse Python's pickler ask).
_pickling = threading.local()


def pickling_for_rpc() -> bool:
    """Whether this thread is pickling an RPC message now (not a file, not ``copy``)."""
    return bool(getattr(_pickling, "active", False))


class _Pickler(pickle.Pickler):
    """Takes tensors out of the payload and turns RRefs into fork descriptions."""

    def dump(self, obj: Any) -> None:
        outer, _pickling.active = pickling_for_rpc(), True
        try:
            super().dump(obj)
        finally:
            _pickling.active = outer

    def __init__(self, file: io.BytesIO, ctx: RRefContext, dest: WorkerInfo, reply: bool = False) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.ctx = ctx
        self.dest = dest
        self.reply = reply
        self.tensors: list[torch.Tensor] = []
        self.rrefs: list[RRef[Any]] = []
        self.forks: list[tuple[WorkerInfo, _rref.RRefId, _rref.ForkId]] = []

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is torch.nn.Parameter:
            # As torch's pickling of a Parameter: its data, detached, and whether it needs grad.
            self.tensors.append(obj.detach())
            return ("parameter", (len(self.tensors) - 1, obj.requires_grad))
        if isinstance(obj, torch.Tensor):
            if obj.layout == torch.sparse_coo:
                # Agents move dense tensors: a sparse one travels as its indices and values,
                # uncoalesced if it is (as torch's agent sends it: nnz and order are kept),
                # unless autograd must see it: values() is differentiable, _values() is not.
                if obj.requires_grad:
                    obj = obj.coalesce()
                    parts = [obj.indices(), obj.values()]
                else:
                    parts = [obj._indices(), obj._values()]
                first = len(self.tensors)
                self.tensors += parts
                return ("sparse_coo", (first, tuple(obj.shape), obj.is_coalesced()))
            if not obj.is_contiguous() and not obj.requires_grad and obj.layout == torch.strided:
                # A non-contiguous view keeps its strides, as torch's: its whole storage travels.
                storage = obj.untyped_storage()
                whole = torch.empty(0, dtype=obj.dtype, device=obj.device)
                whole.set_(storage, 0, (storage.nbytes() // obj.element_size(),), (1,))
                self.tensors.append(whole)
                return (
                    "strided",
                    (len(self.tensors) - 1, tuple(obj.shape), obj.stride(), obj.storage_offset()),
                )
            self.tensors.append(obj)
            return ("tensor", len(self.tensors) - 1)
        if isinstance(obj, RRef):
            self.rrefs.append(obj)
            return ("rref", self.ctx.to_wire(obj, self.dest, self.forks, self.reply))
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, message: Message, ctx: RRefContext) -> None:
        file = io.BytesIO(message.payload)
        file.seek(1)  # past the payload's kind
        super().__init__(file)
        self.message = message
        self.ctx = ctx

    def persistent_load(self, pid: Any) -> Any:
        kind, data = pid
        if kind == "tensor":
            return self.message.tensors[data]
        if kind == "parameter":
            index, requires_grad = data
            return torch.nn.Parameter(self.message.tensors[index], requires_grad=bool(requires_grad))
        if kind == "strided":
            index, shape, stride, offset = data
            # as_strided checks that the view stays inside the storage that arrived.
            return self.message.tensors[index].as_strided(shape, stride, offset)
        if kind == "sparse_coo":
            first, shape, coalesced = data
            indices, values = self.message.tensors[first : first + 2]
            # Checked: indices out of range (or a false claim of coalescing) would otherwise
            # corrupt memory later.
            return torch.sparse_coo_tensor(
                indices, values, shape, is_coalesced=bool(coalesced), check_invariants=True
            )
        if kind == "rref":
            return self.ctx.from_wire(data)
        raise pickle.UnpicklingError(f"unknown persistent id kind {kind!r}")


_PLAIN_LEAVES: Final = frozenset(
    {int, float, complex, bool, str, bytes, type(None), type, types.FunctionType, types.BuiltinFunctionType}
)
_PLAIN_BUDGET: Final = 64


def _is_plain(obj: object, budget: int) -> int:
    """What is left of ``budget`` after looking at ``obj``; negative when ``obj`` may hold a
    tensor or an RRef (or has more than ``budget`` parts, not worth the look)."""
    kind = type(obj)
    if kind in _PLAIN_LEAVES:
        return budget - 1
    if kind is tuple or kind is list:
        budget -= 1
        for item in obj:  # type: ignore[attr-defined]
            budget = budget - 1 if type(item) in _PLAIN_LEAVES else _is_plain(item, budget)
            if budget < 0:
                return budget
        return budget
    if kind is dict:
        budget -= 1
        for key, value in obj.items():  # type: ignore[attr-defined]
            budget = budget - 1 if type(key) in _PLAIN_LEAVES else _is_plain(key, budget)
            budget = budget - 1 if type(value) in _PLAIN_LEAVES else _is_plain(value, budget)
            if budget < 0:
                return budget
        return budget
    return -1
