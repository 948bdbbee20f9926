"""The frame format: round trips, bounds, and a decoder that rejects any garbage cleanly."""

from __future__ import annotations

import socket
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorpipe_backend.agent import prepare_tensor
from tensorpipe_backend.wire import (
    HEADER,
    MAX_PAYLOAD_BYTES,
    FrameError,
    FrameHeader,
    Kind,
    TensorDescriptor,
    decode_descriptors,
    decode_header,
    encode_descriptors,
    encode_header,
    recv_exact,
    tensor_bytes,
)

pytestmark = pytest.mark.timeout(60)


def test_header_round_trip() -> None:
    data = encode_header(Kind.REPLY, 42, 100, 2, 64)
    assert len(data) == HEADER.size
    assert decode_header(data) == FrameHeader(Kind.REPLY, 42, 100, 2, 64)


def test_header_beyond_the_payload_bound_is_rejected() -> None:
    with pytest.raises(FrameError, match="exceeds the limit"):
        encode_header(Kind.REQUEST, 1, MAX_PAYLOAD_BYTES + 1, 0, 0)
    raw = struct.pack("!4sB3xQIII", b"TPB1", 1, 1, 0xFFFFFFFF, 0, 0)
    with pytest.raises(FrameError, match="exceeds the limit"):
        decode_header(raw)


def test_control_frames_carry_no_tensors() -> None:
    raw = struct.pack("!4sB3xQIII", b"TPB1", int(Kind.PING), 1, 0, 1, 24)
    with pytest.raises(FrameError, match="PING frame carries no tensors"):
        decode_header(raw)


def test_descriptors_round_trip() -> None:
    descs = [
        TensorDescriptor(torch.float32, torch.device("cpu"), (2, 3), 24, True),
        TensorDescriptor(torch.int64, torch.device("cuda", 1), (), 8),
        TensorDescriptor(torch.bool, torch.device("cpu"), (0, 4), 0),
        TensorDescriptor(torch.float32, torch.device("cpu"), (1 << 21,), 1 << 23, lane=True),
    ]
    assert decode_descriptors(encode_descriptors(descs), 4) == descs


def test_a_tensor_both_in_shared_memory_and_on_the_lane_is_rejected() -> None:
    shared = TensorDescriptor(torch.float32, torch.device("cpu"), (4,), 16, shm_token=bytes(16))
    block = bytearray(encode_descriptors([shared]))
    block[5] |= 8  # the lane flag, next to the shared-memory one
    with pytest.raises(FrameError, match="shared memory and on the lane"):
        decode_descriptors(bytes(block), 1)


def test_descriptor_whose_bytes_do_not_match_its_shape_is_rejected() -> None:
    block = encode_descriptors([TensorDescriptor(torch.float32, torch.device("cpu"), (2,), 8)])
    broken = block[:8] + struct.pack("!Q", 9) + block[16:]
    with pytest.raises(FrameError, match="do not match shape"):
        decode_descriptors(broken, 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=HEADER.size, max_size=HEADER.size))
def test_decode_header_accepts_or_raises_frame_error(data: bytes) -> None:
    try:
        header = decode_header(data)
    except FrameError:
        return
    assert header.payload_len <= MAX_PAYLOAD_BYTES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=8))
def test_decode_descriptors_accepts_or_raises_frame_error(data: bytes, count: int) -> None:
    try:
        descs = decode_descriptors(data, count)
    except FrameError:
        return
    assert len(descs) == count


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=3), st.data())
def test_truncated_descriptor_blocks_are_rejected(count: int, data: st.DataObject) -> None:
    descs = [
        TensorDescriptor(torch.float64, torch.device("cpu"), (i + 1, 2), 16 * (i + 1)) for i in range(count)
    ]
    block = encode_descriptors(descs)
    if not block:
        return
    cut = data.draw(st.integers(min_value=0, max_value=len(block) - 1))
    with pytest.raises(FrameError):
        decode_descriptors(block[:cut], count)


def test_tensor_bytes_view_the_tensor_without_copying() -> None:
    tensor = torch.arange(4, dtype=torch.int32)
    view = tensor_bytes(tensor)
    assert bytes(view) == struct.pack("=4i", 0, 1, 2, 3)
    tensor[0] = 7
    assert bytes(view[:4]) == struct.pack("=i", 7)


def test_prepare_tensor_makes_views_contiguous_and_keeps_cpu_on_cpu() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    desc, data = prepare_tensor(base.t(), {}, "w1")
    assert desc.device == torch.device("cpu") and desc.shape == (4, 3) and data.is_contiguous()
    assert torch.equal(data, base.t())


def test_prepare_tensor_rejects_sparse_tensors() -> None:
    with pytest.raises(TypeError, match="layout"):
        prepare_tensor(torch.eye(2).to_sparse(), {}, "w1")


def test_recv_exact_reports_a_peer_that_closes_early() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"abc")
        left.close()
        with pytest.raises(EOFError, match="after 3 of 10 bytes"):
            recv_exact(right, 10)
