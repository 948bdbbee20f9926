"""Pooled memory for large tensors received from a socket: reuse, and its bound."""

from __future__ import annotations

import gc

import torch

from tensorpipe_backend.buffers import POOLED_MIN_BYTES, ReceiveBuffers

MIB = 1 << 20


def test_a_large_tensor_reuses_the_memory_of_one_that_died() -> None:
    pool = ReceiveBuffers()
    first = pool.empty((MIB // 4,), torch.float32)
    address = first.data_ptr()
    first.fill_(1.0)
    second = pool.empty((MIB // 4,), torch.float32)  # the first is alive: other memory
    assert second.data_ptr() != address
    del first
    gc.collect()
    third = pool.empty((2, MIB // 8), torch.float32)
    assert third.data_ptr() == address
    assert third.shape == (2, MIB // 8) and third.dtype == torch.float32
    assert pool.alive_bytes == 2 * MIB


def test_a_view_keeps_the_memory_from_being_reused() -> None:
    pool = ReceiveBuffers()
    tensor = pool.empty((MIB,), torch.uint8)
    view = tensor[10:20]
    address = tensor.data_ptr()
    del tensor
    gc.collect()
    assert pool.empty((MIB,), torch.uint8).data_ptr() != address
    del view


def test_small_tensors_and_tensors_past_the_bound_get_ordinary_memory() -> None:
    pool = ReceiveBuffers(max_bytes=4 * MIB)
    small = pool.empty((POOLED_MIN_BYTES // 8,), torch.float32)
    assert small.untyped_storage().resizable()
    held = pool.empty((MIB,), torch.float32)  # 4 MiB: the whole bound
    assert not held.untyped_storage().resizable()
    beyond = pool.empty((MIB,), torch.float32)
    assert beyond.untyped_storage().resizable()
    assert pool.alive_bytes == 4 * MIB


def test_free_memory_is_let_go_to_make_room_for_another_size() -> None:
    pool = ReceiveBuffers(max_bytes=4 * MIB)
    small = pool.empty((MIB,), torch.uint8)
    del small
    gc.collect()
    large = pool.empty((4 * MIB,), torch.uint8)  # 1 MiB free, too small: dropped for 4 MiB
    assert not large.untyped_storage().resizable()
    assert pool.alive_bytes == 4 * MIB
