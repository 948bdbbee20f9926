"""TensorPipeRpcBackendOptions: defaults, torch's device rules and the errors that name the fix."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from rpc_registry import DEFAULT_RPC_TIMEOUT_SEC, RpcBackendOptions, construct_rpc_backend_options
from tensorpipe_backend import (
    DEFAULT_LIVENESS_TIMEOUT,
    TensorPipeRpcBackendOptions,
    construct_rpc_backend_options_handler,
    ensure_registered,
)

pytestmark = pytest.mark.timeout(30)

cuda = torch.device


def test_defaults_match_torch() -> None:
    options = TensorPipeRpcBackendOptions()
    assert options.num_worker_threads == 16
    assert options.rpc_timeout == DEFAULT_RPC_TIMEOUT_SEC == 60.0
    assert options.init_method == "env://"
    assert options.device_maps == {} and options.devices == [] and options.auth_token is None
    assert options.liveness_timeout == DEFAULT_LIVENESS_TIMEOUT == 30.0  # ours: torch has no such option
    assert isinstance(options, RpcBackendOptions)


def test_ints_mean_cuda_devices_in_maps_and_device_lists() -> None:
    options = TensorPipeRpcBackendOptions(device_maps={"w1": {0: "cuda:1"}}, devices=[1, "cuda:0"])
    assert options.device_maps == {"w1": {cuda("cuda:0"): cuda("cuda:1")}}
    assert options.devices == [cuda("cuda:1"), cuda("cuda:0")]


def test_set_device_map_adds_to_the_map_of_a_callee() -> None:
    options = TensorPipeRpcBackendOptions(device_maps={"w1": {0: 1}})
    options.set_device_map("w1", {1: 2})
    options.set_device_map("w2", {"cpu": "cpu"})
    assert options.device_maps == {
        "w1": {cuda("cuda:0"): cuda("cuda:1"), cuda("cuda:1"): cuda("cuda:2")},
        "w2": {cuda("cpu"): cuda("cpu")},
    }


def test_device_map_must_be_one_to_one() -> None:
    with pytest.raises(
        ValueError, match=r"only supports 1-to-1 mapping, trying to map cuda:1 and cuda:0 to cuda:2"
    ):
        TensorPipeRpcBackendOptions(device_maps={"w1": {0: 2, 1: 2}})


def test_set_device_map_rejects_a_second_target_for_a_source() -> None:
    options = TensorPipeRpcBackendOptions(device_maps={"w1": {0: 1}})
    with pytest.raises(
        ValueError, match=r"`set_device_map` only supports 1-to-1 mapping, trying to map cuda:0"
    ):
        options.set_device_map("w1", {0: 2})


def test_set_device_map_rejects_two_sources_for_one_target_across_calls() -> None:
    options = TensorPipeRpcBackendOptions(device_maps={"w1": {0: 1}})
    with pytest.raises(ValueError, match=r"1-to-1 mapping"):
        options.set_device_map("w1", {2: 1})
    assert options.device_maps == {"w1": {cuda("cuda:0"): cuda("cuda:1")}}


def test_devices_must_be_cuda_devices() -> None:
    with pytest.raises(ValueError, match=r"expect a list of CUDA devices, but got device type cpu"):
        TensorPipeRpcBackendOptions(devices=["cpu"])
    options = TensorPipeRpcBackendOptions()
    with pytest.raises(ValueError, match=r"device type cpu"):
        options.set_devices(["cpu"])


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"num_worker_threads": 0}, ValueError, r"num_worker_threads=0: must be >= 1"),
        ({"num_worker_threads": 2.5}, TypeError, r"num_worker_threads=2.5"),
        ({"rpc_timeout": -1.0}, ValueError, r"rpc_timeout=-1.0: must be seconds >= 0"),
        ({"rpc_timeout": "60"}, TypeError, r"incompatible constructor arguments: rpc_timeout='60'"),
        ({"rpc_timeout": timedelta(seconds=1)}, TypeError, r"rpc_timeout=datetime.timedelta.*total_seconds"),
        ({"init_method": 5}, TypeError, r"init_method=5"),
        ({"_transports": ["uv"]}, ValueError, r"_transports=\['uv'\]: .* leave it None"),
        ({"_channels": ["cuda_ipc"]}, ValueError, r"_channels=\['cuda_ipc'\]"),
        ({"auth_token": ""}, ValueError, r"auth_token='': must not be empty"),
        ({"auth_token": 5}, TypeError, r"auth_token=5"),
        ({"devices": [True]}, TypeError, r"device=True"),
        ({"devices": ["gpu7"]}, ValueError, r"device='gpu7': not a device"),
        ({"device_maps": {"w1": {-1: 0}}}, ValueError, r"device=-1: a CUDA device index must be >= 0"),
        ({"liveness_timeout": -1.0}, ValueError, r"liveness_timeout=-1.0: must be seconds >= 0, e.g. 30"),
        ({"liveness_timeout": float("inf")}, ValueError, r"liveness_timeout=inf: must be seconds >= 0"),
        ({"liveness_timeout": True}, ValueError, r"liveness_timeout=True: must be seconds >= 0"),
        ({"liveness_timeout": 1e12}, ValueError, r"liveness_timeout=1000000000000.0: .* at most a year"),
        (
            {"liveness_timeout": 1e-6},
            ValueError,
            r"liveness_timeout=1e-06: .* at least 0.1 and at most a year",
        ),
        ({"rpc_timeout": 1e12}, ValueError, r"rpc_timeout=1000000000000.0: .* at most a year"),
        ({"rpc_timeout": float("nan")}, ValueError, r"rpc_timeout=nan: must be seconds >= 0"),
        ({"rendezvous_timeout": 1e12}, ValueError, r"rendezvous_timeout=1000000000000.0: .* at most a year"),
    ],
)
def test_bad_option_names_argument_value_and_fix(
    kwargs: dict[str, object], error: type[Exception], text: str
) -> None:
    with pytest.raises(error, match=text):
        TensorPipeRpcBackendOptions(**kwargs)  # type: ignore[arg-type]


def test_options_handler_passes_every_keyword() -> None:
    options = construct_rpc_backend_options_handler(
        5.0, "tcp://h:1", num_worker_threads=3, auth_token="s", liveness_timeout=0
    )
    assert (options.rpc_timeout, options.init_method, options.num_worker_threads) == (5.0, "tcp://h:1", 3)
    assert options.auth_token == "s" and options.liveness_timeout == 0.0


def test_registry_builds_these_options_for_tensorpipe() -> None:
    options = construct_rpc_backend_options(ensure_registered(), rpc_timeout=7, device_maps={"w1": {0: 1}})
    assert isinstance(options, TensorPipeRpcBackendOptions)
    assert options.rpc_timeout == 7.0 and options.device_maps == {"w1": {cuda("cuda:0"): cuda("cuda:1")}}


def test_repr_hides_the_secret() -> None:
    assert "hunter2" not in repr(TensorPipeRpcBackendOptions(auth_token="hunter2"))
