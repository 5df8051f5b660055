"""Many tensors in one message, encoded by hand (``EncodedMessage``) and read into
one buffer (``tensors_to_arrays``): the same message protobuf builds, the same
arrays and the same refusals as one tensor at a time."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import (
    EncodedMessage,
    TensorFormatError,
    tensor_to_array,
    tensors_to_arrays,
    write_tensor,
)
from onnxps.wire.encoding import encode

Array = np.ndarray[Any, Any]


def arrays() -> list[Any]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal((3, 4)).astype(np.float32),
        np.float64(2.5) * np.ones((), np.float64),  # 0-d
        np.zeros((0, 5), np.float32),  # no element
        rng.standard_normal(1000).astype(np.float32),  # a length of 2 varint bytes
        np.arange(5, dtype=np.int64),
        encode(rng.standard_normal(7).astype(np.float32), "bfloat16", "x"),
        np.asfortranarray(rng.standard_normal((3, 5))),  # not C order
        np.arange(300, dtype=">f4"),  # big-endian: travels little-endian
        rng.standard_normal(70_000).astype(np.float32),  # a 3-byte length
    ]


NAMES = ["a", "", "üñí", "x" * 200, "i", "bf", "fortran", "be", "big"]


def test_encoded_message_parses_as_protobuf_builds_it() -> None:
    want = pb.PullResponse(update_count=7, learning_rate=0.5)
    for a, n in zip(arrays(), NAMES, strict=True):
        write_tensor(want.tensors.add(), a, n)
    got = EncodedMessage(
        pb.PullResponse(update_count=7, learning_rate=0.5), "tensors", arrays(), NAMES
    )
    assert pb.PullResponse.FromString(got.SerializeToString()) == want
    assert got.ByteSize() == len(got.SerializeToString())
    assert got.update_count == 7  # the other fields read through


def test_encoded_push_request_without_names() -> None:
    want = pb.PushRequest(group="g", client_id="c", seq=3, return_values=True)
    for a in arrays():
        write_tensor(want.gradients.add(), a)
    template = pb.PushRequest(group="g", client_id="c", seq=3, return_values=True)
    got = EncodedMessage(template, "gradients", arrays())
    assert pb.PushRequest.FromString(got.SerializeToString()) == want
    assert (got.group, got.seq) == ("g", 3)


def test_tensors_to_arrays_equals_one_at_a_time_and_owns_its_memory() -> None:
    values = [a for a in arrays() if np.asarray(a).dtype == np.float32]
    msg = pb.PullResponse()
    for i, a in enumerate(values):
        write_tensor(msg.tensors.add(), a, f"t{i}")
    msg = pb.PullResponse.FromString(msg.SerializeToString())
    got = tensors_to_arrays(msg.tensors)
    want = [tensor_to_array(t, t.name) for t in msg.tensors]
    assert [a.shape for a in got] == [a.shape for a in want]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w) and g.flags.writeable and g.flags.c_contiguous
    got[0][...] = 9.0  # views of one buffer, side by side: the others keep theirs
    assert np.array_equal(got[1], want[1]) and np.array_equal(got[-1], want[-1])


def test_tensors_to_arrays_refuses_bytes_that_do_not_match_a_header() -> None:
    msg = pb.PullResponse()
    for i in range(3):
        write_tensor(msg.tensors.add(), np.ones(4, np.float32), f"t{i}")
    msg.tensors[1].raw_data = b"\0" * 12
    with pytest.raises(TensorFormatError, match=r"t1 declares float32 dims \[4\]"):
        tensors_to_arrays(msg.tensors)
