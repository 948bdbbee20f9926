"""CUDA tensors through device maps; skipped without a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from tpb_workers import CONTEXT, cuda_scenario_caller, free_port, serve, spawned

from tensorpipe_backend.agent import prepare_tensor

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_cuda_tensor_without_a_device_map_gives_torchs_error() -> None:
    with pytest.raises(RuntimeError, match=r"call `set_device_map` .* not available for destination w1"):
        prepare_tensor(torch.ones(1, device="cuda:0"), {}, "w1")


def test_cuda_tensor_lands_on_the_mapped_device_and_the_reply_comes_back() -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = CONTEXT.Queue()
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (cuda_scenario_caller, (init_method, results)),
        (serve, ("c1", 1, 2, init_method)),
    ]
    with spawned(targets) as workers:
        arrived, back_device, back, no_map = results.get(timeout=50)
    assert arrived == "cuda:0" and back_device == "cuda:0" and back == [-1.0, -1.0, -1.0]
    assert "set_device_map" in no_map and "destination c0" in no_map
    assert [w.exitcode for w in workers] == [0, 0]
