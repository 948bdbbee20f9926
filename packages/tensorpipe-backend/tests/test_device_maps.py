"""validate_device_maps, create_reverse_mapping and create_device_list, with torch's error texts."""

from __future__ import annotations

import re

import pytest
import torch

from tensorpipe_backend import create_device_list, create_reverse_mapping, validate_device_maps
from tensorpipe_backend.options import DeviceMap

pytestmark = pytest.mark.timeout(30)


def d(spec: str) -> torch.device:
    return torch.device(spec)


def check(
    maps: dict[str, dict[str, DeviceMap]],
    devices: dict[str, list[torch.device]] | None = None,
    counts: dict[str, int] | None = None,
    is_static_group: bool = True,
) -> None:
    names = list(maps)
    validate_device_maps(
        names,
        counts or dict.fromkeys(names, 2),
        maps,
        devices or {name: [] for name in names},
        is_static_group,
    )


def test_consistent_maps_pass() -> None:
    check({"a": {"b": {d("cuda:0"): d("cuda:1")}}, "b": {"a": {d("cuda:1"): d("cuda:0")}}})


def test_duplicated_devices() -> None:
    with pytest.raises(ValueError, match=r"Node a has duplicated devices\ndevices = "):
        check({"a": {}}, devices={"a": [d("cuda:0"), d("cuda:0")]})


def test_devices_with_invalid_indices() -> None:
    with pytest.raises(ValueError, match=r"Node a has devices with invalid indices\n.*\ndevice count = 2"):
        check({"a": {}}, devices={"a": [d("cuda:2")]})


def test_invalid_target_node_names_in_a_static_group_only() -> None:
    maps = {"a": {"ghost": {d("cuda:0"): d("cuda:0")}}}
    with pytest.raises(ValueError, match=r"Node a has invalid target node names in its device maps"):
        check(maps)
    check(maps, is_static_group=False)


def test_duplicated_target_devices() -> None:
    maps = {"a": {"b": {d("cuda:0"): d("cuda:1"), d("cuda:1"): d("cuda:1")}}, "b": {}}
    with pytest.raises(ValueError, match=r"Node a has duplicated target devices in its device map for b"):
        check(maps)


def test_unexpected_source_devices() -> None:
    maps = {"a": {"b": {d("cuda:1"): d("cuda:0")}}, "b": {}}
    with pytest.raises(ValueError, match=r"Node a has unexpected source devices in its device map for b"):
        check(maps, devices={"a": [d("cuda:0")], "b": []})


def test_source_devices_with_invalid_indices() -> None:
    maps = {"a": {"b": {d("cuda:5"): d("cuda:0")}}, "b": {}}
    with pytest.raises(
        ValueError, match=r"Node a has source devices with invalid indices in its device map for b"
    ):
        check(maps)


def test_unexpected_target_devices() -> None:
    maps = {"a": {"b": {d("cuda:0"): d("cuda:1")}}, "b": {}}
    with pytest.raises(ValueError, match=r"Node a has unexpected target devices in its device map for b"):
        check(maps, devices={"a": [], "b": [d("cuda:0")]})


def test_target_devices_with_invalid_indices() -> None:
    maps = {"a": {"b": {d("cuda:0"): d("cuda:1")}}, "b": {}}
    with pytest.raises(ValueError, match=re.escape("Node a has target devices with invalid indices")):
        check(maps, counts={"a": 2, "b": 1})


def test_cpu_devices_are_always_valid() -> None:
    check({"a": {"b": {d("cpu"): d("cpu")}}, "b": {}}, counts={"a": 0, "b": 0})


def test_reverse_mapping_inverts_each_peers_map_to_me() -> None:
    maps = {
        "a": {"b": {d("cuda:0"): d("cuda:1")}},
        "b": {"a": {d("cuda:1"): d("cuda:0")}, "c": {d("cuda:0"): d("cuda:0")}},
        "c": {"b": {d("cuda:1"): d("cuda:0")}},
    }
    assert create_reverse_mapping("b", list(maps), maps) == {
        "a": {d("cuda:1"): d("cuda:0")},
        "c": {d("cuda:0"): d("cuda:1")},
    }
    assert create_reverse_mapping("a", list(maps), maps) == {"b": {d("cuda:0"): d("cuda:1")}}


def test_device_list_collects_sources_of_maps_and_reverse_maps_sorted() -> None:
    mine = {"b": {d("cuda:3"): d("cuda:0"), d("cpu"): d("cpu")}}
    reverse = {"c": {d("cuda:1"): d("cuda:0")}}
    assert create_device_list([], mine, reverse) == [d("cuda:1"), d("cuda:3")]
    assert create_device_list([d("cuda:2"), d("cuda:0")], mine, reverse) == [d("cuda:0"), d("cuda:2")]
