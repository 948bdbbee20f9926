"""A joined rank with no batch rebuilds a peer's input from a JSON description, never a pickle."""

from __future__ import annotations

import json

import pytest
import torch

from ddp_join.fsdp import _describe, _rebuild


def test_an_input_of_empty_tensors_and_plain_values_survives_its_description() -> None:
    value = (
        (torch.empty(0, 3, dtype=torch.float64), [torch.tensor(2.5)]),
        {"mask": None, "k": 3, "s": "x"},
        True,
    )
    rebuilt = _rebuild(json.loads(json.dumps(_describe(value))), torch.device("cpu"))
    (tensor, (scalar,)), kwargs, flag = rebuilt
    assert tensor.shape == (0, 3) and tensor.dtype == torch.float64
    assert float(scalar) == 2.5 and kwargs == {"mask": None, "k": 3, "s": "x"} and flag is True


def test_an_object_that_json_cannot_describe_is_named_on_the_rank_that_needs_it() -> None:
    described = json.loads(json.dumps(_describe((object(),))))
    with pytest.raises(TypeError, match="holds a object; give every rank at least one batch"):
        _rebuild(described, torch.device("cpu"))


@pytest.mark.parametrize("bad", [{"tensor": "Tensor", "shape": [0]}, {"tensor": "float32", "shape": [5]}, {}])
def test_a_malformed_description_is_refused(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        _rebuild(bad, torch.device("cpu"))
