"""The hand-written chunk codec agrees with protobuf on every input."""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from onnxps.client._wire import (
    RawChunk,
    decode_chunk,
    deserializer,
    encode_chunk,
    iter_raw_chunks,
    serializer,
)
from onnxps.v1 import parameter_server_pb2 as pb

MESSAGES = [
    (pb.PushStreamRequest, 2),
    (pb.PullStreamResponse, 2),
    (pb.CreateGroupStreamRequest, 2),
    (pb.ApplyStreamRequest, 3),
    (pb.ApplyStreamResponse, 3),
]


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(MESSAGES),
    index=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**64 - 1),
    data=st.binary(min_size=1, max_size=300),
)
def test_encoding_is_protobufs_and_decodes_back(
    kind: tuple[type, int], index: int, offset: int, data: bytes
) -> None:
    cls, field = kind
    msg = cls()
    msg.chunk.index, msg.chunk.offset, msg.chunk.data = index, offset, data
    wire = encode_chunk(field, index, offset, memoryview(data))
    assert wire == msg.SerializeToString()
    chunk = decode_chunk(wire, field)
    assert chunk is not None
    assert (chunk.index, chunk.offset, bytes(chunk.data)) == (index, offset, data)


@settings(max_examples=500, deadline=None)
@given(kind=st.sampled_from(MESSAGES), raw=st.binary(max_size=64))
def test_any_bytes_decode_as_protobuf_would_or_fall_back(
    kind: tuple[type, int], raw: bytes
) -> None:
    cls, field = kind
    chunk = decode_chunk(raw, field)
    if chunk is None:
        return  # the caller parses with protobuf and gets its verdict
    msg = cls.FromString(raw)  # what the fast path accepts, protobuf accepts too
    assert msg.WhichOneof("part") == "chunk"
    assert (msg.chunk.index, msg.chunk.offset, msg.chunk.data) == (
        chunk.index,
        chunk.offset,
        bytes(chunk.data),
    )


def test_headers_and_garbage_go_through_protobuf() -> None:
    parse = deserializer(pb.PushStreamRequest, 2)
    header = pb.PushStreamRequest(header=pb.PushRequest(group="g", seq=7))
    got = parse(header.SerializeToString())
    assert isinstance(got, pb.PushStreamRequest) and got.header.seq == 7
    truncated = encode_chunk(2, 1, 8, memoryview(b"abcdef"))[:-2]
    assert decode_chunk(truncated, 2) is None
    try:
        parse(truncated)
    except DecodeError:
        pass
    else:  # pragma: no cover - protobuf must refuse a truncated length
        raise AssertionError("a truncated chunk parsed")


def test_raw_chunks_view_the_array_and_serialize_by_hand() -> None:
    a = np.arange(10, dtype=np.float32)
    chunks = list(iter_raw_chunks([a], 16))
    assert [(c.index, c.offset, len(c.data)) for c in chunks] == [
        (0, 0, 16),
        (0, 16, 16),
        (0, 32, 8),
    ]
    assert all(isinstance(c, RawChunk) and c.chunk is c for c in chunks)
    write = serializer(2)
    wire = b"".join(write(c) for c in chunks)
    assert pb.PushStreamRequest.FromString(write(chunks[1])).chunk.offset == 16
    assert len(wire) > a.nbytes
    header = pb.PushStreamRequest(header=pb.PushRequest(group="g"))
    assert write(header) == header.SerializeToString()
