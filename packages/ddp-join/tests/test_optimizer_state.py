"""Optimizer state as bytes without pickle: what a rank sends in consolidate_state_dict."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch

from ddp_join.optimizer_state import decode_state, encode_state


def _state() -> dict[int, dict[str, object]]:
    torch.manual_seed(0)
    return {
        0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3), "exp_avg_sq": torch.rand(4, 3)},
        5: {"momentum_buffer": None, "count": 7, "lr_scale": 0.5, "kind": "sgd", "flag": True},
        9: {
            "half": torch.randn(2, 2).to(torch.bfloat16),
            "mask": torch.tensor([True, False]),
            "empty": torch.zeros(0, 3),
        },
        11: {"strided": torch.arange(12.0).reshape(3, 4).t()},
    }


def test_state_comes_back_exactly() -> None:
    state = _state()
    decoded = decode_state(encode_state(state))
    assert decoded.keys() == state.keys()
    for index, values in state.items():
        assert decoded[index].keys() == values.keys()
        for key, value in values.items():
            got = decoded[index][key]
            if isinstance(value, torch.Tensor):
                assert isinstance(got, torch.Tensor)
                assert got.dtype == value.dtype and got.shape == value.shape
                assert torch.equal(got, value), (index, key)
            else:
                assert got == value and type(got) is type(value), (index, key)


def test_a_value_of_another_type_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="optimizer state 'schedule' of parameter 2 is a dict"):
        encode_state({2: {"schedule": {"warmup": 10}}})


def test_a_pickle_is_not_optimizer_state() -> None:
    with pytest.raises(ValueError, match="not optimizer state"):
        decode_state(pickle.dumps({0: {"step": 1}}))


def test_a_tensor_larger_than_the_data_is_refused_before_it_is_allocated() -> None:
    header = json.dumps([[0, [["exp_avg", "tensor", "float32", [1 << 40]]]]]).encode()
    with pytest.raises(ValueError, match="runs past the data"):
        decode_state(struct.pack("!Q", len(header)) + header + b"\0" * 16)


@pytest.mark.parametrize(
    "header",
    [
        [[0, [["x", "tensor", "object", [1]]]]],  # no such dtype
        [[0, [["x", "tensor", "float32", [-4, -1]]]]],  # negative sizes
        [[0, [["x", "tensor", "float32", ["a"]]]]],  # not a shape
        {"0": []},  # not a list of parameters
    ],
)
def test_malformed_headers_are_refused(header: object) -> None:
    encoded = json.dumps(header).encode()
    with pytest.raises(ValueError, match=r"^not optimizer state: "):
        decode_state(struct.pack("!Q", len(encoded)) + encoded + b"\0" * 64)


def test_a_header_nested_deeply_is_refused_as_not_optimizer_state() -> None:
    header = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ValueError, match="nests deeper"):
        decode_state(struct.pack("!Q", len(header)) + header)
