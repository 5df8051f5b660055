"""``onnxps.wire.replies``: a Pull or Push reply's tensors read where the frame was
received (no copy when writable and aligned), with protobuf's reading of every
other field and ``tensors_to_arrays``'s checks and messages."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire import frames
from onnxps.wire.codec import (
    EncodedMessage,
    TensorFormatError,
    array_to_tensor,
    tensors_to_arrays,
)
from onnxps.wire.replies import (
    TensorReply,
    first_tensor_offset,
    parse_tensor_reply,
    tensor_arrays,
    tensor_views,
)


def _pull_reply(arrays: list[np.ndarray], **fields: object) -> bytes:
    msg = pb.PullResponse(update_count=7, learning_rate=0.5, **fields)  # type: ignore[arg-type]
    return EncodedMessage(
        msg, "tensors", arrays, [f"t{i}" for i in range(len(arrays))]
    ).raw


def _received(data: bytes, locate: bool = True) -> memoryview:
    """``data`` sent as an OK reply frame and read back as the client reads it."""
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=frames.send_reply, args=(a, 0, [data]))
        sender.start()
        where = (
            (lambda p: first_tensor_offset(pb.PullResponse, "tensors", p))
            if locate
            else None
        )
        code, body, _, _ = frames.read_reply(b, where)
        sender.join()
    assert code == 0
    return body


def test_a_large_reply_reads_back_as_protobuf_reads_it_without_a_copy() -> None:
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(200_000).astype(np.float32)]
    body = _received(_pull_reply(arrays))
    reply = parse_tensor_reply(pb.PullResponse, "tensors", body)
    assert isinstance(reply, TensorReply)
    assert (reply.update_count, reply.learning_rate) == (7, 0.5)
    assert [t.name for t in reply.tensors] == ["t0"]
    (got,) = tensor_arrays(reply, "tensors")
    np.testing.assert_array_equal(got, arrays[0])
    assert got.flags.writeable and got.flags.aligned
    # the array is the received frame's own memory (aligned by read_reply), not a copy
    assert got.ctypes.data % frames.ALIGN == 0
    assert np.shares_memory(got, np.frombuffer(body, np.uint8))
    got[0] = 1.0  # the caller's to write


def test_several_tensors_of_any_dtype_and_shape_match_protobufs_reading() -> None:
    rng = np.random.default_rng(4)
    for dtype in (np.float32, np.float64, np.int64):
        arrays = [
            (rng.standard_normal((30, 7)) * 100).astype(dtype),
            np.zeros((0, 3), dtype),
            (rng.standard_normal(5000) * 100).astype(dtype),
            np.array(2.5).astype(dtype),
        ]
        raw = _pull_reply(arrays)
        expected = tensors_to_arrays(pb.PullResponse.FromString(raw).tensors)
        for body in (_received(raw), memoryview(raw)):  # writable and read-only
            got = tensor_arrays(
                parse_tensor_reply(pb.PullResponse, "tensors", body), "tensors"
            )
            assert [a.shape for a in got] == [a.shape for a in expected]
            for g, e in zip(got, expected, strict=True):
                assert g.dtype == e.dtype and g.flags.writeable and g.flags.aligned
                np.testing.assert_array_equal(g, e)


def test_a_push_reply_with_values_and_other_fields() -> None:
    values = [np.arange(70_000, dtype=np.float32), np.arange(12, dtype=np.float32)]
    msg = pb.PushResponse(update_count=3, applied=True, duplicate=False)
    raw = EncodedMessage(msg, "values", values, ["a", "b"]).raw
    reply = parse_tensor_reply(pb.PushResponse, "values", memoryview(bytearray(raw)))
    assert (reply.update_count, reply.applied, reply.HasField("values_region")) == (
        3,
        True,
        False,
    )
    got = tensor_views(reply, "values")
    for g, v in zip(got, values, strict=True):
        np.testing.assert_array_equal(g, v)
    assert tensor_views(pb.PushResponse.FromString(raw), "values")[1].tolist() == list(
        range(12)
    )


def test_an_encoded_tensor_is_widened_as_protobufs_reading_widens_it() -> None:
    t = array_to_tensor(np.zeros(4, np.float32), "x")
    t.dtype = pb.DATA_TYPE_FLOAT
    t.encoding = pb.ENCODING_BFLOAT16
    t.raw_data = np.array([0x3F80, 0x4000, 0xC040, 0], np.uint16).tobytes()
    raw = pb.PullResponse(update_count=1, tensors=[t]).SerializeToString()
    (got,) = tensor_arrays(
        parse_tensor_reply(pb.PullResponse, "tensors", raw), "tensors", encoded=True
    )
    assert got.tolist() == [1.0, 2.0, -3.0, 0.0]
    with pytest.raises(TensorFormatError, match="encoding"):
        tensor_arrays(parse_tensor_reply(pb.PullResponse, "tensors", raw), "tensors")


def test_a_repeated_raw_data_reads_as_protobuf_reads_it_the_last_one() -> None:
    first = array_to_tensor(np.ones(3, np.float32), "x").SerializeToString()
    second = b"\x22\x0c" + np.full(3, 9, np.float32).tobytes()
    raw = b"\x12" + bytes([len(first) + len(second)]) + first + second
    (want,) = tensors_to_arrays(pb.PullResponse.FromString(raw).tensors)
    (got,) = tensor_arrays(
        parse_tensor_reply(pb.PullResponse, "tensors", raw), "tensors"
    )
    assert got.tolist() == want.tolist() == [9.0, 9.0, 9.0]


def test_a_tensor_whose_bytes_do_not_match_its_dims_is_refused_as_before() -> None:
    t = array_to_tensor(np.ones(3, np.float32), "x")
    t.raw_data = t.raw_data[:-1]
    raw = pb.PullResponse(tensors=[t]).SerializeToString()
    with pytest.raises(TensorFormatError) as old:
        tensors_to_arrays(pb.PullResponse.FromString(raw).tensors)
    with pytest.raises(TensorFormatError) as new:
        tensor_arrays(parse_tensor_reply(pb.PullResponse, "tensors", raw), "tensors")
    assert str(new.value) == str(old.value)
    assert "which is 12 bytes, but carries 11 bytes" in str(new.value)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12\x10\x22\x20",  # a tensor longer than the reply
        b"\x12\x04\x22\x10ab",  # raw_data longer than its tensor
        b"\x08",  # a varint cut off
        b"\x0b\x00",  # wire type 3 (a group)
        b"\x12\x02\x08",  # a tensor's field cut off
    ],
)
def test_bytes_that_are_not_a_reply_are_refused(raw: bytes) -> None:
    with pytest.raises(TensorFormatError, match="not a protobuf message"):
        parse_tensor_reply(pb.PullResponse, "tensors", raw)


def test_first_tensor_offset_finds_the_bytes_or_says_it_cannot() -> None:
    raw = _pull_reply([np.arange(10, dtype=np.float32)])
    at = first_tensor_offset(pb.PullResponse, "tensors", raw[:64])
    assert (
        at is not None
        and raw[at : at + 40] == np.arange(10, dtype=np.float32).tobytes()
    )
    assert first_tensor_offset(pb.PullResponse, "tensors", raw[:3]) is None
    assert first_tensor_offset(pb.PullResponse, "tensors", b"\x08\x01") is None


def test_a_channels_reply_buffer_is_used_again_only_once_nothing_reads_it() -> None:
    """``ReplyBuffers``: the arrays of a reply are views of its buffer; the next
    reply lands in the same buffer only after they are all gone (a training loop's
    ``x = pull()``), never under arrays still held."""
    buffers = frames.ReplyBuffers(keep=2)

    def pull(value: float) -> list[np.ndarray]:
        raw = _pull_reply([np.full(100_000, value, np.float32)])
        a, b = socket.socketpair()
        with a, b:
            sender = threading.Thread(target=frames.send_reply, args=(a, 0, [raw]))
            sender.start()
            where = lambda p: first_tensor_offset(pb.PullResponse, "tensors", p)  # noqa: E731
            _, body, _, _ = frames.read_reply(b, where, buffers)
            sender.join()
        return tensor_arrays(
            parse_tensor_reply(pb.PullResponse, "tensors", body), "tensors"
        )

    first = pull(1.0)
    second = pull(2.0)  # `first` is held: a second buffer
    assert not np.shares_memory(first[0], second[0])
    third = pull(3.0)  # both held: a third buffer, kept instead of the oldest
    assert first[0][0] == 1.0 and second[0][0] == 2.0 and third[0][0] == 3.0
    address = third[0].ctypes.data
    del third
    fourth = pull(4.0)  # the third's buffer is free again: used again
    assert fourth[0].ctypes.data == address and fourth[0][0] == 4.0
    assert np.all(second[0] == 2.0) and np.all(first[0] == 1.0)  # untouched


def test_reply_buffers_keep_two_of_up_to_8_mib_and_fit_the_size() -> None:
    """What transports.md says a call channel keeps: two buffers, none over 8 MiB,
    a kept one reused only for a reply of at least half its size."""
    buffers = frames.ReplyBuffers()
    assert (buffers.keep, buffers.max_bytes) == (2, 8 << 20)
    big = buffers.take((8 << 20) + 1)
    assert buffers.take((8 << 20) + 1) is not big  # not kept: a new one each time
    one = buffers.take(1 << 20)  # kept, and free: nothing was handed out of it
    assert buffers.take(1 << 20) is one
    assert buffers.take(1 << 19) is one  # half its size: still this one
    assert buffers.take((1 << 19) - 1) is not one  # smaller: a buffer of its own
