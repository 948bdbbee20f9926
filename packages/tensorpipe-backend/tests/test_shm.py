"""Shared-memory files between workers of one host: pooling, release, clean-up."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tensorpipe_backend.shm import SharedFiles, host_identity
from tensorpipe_backend.wire import FrameError, tensor_bytes

pytestmark = pytest.mark.skipif(not host_identity(), reason="no usable /dev/shm")

MIB = 1 << 20


def _files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("tpb-")}


def _send(
    sender: SharedFiles, receiver: SharedFiles, tensor: torch.Tensor
) -> tuple[bytes, bool, torch.Tensor]:
    token, pooled = sender.write(tensor_bytes(tensor))
    received = receiver.receive(token, pooled, tensor.dtype, tuple(tensor.shape), tensor.numel() * 4)
    return token, pooled, received


def test_a_pooled_file_is_reused_only_once_the_received_tensor_is_gone() -> None:
    sender, receiver = SharedFiles(), SharedFiles()
    try:
        first = torch.randn(MIB)
        token, pooled, received = _send(sender, receiver, first)
        assert pooled and torch.equal(received, first)
        view = received[10:20]
        del received
        second = torch.randn(MIB)
        other, _, received_second = _send(sender, receiver, second)
        assert other != token, "a file still viewed by a tensor was written again"
        assert torch.equal(view, first[10:20]) and torch.equal(received_second, second)
        del view
        gc.collect()
        third = torch.randn(MIB)
        again, _, received_third = _send(sender, receiver, third)
        assert again == token
        assert torch.equal(received_third, third) and torch.equal(received_second, second)
    finally:
        sender.close()
        receiver.close()


def test_a_full_pool_falls_back_to_a_file_per_tensor() -> None:
    sender, receiver = SharedFiles(), SharedFiles()
    try:
        held = [_send(sender, receiver, torch.full((MIB // 4,), float(i)))[2] for i in range(8)]
        tensor = torch.randn(MIB // 4)
        _, pooled, received = _send(sender, receiver, tensor)
        assert not pooled and torch.equal(received, tensor)
        assert [float(t[0]) for t in held] == [float(i) for i in range(8)]
    finally:
        sender.close()
        receiver.close()


def test_received_tensors_outlive_the_connection_and_no_file_is_left() -> None:
    before = _files()
    sender, receiver = SharedFiles(), SharedFiles()
    tensor = torch.randn(2 * MIB)
    _, _, received = _send(sender, receiver, tensor)
    sender.write(tensor_bytes(torch.randn(MIB)))  # never taken by the peer
    sender.close()
    receiver.close()
    assert torch.equal(received, tensor)
    assert _files() == before


def test_a_size_beyond_the_pooled_file_is_refused() -> None:
    sender, receiver = SharedFiles(), SharedFiles()
    try:
        token, _ = sender.write(tensor_bytes(torch.randn(MIB)))  # the pool's file, announced too large
        with pytest.raises(FrameError, match="pooled file"):
            receiver.receive(token, True, torch.float32, (2 * MIB,), 8 * MIB)
    finally:
        sender.close()
        receiver.close()
