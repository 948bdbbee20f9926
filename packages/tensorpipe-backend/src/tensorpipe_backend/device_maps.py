"""Checks of the group's device maps, reverse maps and the devices an agent handles.

The ``ValueError`` texts are torch's, so that code matching on them keeps
working. Every worker runs the same checks on the same gathered values, so
all of them fail together with the same message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from .options import DeviceMap
from .wire import device_index

__all__ = ["create_device_list", "create_reverse_mapping", "validate_device_maps"]

_CPU = torch.device("cpu")


def _valid_devices(devices: Iterable[torch.device], device_count: int) -> bool:
    return all(
        device.type == "cpu" or (device.type == "cuda" and 0 <= device_index(device) < device_count)
        for device in devices
    )


def validate_device_maps(
    all_names: Sequence[str],
    all_device_counts: Mapping[str, int],
    all_device_maps: Mapping[str, Mapping[str, DeviceMap]],
    all_devices: Mapping[str, Sequence[torch.device]],
    is_static_group: bool = True,
) -> None:
    """Raise ``ValueError`` when a worker's devices or device maps are inconsistent.

    ``all_names`` lists the workers; the mappings give, per worker, its CUDA
    device count, its device maps (callee name to {own device: callee
    device}) and its ``devices`` option. In a dynamic group
    (``is_static_group=False``) maps may name workers that have not joined.
    """
    for node in all_names:
        devices = list(all_devices[node])
        if len(set(devices)) != len(devices):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {devices}")
        if not _valid_devices(devices, all_device_counts[node]):
            raise ValueError(
                f"Node {node} has devices with invalid indices\n"
                f"devices = {devices}\n"
                f"device count = {all_device_counts[node]}"
            )

    for source_node in all_names:
        source_maps = all_device_maps[source_node]
        if is_static_group and not set(source_maps.keys()).issubset(all_names):
            raise ValueError(
                f"Node {source_node} has invalid target node names in its device maps\n"
                f"device maps = {source_maps.keys()}\n"
                f"node names = {list(all_names)}"
            )
        for target_node, map_ in source_maps.items():
            if len(set(map_.values())) != len(map_):
                raise ValueError(
                    f"Node {source_node} has duplicated target devices "
                    f"in its device map for {target_node}\n"
                    f"device map = {map_}"
                )
            source_devices = list(all_devices[source_node])
            if source_devices:
                if not set(map_.keys()).issubset(source_devices):
                    raise ValueError(
                        f"Node {source_node} has unexpected source devices "
                        f"in its device map for {target_node}\n"
                        f"device map = {map_}\n"
                        f"devices = {source_devices}"
                    )
            elif not _valid_devices(map_.keys(), all_device_counts[source_node]):
                raise ValueError(
                    f"Node {source_node} has source devices with invalid indices "
                    f"in its device map for {target_node}\n"
                    f"device map = {map_}\n"
                    f"device count = {all_device_counts[source_node]}"
                )
            target_devices = list(all_devices.get(target_node, []))
            if target_devices:
                if not set(map_.values()).issubset(target_devices):
                    raise ValueError(
                        f"Node {source_node} has unexpected target devices "
                        f"in its device map for {target_node}\n"
                        f"device map = {map_}\n"
                        f"devices = {target_devices}"
                    )
            elif target_node in all_device_counts and not _valid_devices(
                map_.values(), all_device_counts[target_node]
            ):
                raise ValueError(
                    f"Node {source_node} has target devices with invalid indices "
                    f"in its device map for {target_node}\n"
                    f"device map = {map_}\n"
                    f"device count = {all_device_counts[target_node]}"
                )


def create_reverse_mapping(
    my_name: str,
    all_names: Sequence[str],
    all_device_maps: Mapping[str, Mapping[str, DeviceMap]],
) -> dict[str, DeviceMap]:
    """For each worker whose maps name ``my_name``: {my device: its device}, used for replies.

    A reply to worker ``node`` must land where ``node``'s request came from,
    so it follows the inverse of ``node``'s map to this worker.
    """
    reverse: dict[str, DeviceMap] = {}
    for node in all_names:
        map_ = all_device_maps[node].get(my_name)
        if map_ is not None:
            reverse[node] = {target: source for source, target in map_.items()}
    return reverse


def create_device_list(
    my_devices: Sequence[torch.device],
    my_device_maps: Mapping[str, DeviceMap],
    reverse_device_maps: Mapping[str, DeviceMap],
) -> list[torch.device]:
    """The CUDA devices this agent handles, sorted by index.

    ``my_devices`` when given; otherwise every CUDA device that appears as a
    source in this worker's maps or its reverse maps.
    """
    devices: list[torch.device]
    if my_devices:
        devices = list(my_devices)
    else:
        found: set[torch.device] = set()
        for map_ in my_device_maps.values():
            found.update(map_.keys())
        for map_ in reverse_device_maps.values():
            found.update(map_.keys())
        found.discard(_CPU)
        devices = list(found)
    return sorted(devices, key=device_index)
