"""Which dtypes row indices and ids may have (issue 27, item 10).

The client takes any integer dtype whose values fit in int64 and converts it
exactly (int32 indices from PyTorch, uint64 hashes below 2**63); a uint64 value
above 2**63-1 (which ``astype(int64)`` would wrap onto a negative id), a float, a
bool or any other dtype is refused with ``InvalidArgumentError`` (a ValueError),
reason ``ROW_INDICES``, before anything is sent. On the wire indices are
``DATA_TYPE_INT64`` of dims [k]; anything else is INVALID_ARGUMENT with reason
``ROW_INDICES`` and the field at fault. Real server processes throughout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _cluster import shards
from _procs import start_server, stop
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from onnxps.client import Adam, AsyncClient, Client, IdsTable, InvalidArgumentError
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

F32 = np.float32
DIM = 4
ROWS = 300
INTEGERS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
TOO_BIG = [2**64 - 1, 2**63]  # uint64 values no int64 holds
NOT_INTEGERS: list[Callable[[], Any]] = [
    lambda: np.array([1.0, 2.0]),
    lambda: np.array([1, 2], np.float32),
    lambda: np.array([True, False]),
    lambda: np.array([2**64, 1], dtype=object),  # Python ints past uint64
    lambda: np.array(["1", "2"]),
    lambda: [],  # an empty list is float64 to NumPy
]


@pytest.fixture(scope="module")
def address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("index-dtypes") / "server.log"
    proc, addr = start_server(log)
    try:
        yield addr
    finally:
        stop(proc)


def _create(c: Client, name: str) -> None:
    c.create_group(
        name,
        Adam(),
        learning_rate=0.1,
        tensors={"w": np.zeros((ROWS, DIM), F32)},
        tables={"emb": IdsTable(DIM)},
    )


def _state(c: Client, name: str) -> tuple[int, list[int], list[bytes]]:
    t, values = c.pull_versioned(name, state=True)
    ids = c.list_rows(name, "emb", page_size=1000).ids.tolist()
    return t, ids, [v.tobytes() for v in values]


@pytest.mark.parametrize("dtype", INTEGERS)
def test_every_integer_dtype_is_taken_exactly(address: str, dtype: str) -> None:
    top = int(np.iinfo(dtype).max)
    if dtype == "uint64":
        top = 2**63 - 1  # the largest uint64 an int64 holds
    rows = np.ones((2, DIM), F32)
    with Client(address, timeout=30) as c:
        _create(c, f"ok-{dtype}")
        _create(c, f"ref-{dtype}")
        ids = np.array([top, 5], dtype)
        idx = np.array([min(top, ROWS - 1), 5], dtype)
        got = c.push_rows(f"ok-{dtype}", {"emb": (ids, rows), "w": (idx, rows)})
        as64 = {"emb": (ids.astype(object).astype(np.int64), rows)}
        want = c.push_rows(f"ref-{dtype}", {**as64, "w": (idx.astype(np.int64), rows)})
        assert got.update_count == want.update_count == 1
        t, held, values = _state(c, f"ok-{dtype}")
        assert held == sorted([top, 5])  # the id itself, not a wrapped one
        assert (t, held, values) == _state(c, f"ref-{dtype}")
        pulled = c.pull_rows(f"ok-{dtype}", {"emb": ids, "w": idx})
        ref = c.pull_rows(f"ref-{dtype}", {"emb": ids.astype(np.int64), "w": idx})
        for k in ("emb", "w"):
            np.testing.assert_array_equal(pulled[k], ref[k], strict=True)


@pytest.mark.parametrize("value", TOO_BIG)
def test_uint64_beyond_int64_is_refused_not_wrapped(address: str, value: int) -> None:
    """2**64-1 landed on id -1 (and 2**63 on -2**63) before."""
    with Client(address, timeout=30) as c:
        name = f"big-{value}"
        _create(c, name)
        c.push_rows(name, {"emb": (np.array([-1, -(2**63)]), np.ones((2, DIM), F32))})
        before = _state(c, name)
        ids = np.array([3, value], np.uint64)
        for call in (
            lambda: c.push_rows(name, {"emb": (ids, np.ones((2, DIM), F32))}),
            lambda: c.push_rows(name, {"w": (ids, np.ones((2, DIM), F32))}),
            lambda: c.pull_rows(name, {"emb": ids}),
        ):
            with pytest.raises(InvalidArgumentError) as err:
                call()
            assert isinstance(err.value, ValueError)
            assert err.value.reason == "ROW_INDICES"
            assert f"{value} of " in err.value.details
            assert "does not fit in int64" in err.value.details
        assert _state(c, name) == before


@pytest.mark.parametrize(
    "make", NOT_INTEGERS, ids=["float64", "float32", "bool", "object", "str", "[]"]
)
def test_other_dtypes_are_refused_before_sending(
    address: str, make: Callable[[], Any]
) -> None:
    with Client(address, timeout=30) as c:
        name = "floats"
        if "floats" not in [g.name for g in c.list_groups()]:
            _create(c, name)
        before = _state(c, name)
        raw = make()
        k = np.asarray(raw).size
        for call in (
            lambda: c.push_rows(name, {"emb": (raw, np.ones((k, DIM), F32))}),
            lambda: c.push_rows(name, {"w": (raw, np.ones((k, DIM), F32))}),
            lambda: c.pull_rows(name, {"w": raw}),
        ):
            with pytest.raises(InvalidArgumentError) as err:
                call()
            assert err.value.reason == "ROW_INDICES"
            assert "must be integers" in err.value.details
        assert _state(c, name) == before


def test_the_async_client_takes_and_refuses_the_same(address: str) -> None:
    async def run() -> tuple[list[int], list[str]]:
        reasons = []
        async with AsyncClient(address, timeout=30) as c:
            await c.create_group(
                "async",
                Adam(),
                learning_rate=0.1,
                tensors={"w": np.zeros((ROWS, DIM), F32)},
                tables={"emb": IdsTable(DIM)},
            )
            ids = np.array([7, 2**31 - 1], np.int32)
            await c.push_rows("async", {"emb": (ids, np.ones((2, DIM), F32))})
            for bad in (np.array([2**64 - 1], np.uint64), np.array([1.5])):
                for call in (
                    c.push_rows("async", {"emb": (bad, np.ones((1, DIM), F32))}),
                    c.pull_rows("async", {"w": bad}),
                ):
                    try:
                        await call
                    except InvalidArgumentError as exc:
                        reasons.append(str(exc.reason))
            page = await c.list_rows("async", "emb")
            return page.ids.tolist(), reasons

    held, reasons = asyncio.run(run())
    assert held == [7, 2**31 - 1]
    assert reasons == ["ROW_INDICES"] * 4


@pytest.mark.slow
def test_a_cluster_takes_and_refuses_the_same(tmp_path: Path) -> None:
    """Ids tables split by id hash and a table split by rows, on 3 shards."""
    with shards(tmp_path, 3) as (addresses, _):
        with Client(addresses, timeout=30, split_bytes=1000) as c:
            c.create_group(
                "ids",
                Adam(),
                learning_rate=0.1,
                tensors={},
                tables={"emb": IdsTable(DIM, dtype=F32)},
            )
            c.create_group(
                "rows",
                Adam(),
                learning_rate=0.1,
                tensors={"w": np.zeros((ROWS, DIM), F32)},
            )
            assert len(c.describe_group("rows").parts) > 1
            ids = np.array([2**32 - 1, 9, 2**63 - 1], np.uint64)
            rows = np.ones((3, DIM), F32)
            assert c.push_rows("ids", {"emb": (ids, rows)}).update_count == 1
            idx = np.array([299, 0, 150], np.int32)
            assert c.push_rows("rows", {"w": (idx, rows)}).update_count == 1
            held = c.list_rows("ids", "emb").ids.tolist()
            assert held == [9, 2**32 - 1, 2**63 - 1]
            pulled = c.pull_rows("rows", {"w": idx})["w"]
            np.testing.assert_array_equal(
                pulled, c.pull_rows("rows", {"w": idx.astype(np.int64)})["w"]
            )
            for bad in (np.array([5, 2**64 - 1], np.uint64), np.array([1.0, 2.0])):
                for call in (
                    lambda b=bad: c.push_rows("ids", {"emb": (b, rows[:2])}),
                    lambda b=bad: c.pull_rows("ids", {"emb": b}),
                    lambda b=bad: c.push_rows("rows", {"w": (b, rows[:2])}),
                    lambda b=bad: c.pull_rows("rows", {"w": b}),
                ):
                    with pytest.raises(InvalidArgumentError) as err:
                        call()
                    assert err.value.reason == "ROW_INDICES"
            assert c.list_rows("ids", "emb").ids.tolist() == held
            assert [p.update_count for p in c.describe_group("ids").parts] == [1] * 3


# -- the wire, as a client in another language sends it -------------------------------
def _refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, list[str], str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    status = rpc_status.from_call(err.value)  # type: ignore[arg-type]
    assert status is not None
    info, fields = error_details_pb2.ErrorInfo(), []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
    return err.value.code(), info.reason, fields, err.value.details() or ""


WIRE = [
    (pb.DATA_TYPE_UNSPECIFIED, [1], 0, np.array([1], np.int64)),
    (pb.DATA_TYPE_FLOAT, [1], 0, np.array([1], np.float32)),
    (pb.DATA_TYPE_DOUBLE, [1], 0, np.array([1], np.float64)),
    (6, [1], 0, np.array([1], np.int32)),  # ONNX INT32: not a wire type
    (13, [1], 0, np.array([1], np.uint64)),  # ONNX UINT64: not a wire type
    (pb.DATA_TYPE_INT64, [1, 1], 0, np.array([1], np.int64)),
    (pb.DATA_TYPE_INT64, [1], pb.ENCODING_BFLOAT16, np.array([1], np.uint16)),
]


@pytest.mark.parametrize(("dtype", "dims", "encoding", "data"), WIRE)
@pytest.mark.parametrize("tensor", ["w", "emb"])
def test_bad_indices_on_the_wire_are_invalid_argument_row_indices(
    address: str, dtype: int, dims: list[int], encoding: int, data: Any, tensor: str
) -> None:
    with Client(address, timeout=30) as c:
        if "wire" not in [g.name for g in c.list_groups()]:
            _create(c, "wire")
        before = _state(c, "wire")
    indices = pb.Tensor(dtype=dtype, dims=dims, encoding=encoding)  # type: ignore[arg-type]
    rows = np.ones((1, DIM), F32)
    push = pb.PushRowsHeader(group="wire")
    push.gradients.add(
        name=tensor,
        indices=indices,
        values=pb.Tensor(dtype=pb.DATA_TYPE_FLOAT, dims=[1, DIM]),
    )
    pull = pb.PullRowsHeader(group="wire")
    pull.tensors.add(name=tensor, indices=indices)

    def chunk(i: int, raw: bytes) -> pb.TensorChunk:
        return pb.TensorChunk(index=i, offset=0, data=raw)

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ParameterServerServiceStub(channel)
        pushed = [
            pb.PushRowsRequest(header=push),
            pb.PushRowsRequest(chunk=chunk(0, data.tobytes())),
            pb.PushRowsRequest(chunk=chunk(1, rows.tobytes())),
        ]
        pulled = [
            pb.PullRowsRequest(header=pull),
            pb.PullRowsRequest(chunk=chunk(0, data.tobytes())),
        ]
        for what, call in (
            ("gradients[0].indices", lambda: stub.PushRows(iter(pushed), timeout=10)),
            (
                "tensors[0].indices",
                lambda: list(stub.PullRows(iter(pulled), timeout=10)),
            ),
        ):
            code, reason, fields, details = _refusal(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert reason == "ROW_INDICES"
            assert fields == [what]
            assert "must be DATA_TYPE_INT64 (7) with dims [k]" in details
            assert f"got data type {dtype} " in details
    with Client(address, timeout=30) as c:
        assert _state(c, "wire") == before
