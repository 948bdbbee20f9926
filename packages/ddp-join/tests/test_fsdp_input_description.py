"""A joined rank with no batch rebuilds a peer's input from a JSON description, never a pickle."""

from __future__ import annotations

import json

import pytest
import torch

from ddp_join.fsdp import _describe, _parse_description, _rebuild


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


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"tensor": 5, "shape": []}, r"input\.tensor"),
        ({"tensor": "float32", "shape": "0"}, r"input\.shape"),
        ({"tensor": "float32", "shape": [0, -1]}, r"input\.shape"),
        ({"tensor": "float32", "shape": [True]}, r"input\.shape"),
        ({"tensor": "float32", "shape": [], "value": list(range(100_000))}, r"input\.value"),
        ({"tensor": "float32", "shape": [], "value": "x"}, r"input\.value"),
        ({"tensor": "int8", "shape": [], "value": 10**30}, r"input\.value"),
        ({"tuple": 3}, r"input\.tuple"),
        ({"list": {"a": 1}}, r"input\.list"),
        ({"dict": [1]}, r"input\.dict"),
        ({"tuple": [{"value": [1, 2]}]}, r"input\[0\]\.value"),
        ({"dict": {"k": {"nothing": 1}}}, r"input\['k'\]"),
        ({"shape": [0]}, "input"),
    ],
)
def test_a_description_with_a_wrong_field_is_refused_naming_it(bad: object, field: str) -> None:
    with pytest.raises(ValueError, match=f"input description: {field}"):
        _rebuild(bad, torch.device("cpu"))


def test_a_description_nested_deeply_is_refused_without_recursing() -> None:
    deep = b'{"tuple": [' * 100_000 + b"]}" * 100_000
    with pytest.raises(ValueError, match="nested more than"):
        _rebuild(_parse_description(deep), torch.device("cpu"))
    shallow_enough_for_json = json.loads('{"tuple": [' * 200 + '{"value": 1}' + "]}" * 200)
    with pytest.raises(ValueError, match="nested more than 32 levels"):
        _rebuild(shallow_enough_for_json, torch.device("cpu"))
