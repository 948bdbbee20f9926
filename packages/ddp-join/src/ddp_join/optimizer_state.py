"""Optimizer state as bytes without pickle: what ``consolidate_state_dict``
sends between ranks.

A shard's state (parameter index -> state name -> value) becomes a JSON
header, describing each value, followed by the raw bytes of its tensors.
Values may be tensors (any shape, a dtype of :data:`DTYPES`), numbers, bools,
strings and None: what torch's optimizers keep. Reading it builds nothing
but those, so bytes from a peer can at worst be wrong, never run code.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
from typing import Any, Final

import torch

__all__ = ["DTYPES", "decode_state", "encode_state", "state_limit"]

#: The tensor dtypes optimizer state may hold, by name.
DTYPES: Final[dict[str, torch.dtype]] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip
_LENGTH: Final = struct.Struct("!Q")
_PLAIN: Final = (bool, int, float, str, type(None))

OptimizerState = dict[int, dict[str, Any]]


#: What :func:`state_limit` allows, generously: per parameter, this many tensors of its size at
#: the widest dtype (Adam keeps three and a step), and room for names and scalars; per shard, a header.
_TENSORS_PER_PARAM: Final = 8
_WIDEST: Final = 16  # bytes of a complex128
_PER_PARAM: Final = 4096
_PER_SHARD: Final = 1 << 20


def state_limit(params: list[torch.Tensor]) -> int:
    """The most bytes :func:`encode_state` can take for the state of an optimizer over ``params``:
    what a rank accepts from a peer before it allocates anything for it."""
    return _PER_SHARD + sum(_PER_PARAM + _TENSORS_PER_PARAM * _WIDEST * p.numel() for p in params)


def encode_state(state: OptimizerState) -> bytes:
    """``state`` as bytes for :func:`decode_state`.

    Raises:
        TypeError: a value is none of the types above (named, with its parameter).
    """
    header: list[list[Any]] = []
    blobs: list[bytes] = []
    for index, values in state.items():
        described: list[list[Any]] = []
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensor = value.detach().cpu().contiguous()
                dtype = str(tensor.dtype).removeprefix("torch.")
                if dtype not in DTYPES:
                    raise TypeError(
                        f"optimizer state {name!r} of parameter {index}: dtype {tensor.dtype} is not sent"
                    )
                described.append([name, "tensor", dtype, list(tensor.shape)])
                raw = tensor.view(-1).view(torch.uint8)  # alive while read
                blobs.append(ctypes.string_at(raw.data_ptr(), raw.numel()) if raw.numel() else b"")
            elif isinstance(value, _PLAIN):
                described.append([name, "value", value])
            else:
                raise TypeError(
                    f"optimizer state {name!r} of parameter {index} is a {type(value).__name__}: only tensors, "
                    "numbers, bools, strings and None are sent between ranks (no pickle)"
                )
        header.append([int(index), described])
    encoded = json.dumps(header).encode()
    return _LENGTH.pack(len(encoded)) + encoded + b"".join(blobs)


def decode_state(data: bytes) -> OptimizerState:
    """The state :func:`encode_state` wrote (tensors on the CPU).

    Raises:
        ValueError: ``data`` is not such bytes.
    """
    try:
        (length,) = _LENGTH.unpack_from(data)
        header = json.loads(data[_LENGTH.size : _LENGTH.size + length])
        offset = _LENGTH.size + length
        state: OptimizerState = {}
        for index, described in header:
            values: dict[str, Any] = {}
            for name, kind, *rest in described:
                if kind == "value":
                    (values[name],) = rest
                    continue
                dtype_name, shape = rest
                dtype = DTYPES[dtype_name]
                if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                    raise ValueError(
                        f"tensor {name!r} of parameter {index}: shape {str(shape)[:80]} is not sizes"
                    )
                size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                if offset + size > len(data):
                    raise ValueError(f"tensor {name!r} of parameter {index} runs past the data")
                if size:
                    flat = torch.frombuffer(bytearray(data[offset : offset + size]), dtype=torch.uint8)
                    values[name] = flat.view(dtype).reshape(shape)
                else:
                    values[name] = torch.empty(shape, dtype=dtype)
                offset += size
            state[int(index)] = values
    except (struct.error, TypeError, KeyError, ValueError, AttributeError) as error:  # JSON errors too
        raise ValueError(f"not optimizer state: {error}") from None
    except RecursionError:
        raise ValueError("not optimizer state: its header nests deeper than optimizer state does") from None
    if offset != len(data):
        raise ValueError(f"not optimizer state: {len(data) - offset} bytes left over")
    return state
