"""A standby behind gets several whole records per Replicate message (issue 36):
log shipping protocol 2, ``ReplicateResponse.records``. One message per record
cost a thread handoff on each side per record, which capped a standby catching
up under load at about 1,500 records/s.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _replicas import SIZE, ReplicaSet, _create, _kill
from onnxps.client import Client
from onnxps.server.durability._wal import Frame, read_segments
from onnxps.server.replication._frames import (
    PIECE,
    Gather,
    ShippedBatch,
    batch,
    check_frame,
    decode_response,
    frame_arrays,
    logged_frames,
    pieces,
)
from onnxps.server.replication._standby import _whole
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc


def _frame(lsn: int, n: int) -> Frame:
    header = f'{{"lsn": {lsn}, "op": "push", "arrays": [["<f4", [{n}]]]}}'
    return Frame(header.encode(), [np.full(n, lsn, np.float32)])


def _bytes(frame: Frame) -> bytes:
    return b"".join(bytes(c) for c in frame.chunks())


def test_a_batch_is_the_message_protobuf_encodes_and_decodes_to_views() -> None:
    """``batch`` writes what protobuf writes for ReplicateResponse(term,
    records=ReplicaRecordBatch(...)); the standby's deserializer gives each record
    as a view of the message, checked and read as a record alone is."""
    frames = {lsn: _frame(lsn, 100 + lsn) for lsn in (7, 8, 9)}
    message = batch(3, [(lsn, f.chunks()) for lsn, f in frames.items()])
    expected = pb.ReplicateResponse(
        term=3,
        records=pb.ReplicaRecordBatch(
            records=[
                pb.ReplicaRecord(lsn=lsn, frame=_bytes(f)) for lsn, f in frames.items()
            ]
        ),
    )
    assert message == expected.SerializeToString()
    got = decode_response(message)
    assert isinstance(got, ShippedBatch)
    assert got.term == 3
    assert [r.lsn for r in got.records] == [7, 8, 9]
    for rec in got.records:
        assert rec.frame.obj is message  # a view: no copy
        assert bytes(rec.frame) == _bytes(frames[rec.lsn])
        header = check_frame(rec, rec.lsn)
        (x,) = frame_arrays(header, rec.whole())
        np.testing.assert_array_equal(x, np.full(100 + rec.lsn, rec.lsn, np.float32))


def test_a_batch_amid_a_records_pieces_or_holding_a_piece_is_refused() -> None:
    """Records of a batch are whole: one arriving while a record's pieces are
    missing, or one that is only the first piece of a frame (a damaged stream),
    raises, so nothing of either is written."""
    big = Frame(
        b'{"lsn": 3, "op": "push", "arrays": []}', [np.ones(2 * PIECE, np.uint8)]
    )
    first = decode_response(next(pieces(1, 3, big.chunks())))
    gather = Gather(64 << 20)
    assert _whole(gather, first) == []
    message = decode_response(batch(1, [(4, _frame(4, 8).chunks())] * 2))
    with pytest.raises(ValueError, match="record 3: 1048576 of its .* of record 4"):
        _whole(gather, message)
    cut = decode_response(batch(1, [(2, _frame(2, 8).chunks()), (3, [first.frame])]))
    with pytest.raises(ValueError, match="record 3 of a batch is not whole"):
        _whole(Gather(64 << 20), cut)


def _member(rs: ReplicaSet, member_id: str) -> int:
    etcd = rs.etcd.gateway()
    lease = etcd.lease(60)
    key = f"/{rs.prefix}/shards/0/members/{member_id}"
    etcd.put(key, '{"address": "127.0.0.1:9"}', lease=lease)
    return int(lease.id)


def _messages(
    address: str, protocol: int, after: int, last: int, lease: int
) -> list[list[tuple[int, bytes]]]:
    """The records of each message a standby speaking ``protocol`` gets, resuming
    after record ``after`` (the test is the standby), up to record ``last``."""
    acks: queue.Queue[pb.ReplicateRequest | None] = queue.Queue()
    acks.put(
        pb.ReplicateRequest(
            hello=pb.ReplicateHello(
                member_id=f"b{protocol}", term=1, address="127.0.0.1:9",
                last_lsn=after, last_term=1, protocol=protocol, lease=lease,
            )
        )
    )  # fmt: skip

    def requests() -> Any:
        while (item := acks.get()) is not None:
            yield item

    got: list[list[tuple[int, bytes]]] = []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        call: Any = stub.Replicate(requests(), timeout=60)
        try:
            for msg in call:
                part = msg.WhichOneof("part")
                assert part in ("record", "records"), msg  # no snapshot
                records = [msg.record] if part == "record" else msg.records.records
                got.append([(r.lsn, r.frame) for r in records])
                if records[-1].lsn >= last:
                    break
        finally:
            call.cancel()
            acks.put(None)
    return got


@pytest.mark.slow
def test_a_standby_behind_gets_its_records_batched_as_the_log_holds_them(
    replicas: Any, tmp_path: Path
) -> None:
    """300 records behind, a standby speaking protocol 2 gets them in few
    messages of consecutive whole records (at most 1 MiB of frames each), byte for
    byte the primary's log; one speaking protocol 1 gets one record a message."""
    rs: ReplicaSet = replicas(1, extra=("--sync-replicas", "0"))
    p = rs.primary()
    _create(rs.url)
    with Client(rs.url, timeout=60) as c:
        for k in range(300):
            c.push("g", np.full(SIZE, 0.01 * k, np.float32))
    wal = str(tmp_path / f"data{p}" / "wal")
    last = max(int(h["lsn"]) for h, _ in read_segments(wal, 0))
    logged = {lsn: b"".join(chunks) for lsn, chunks in logged_frames(wal, 0, last)}
    first = last - 300  # the create
    batched = _messages(rs.addresses[p], 2, first, last, _member(rs, "b2"))
    records = [r for m in batched for r in m]
    assert [lsn for lsn, _ in records] == list(range(first + 1, last + 1))
    assert all(frame == logged[lsn] for lsn, frame in records)
    assert len(batched) <= 3  # 300 records of ~470 bytes: one message, or a few
    assert max(len(m) for m in batched) >= 100
    assert all(sum(len(f) for _, f in m) <= PIECE for m in batched)
    single = _messages(rs.addresses[p], 1, first, first + 20, _member(rs, "b1"))
    assert [[lsn for lsn, _ in m] for m in single] == [
        [lsn] for lsn in range(first + 1, first + 21)
    ]


@pytest.mark.slow
def test_a_standby_catching_up_in_batches_holds_its_primarys_state(
    replicas: Any,
) -> None:
    """A standby stopped for 500 pushes follows again (batches from the log)
    while pushes go on (batches of what the primary keeps), and ends with the
    primary's X and T."""
    rs: ReplicaSet = replicas(2, extra=("--sync-replicas", "0"))
    p = rs.primary()
    s = 1 - p
    _create(rs.url)
    rs.wait_t(s, "g", 0)
    _kill(rs, s)
    with Client(rs.url, timeout=60) as c:
        for k in range(500):
            c.push("g", np.full(SIZE, 0.001 * k, np.float32))
        rs.start(s)
        for k in range(500):
            c.push("g", np.full(SIZE, -0.001 * k, np.float32))
    rs.wait_t(s, "g", 1000)
    t_p, x_p = rs.state(p, "g")
    t_s, x_s = rs.state(s, "g")
    assert t_p == t_s == 1000
    np.testing.assert_array_equal(x_s, x_p)
