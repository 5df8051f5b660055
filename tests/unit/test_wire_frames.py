"""``onnxps.wire.frames``: the frame format both ends speak, written once (its
status numbers are gRPC's; a reply written by one end reads back at the other)."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
from onnxps.client import _frames as client_frames
from onnxps.server.transports import _frames as server_frames
from onnxps.wire import frames


def test_the_status_numbers_are_grpcs() -> None:
    assert frames.STATUS_NAMES == {c.value[0]: c.name for c in grpc.StatusCode}


def test_both_ends_take_the_format_from_the_wire_layer() -> None:
    assert client_frames.CALL_MAGIC is frames.CALL_MAGIC is server_frames.CALL_MAGIC
    assert client_frames.FRAME_METHODS == {"Push": 1, "Pull": 2}
    assert server_frames.METHODS == {1: "Push", 2: "Pull"}


def test_a_status_reply_reads_back_whole() -> None:
    a, b = socket.socketpair()
    with a, b:
        trailing = [("grpc-status-details-bin", b"\x00\xff"), ("reason", "BAD")]
        payload = frames.status_payload("no such group: g", trailing)
        frames.send_reply(a, 5, [payload])
        code, body, details, got = frames.read_reply(b)
    assert (code, bytes(body), details) == (5, b"", "no such group: g")
    assert got == [("grpc-status-details-bin", b"\x00\xff"), ("reason", b"BAD")]


def test_an_ok_reply_and_a_call_frame_read_back() -> None:
    a, b = socket.socketpair()
    with a, b:
        frames.send_reply(a, 0, [b"abc", memoryview(b"de")])
        code, reply, details, got = frames.read_reply(b)
        assert (code, bytes(reply), details, got) == (0, b"abcde", "", [])
        frames.write_call(a, 2, 1.5, b"request")
        (length,) = frames.U32.unpack(frames.recv_exact(b, 4) or b"")
        body = frames.recv_exact(b, length) or b""
        assert frames.split_call(body) == (2, 1.5, b"request")


def test_a_large_call_frame_is_sent_unjoined_and_reads_back_whole() -> None:
    # a request over JOIN_BYTES goes after the frame's head, from where it is
    request = bytes(range(256)) * ((frames.JOIN_BYTES >> 8) + 3)
    a, b = socket.socketpair()
    with a, b:
        sent = threading.Thread(target=frames.write_call, args=(a, 1, 0.0, request))
        sent.start()
        (length,) = frames.U32.unpack(frames.recv_exact(b, 4) or b"")
        body = frames.recv_exact(b, length) or b""
        sent.join()
    assert length == frames.HEAD.size + len(request)
    assert frames.split_call(body) == (1, 0.0, request)


def test_a_closed_peer_is_none_or_a_connection_error() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(b"\x01")
        frames.close_socket(a)
        frames.close_socket(a)  # again: nothing to do, nothing raised
        assert frames.recv_exact(b, 2) is None
    c, d = socket.socketpair()
    with c, d:
        c.sendall(frames.U32.pack(1) + bytes([99]))
        with pytest.raises(ValueError, match="status 99"):
            frames.read_reply(d)
        c.close()
        with pytest.raises(ConnectionError, match="closed the call channel"):
            frames.read_reply(d)


def test_a_large_call_is_sent_from_its_pieces_and_reads_back_whole() -> None:
    """``write_call`` with a request in pieces (a flat push's header and its one
    buffer): sent with ``sendmsg`` from where they are, through partial sends
    (the reader is slower than the socket's buffer), byte for byte."""
    import numpy as np

    data = np.arange(3 << 18, dtype=np.float32)  # 3 MiB: many partial sends
    pieces = [b"head", memoryview(data).cast("B"), b"tail"]  # type: ignore[arg-type]
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=frames.write_call, args=(a, 1, 2.5, pieces))
        sender.start()
        (size,) = frames.U32.unpack(frames.recv_exact(b, 4) or b"")
        body = frames.recv_exact(b, size)
        sender.join()
    assert body is not None
    method, timeout, request = frames.split_call(body)
    assert (method, timeout) == (1, 2.5)
    assert bytes(request) == b"head" + data.tobytes() + b"tail"


def test_a_flat_push_is_framed_from_its_buffer_not_a_joined_copy() -> None:
    import numpy as np
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.wire.codec import EncodedMessage

    flat = np.ones(200_000, np.float32)
    msg = EncodedMessage(
        pb.PushRequest(group="g", layout=b"d"), "gradients", [flat], defer=True
    )
    pieces = client_frames.request_bytes(msg)
    assert pieces is not None
    assert any(
        np.shares_memory(np.frombuffer(p, np.uint8), flat)
        for p in pieces
        if len(p) > 100
    )
    assert b"".join(bytes(p) for p in pieces) == msg.SerializeToString()
