"""Replicated shards: what the standbys' logs hold (issue 23).

A standby writes the frames its primary ships as they came, so its log holds the
primary's bytes; restarted with its data directory it resumes after its own last
record instead of taking a snapshot, unless its log holds a record of a deposed
primary that the new primary's log lacks or holds in another term.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _replicas import SIZE, ReplicaSet, _create, _kill
from onnxps.client import Adagrad, Client
from onnxps.server.durability._wal import FRAME, Frame, WriteAheadLog, read_segments
from onnxps.server.replication._frames import (
    PIECE,
    WHOLE,
    Gather,
    check_frame,
    decode_response,
    frame_arrays,
    logged_frames,
    pieces,
)

LOWER = ("--sync-policy", "lower")


def _frames(wal_dir: Path) -> dict[int, bytes]:
    last = max((int(h["lsn"]) for h, _ in read_segments(str(wal_dir), 0)), default=0)
    return {
        lsn: b"".join(chunks) for lsn, chunks in logged_frames(str(wal_dir), 0, last)
    }


def _create_big(c: Client, n: int) -> None:
    """The group "big": one float32 tensor of ``n`` elements (Adagrad)."""
    c.create_group(
        "big", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(n, np.float32)}
    )


def _log(tmp_path: Path, i: int, start: int) -> str:
    return (tmp_path / f"server{i}-{start}.log").read_text()


@pytest.mark.slow
def test_a_standby_logs_the_bytes_its_primary_logged(
    replicas: object,
    tmp_path: Path,
) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary()
    s = 1 - p
    rs.wait_sync()
    _create(rs.url)
    with Client(rs.url, timeout=30) as c:
        for k in range(3):
            c.push("g", np.full(SIZE, 0.5 + k, np.float32))
    rs.wait_t(s, "g", 3)
    primary = _frames(tmp_path / f"data{p}" / "wal")
    standby = _frames(tmp_path / f"data{s}" / "wal")
    assert sorted(primary) == [1, 2, 3, 4]  # the create, then 3 pushes
    # The standby's log starts after the snapshot it adopted (which may hold the
    # create); every record it holds is the primary's frame, byte for byte.
    assert sorted(standby) in ([1, 2, 3, 4], [2, 3, 4])
    assert {lsn: primary[lsn] for lsn in standby} == standby


def test_a_restarted_standby_resumes_from_its_log_without_a_snapshot(
    replicas: object,
    tmp_path: Path,
) -> None:
    rs: ReplicaSet = replicas(2, extra=LOWER)  # type: ignore[operator]
    p = rs.primary()
    s = 1 - p
    rs.wait_sync()
    _create(rs.url)
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30) as c:
        assert [c.push("g", g) for _ in range(3)] == [1, 2, 3]
        rs.wait_t(s, "g", 3)
        _kill(rs, s)
        assert [c.push("g", g) for _ in range(2)] == [4, 5]  # the primary alone
        rs.start(s)
        assert rs.wait_sync() == [f"m{s}"]
        assert c.push("g", g) == 6
    rs.wait_t(s, "g", 6)
    np.testing.assert_array_equal(rs.state(s, "g")[1], rs.state(p, "g")[1])
    # lsn 4 is the third push: the last record in the standby's log
    assert re.search(
        rf"standby m{s} \(\S+\) resumes after record 4 \(term 1\)",
        _log(tmp_path, p, 1),
    ), _log(tmp_path, p, 1)[-3000:]
    restarted = _log(tmp_path, s, 2)
    assert "from record 5 (after this server's record 4: resumed" in restarted
    assert "caught up from" not in restarted  # no snapshot adopted


@pytest.mark.slow
def test_a_standby_holding_a_deposed_primarys_record_takes_a_snapshot(
    replicas: object,
    tmp_path: Path,
) -> None:
    rs: ReplicaSet = replicas(2, extra=LOWER)  # type: ignore[operator]
    p = rs.primary()
    s = 1 - p
    rs.wait_sync()
    _create(rs.url)
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 1  # lsn 2, term 1
    rs.wait_t(s, "g", 1)
    _kill(rs, p)
    assert rs.primary(not_=p) == s  # term 2
    # What p would hold had it logged a push (lsn 3, term 1) and died before
    # shipping it: a record the new primary never had.
    wal = WriteAheadLog(str(tmp_path / f"data{p}" / "wal"), next_lsn=3)
    record = {
        "op": "push", "group": "g", "client_id": "lost", "seq": 1,
        "base_version": None, "lr": None, "t": 1, "term": 1,
    }  # fmt: skip
    wal.wait(wal.log(record, [np.full(SIZE, 9.0, np.float32)]))
    wal.close()
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", np.full(SIZE, 0.25, np.float32)) == 2  # lsn 3, term 2
    rs.start(p)  # replays its log: T=2, by the lost push
    assert rs.wait_sync() == [f"m{p}"]  # after it adopted s's snapshot
    rs.wait_t(p, "g", 2)
    np.testing.assert_array_equal(rs.state(p, "g")[1], rs.state(s, "g")[1])
    assert re.search(
        rf"standby m{p} \(\S+, last record 3 of term 1\): sending snapshot",
        _log(tmp_path, s, 1),
    ), _log(tmp_path, s, 1)[-3000:]
    assert "caught up from" in _log(tmp_path, p, 2)


@pytest.mark.slow
def test_a_standby_is_named_synchronous_only_once_it_holds_all_the_last_primary_did(
    replicas: object,
) -> None:
    rs: ReplicaSet = replicas(3)  # type: ignore[operator]
    a = rs.primary()
    (named,) = rs.wait_sync()
    b = int(named[1:])
    c = 3 - a - b
    n, pushes = 1 << 18, 150  # 1 MiB a push: c takes a while to catch up
    g = np.full(n, 0.5, np.float32)
    with Client(rs.url, timeout=60) as cl:
        cl.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(n, np.float32)}
        )
        os.kill(rs.procs[c].pid, signal.SIGSTOP)  # c falls behind
        assert [cl.push("g", g) for _ in range(pushes)][-1] == pushes
    _kill(rs, a)
    assert rs.primary(not_=a) == b  # the one that holds every acknowledged push
    os.kill(rs.procs[c].pid, signal.SIGCONT)
    # b names c once c holds every record b holds: all a acknowledged too
    assert rs.wait_sync() == [f"m{c}"]
    _kill(rs, b)
    assert rs.primary(not_=b) == c
    assert rs.state(c, "g")[0] == pushes


@pytest.mark.slow
def test_an_idle_standby_keeps_its_stream_past_the_stall_limit(
    replicas: object,
    tmp_path: Path,
) -> None:
    rs: ReplicaSet = replicas(2, extra=("--stall-seconds", "6"))  # type: ignore[operator]
    p = rs.primary_with_group()
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 1
        time.sleep(15)  # idle past --stall-seconds: Replicate is not a stalled call
        assert c.push("g", np.full(SIZE, 0.5, np.float32)) == 2
    log = _log(tmp_path, p, 1)
    assert "stopped following" not in log
    assert "sent nothing for 6 s" not in log


def test_a_standby_acks_before_it_applies_but_stops_following_once_applied(
    replicas: object,
    tmp_path: Path,
) -> None:
    """The promotion path (``follow(None)``, then ``idle``) waits for the records
    the standby acknowledged to be applied: here its applier is held up by the
    group's lock, taken by the test, while three pushes are acknowledged."""
    from onnxps.server.durability import Durability
    from onnxps.server.replication._member import PrimaryInfo
    from onnxps.server.store import ParameterStore

    rs: ReplicaSet = replicas(1, extra=("--sync-replicas", "0"))  # type: ignore[operator]
    p = rs.primary()
    _create(rs.url)
    store = ParameterStore()
    durability = Durability(store, str(tmp_path / "follower"), mode="wal")
    durability.open()
    follower = _follower(rs, durability)
    follower.start()
    try:
        follower.follow(PrimaryInfo(f"m{p}", rs.addresses[p], 1))
        deadline = time.monotonic() + 60
        # The snapshot adopted: the group shows before its restore is done (which
        # takes the group's lock too), and ``durable`` is set only once it is.
        while follower.durable < 1 or not [v for v in store.groups() if v.name == "g"]:
            assert time.monotonic() < deadline, "the follower did not catch up"
            time.sleep(0.02)
        with store._group("g").cond:  # its next step waits for this lock
            with Client(rs.url, timeout=30) as c:
                ts = [c.push("g", np.full(SIZE, 0.5, np.float32)) for _ in range(3)]
            assert ts == [1, 2, 3]
            while follower.durable < 4:  # the create (1) and 3 pushes: logged here
                assert time.monotonic() < deadline, "the pushes did not arrive"
                time.sleep(0.02)
            follower.follow(None)
            assert not follower.idle.wait(1.0)  # it is still applying them
            assert follower.applied < 4
        assert follower.idle.wait(30)
        assert follower.applied == 4
        assert store.describe("g").update_count == 3
    finally:
        follower.stop()
        durability.close()


def _follower(rs: ReplicaSet, durability: Any) -> Any:
    """A standby's follower in this process, as member "f" (registered in etcd)."""
    from onnxps.server.replication._standby import Follower

    lease = _member(rs, "f")
    return Follower(
        durability, member_id="f", address="127.0.0.1:1", term=lambda: 0,
        max_message_bytes=64 << 20, lease=lambda: lease,
    )  # fmt: skip


def _applier(limit: int = 256 << 20) -> tuple[Any, list[int], threading.Event]:
    """A standby's applier whose records are header-only: what it applied, in
    order, and an event set by each apply."""
    from onnxps.server.replication._standby import _Applier

    applied: list[int] = []
    event = threading.Event()

    def apply(header: dict[str, Any], frame: memoryview, covered: object) -> None:
        applied.append(int(header["lsn"]))
        event.set()

    return _Applier(apply, limit=limit), applied, event


def test_a_standby_applies_a_record_once_its_ack_is_sent() -> None:
    """Applying a record waits for its ack to go out (``sent``: the Replicate
    stream asks for the next message once the ack is sent), so it does not hold
    the standby's GIL and a core while the ack is on its way; ``close`` applies
    what is left."""
    applier, applied, event = _applier()
    try:
        applier.put({"lsn": 1}, memoryview(b"a"), {})
        applier.put({"lsn": 2}, memoryview(b"b"), {})
        assert not event.wait(0.5)  # no ack sent yet: nothing applied
        applier.sent(1)
        assert event.wait(30)
        assert applied == [1]  # record 2's ack is not sent
    finally:
        assert applier.close()
    assert applied == [1, 2]


def test_a_standby_applies_without_waiting_for_acks_once_its_queue_is_full() -> None:
    """A record that does not fit in the applier's queue (``limit`` bytes) lets
    the ones queued be applied without waiting for their acks: the receiver is
    never stuck behind acks it cannot send."""
    applier, applied, _ = _applier(limit=4)
    try:
        applier.put({"lsn": 1}, memoryview(b"abc"), {})
        second = threading.Thread(
            target=applier.put, args=({"lsn": 2}, memoryview(b"def"), {})
        )
        second.start()
        second.join(30)
        assert not second.is_alive()
        assert applied == [1]
    finally:
        assert applier.close()
    assert applied == [1, 2]


def _gathered(messages: list[bytes]) -> list[Any]:
    gather = Gather(64 << 20)
    return [gather.add(decode_response(m)) for m in messages]


def test_a_record_is_shipped_in_pieces_of_1_mib_and_gathered_whole() -> None:
    """A 3.2 MB record goes as 4 messages of at most 1 MiB of its frame each
    (copied as they are sent: no 3.2 MB join), and the standby gathers them into
    the frame as the log holds it; only the last piece yields the record."""
    x = np.arange(800_000, dtype=np.float32)
    frame = Frame(b'{"lsn": 7, "op": "push", "arrays": [["<f4", [800000]]]}', [x])
    whole = b"".join(bytes(c) for c in frame.chunks())
    messages = list(pieces(3, 7, frame.chunks()))
    assert len(messages) == 4
    assert all(len(m) <= PIECE + 16 for m in messages)
    got = _gathered(messages)
    assert got[:3] == [None, None, None]
    rec = got[3]
    assert (rec.term, rec.lsn, bytes(rec.whole())) == (3, 7, whole)
    header = check_frame(rec, 7)
    np.testing.assert_array_equal(frame_arrays(header, rec.whole())[0], x)
    # from a byte on (the rest of a record read back from the log)
    rest = list(pieces(3, 7, [whole], 2 * PIECE))
    assert rest == messages[2:]


def test_a_gathered_record_keeps_its_pieces_as_received_checked_by_their_crc() -> None:
    """The pieces are not copied on the way to the ack: the record's chunks (what
    the log writes) are views of the messages received, and the CRC computed as
    they came checks them: one byte changed in a middle piece is refused."""
    x = np.arange(800_000, dtype=np.float32)
    frame = Frame(b'{"lsn": 7, "op": "push", "arrays": [["<f4", [800000]]]}', [x])
    messages = list(pieces(3, 7, frame.chunks()))
    rec = _gathered(messages)[-1]
    assert [c.obj for c in rec.chunks()] == messages
    assert rec.crc == int.from_bytes(bytes(frame.chunks()[0])[-4:], "little")
    assert check_frame(rec, 7)["lsn"] == 7
    damaged = bytearray(messages[2])
    damaged[len(damaged) // 2] ^= 1
    bad = _gathered([*messages[:2], bytes(damaged), messages[3]])[-1]
    with pytest.raises(ValueError, match="record 7: checksum mismatch"):
        check_frame(bad, 7)


def test_a_small_record_is_one_message_passed_as_it_came() -> None:
    frame = Frame(b'{"lsn": 2, "op": "push", "arrays": [["<f4", [4]]]}', [np.ones(4)])
    (message,) = pieces(1, 2, frame.chunks())
    (rec,) = _gathered([message])
    assert bytes(rec.frame) == b"".join(bytes(c) for c in frame.chunks())


def test_a_record_shipped_whole_by_an_earlier_primary_is_taken_as_it_came() -> None:
    """An earlier primary ships a 3.2 MB record in one message (as to a protocol 0
    standby now): this version's standby takes it whole, with no gathering."""
    x = np.arange(800_000, dtype=np.float32)
    frame = Frame(b'{"lsn": 7, "op": "push", "arrays": [["<f4", [800000]]]}', [x])
    (message,) = pieces(3, 7, frame.chunks(), 0, WHOLE)
    (rec,) = _gathered([message])
    assert bytes(rec.frame) == b"".join(bytes(c) for c in frame.chunks())
    np.testing.assert_array_equal(
        frame_arrays(check_frame(rec.frame, 7), rec.frame)[0], x
    )


def test_the_first_piece_holds_the_header_whole_beyond_1_mib() -> None:
    """A header of nearly MAX_HEADER (1 MiB): the first piece is the prefix and
    the header, longer than a piece."""
    head = '{"lsn": 5, "op": "push", "arrays": [], "pad": "'
    pad = "x" * (PIECE - 8 - len(head) - 2)
    header = f'{head}{pad}"}}'.encode()
    assert len(header) == PIECE - 8
    frame = Frame(header, [np.ones(PIECE, np.uint8)])
    messages = list(pieces(1, 5, frame.chunks()))
    first = decode_response(messages[0])
    assert len(first.frame) == FRAME.size + len(header) > PIECE
    assert check_frame(_gathered(messages)[-1], 5)["pad"] == pad


def test_a_record_cut_short_by_the_next_one_is_refused_not_gathered() -> None:
    """The stream of a record's pieces broken by another record (a damaged stream)
    raises: nothing of it is written or acknowledged."""
    big = Frame(
        b'{"lsn": 3, "op": "push", "arrays": []}', [np.ones(3 * PIECE, np.uint8)]
    )
    small = Frame(b'{"lsn": 4, "op": "push", "arrays": []}')
    gather = Gather(64 << 20)
    assert gather.add(decode_response(next(pieces(1, 3, big.chunks())))) is None
    with pytest.raises(ValueError, match="record 3: 1048.* of its 3145.* bytes came"):
        gather.add(decode_response(next(pieces(1, 4, small.chunks()))))


@pytest.mark.slow
def test_a_standby_logs_a_record_of_several_pieces_as_its_primary_did(
    replicas: object,
    tmp_path: Path,
) -> None:
    """A 4 MiB push (5 pieces) is in the standby's log byte for byte, and in its
    state."""
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary()
    s = 1 - p
    rs.wait_sync()
    n = 1 << 20
    with Client(rs.url, timeout=60) as c:
        _create_big(c, n)
        for k in range(2):
            c.push("big", np.linspace(-1, 1 + k, n, dtype=np.float32))
    rs.wait_t(s, "big", 2)
    primary = _frames(tmp_path / f"data{p}" / "wal")
    standby = _frames(tmp_path / f"data{s}" / "wal")
    assert max(len(f) for f in standby.values()) > 4 * PIECE
    assert {lsn: primary[lsn] for lsn in standby} == standby
    t_p, x_p = rs.state(p, "big")
    t_s, x_s = rs.state(s, "big")
    assert t_p == t_s == 2
    np.testing.assert_array_equal(x_s, x_p)


def test_a_first_piece_declaring_a_frame_above_the_message_limit_is_refused() -> None:
    """The size a first piece declares is bounded by the standby's message limit
    (a record used to come in one message): no buffer of a damaged length."""
    frame = Frame(
        b'{"lsn": 9, "op": "push", "arrays": []}', [np.ones(2 * PIECE, np.uint8)]
    )
    first = decode_response(next(pieces(1, 9, frame.chunks())))
    with pytest.raises(
        ValueError, match="a frame of 2097.* bytes \\(at most 2000000\\)"
    ):
        Gather(2_000_000).add(first)
    assert Gather(3 * PIECE).add(first) is None


def _member(rs: ReplicaSet, member_id: str) -> int:
    """Register ``member_id`` in the shard as a replica does (its key, on a lease
    of its own): the lease a hello proves the member id with."""
    etcd = rs.etcd.gateway()
    lease = etcd.lease(60)
    key = f"/{rs.prefix}/shards/0/members/{member_id}"
    etcd.put(key, '{"address": "127.0.0.1:9"}', lease=lease)
    return int(lease.id)


def _shipped(address: str, protocol: int, lsn: int, size: int, lease: int) -> list[int]:
    """The sizes of the messages carrying record ``lsn`` (a frame of ``size``
    bytes) to a standby speaking ``protocol``: the test is the standby."""
    import queue

    import grpc
    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

    acks: queue.Queue[pb.ReplicateRequest | None] = queue.Queue()
    hello = pb.ReplicateHello(
        member_id=f"p{protocol}",
        term=1,
        address="127.0.0.1:9",
        last_lsn=lsn - 1,  # resumes from the log: no snapshot
        last_term=1,
        protocol=protocol,
        lease=lease,
    )
    acks.put(pb.ReplicateRequest(hello=hello))

    def requests() -> Any:
        while (item := acks.get()) is not None:
            yield item

    sizes: list[int] = []
    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(address, options=options) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        call: Any = stub.Replicate(requests(), timeout=60)
        try:
            for msg in call:
                assert msg.WhichOneof("part") == "record", msg  # no snapshot
                if msg.record.lsn == lsn:
                    sizes.append(len(msg.record.frame))
                    if sum(sizes) >= size:
                        break
        finally:
            call.cancel()
            acks.put(None)
    return sizes


def test_a_standby_of_an_earlier_version_gets_its_records_whole(
    replicas: object,
    tmp_path: Path,
) -> None:
    """A standby that announces no protocol (an earlier onnxps, which takes a record
    in one message) gets each record whole; one speaking protocol 1 gets a 4 MiB
    record in pieces of 1 MiB. The primary's log says which standby is behind."""
    rs: ReplicaSet = replicas(1, extra=("--sync-replicas", "0"))  # type: ignore[operator]
    p = rs.primary()
    n = 1 << 20
    with Client(rs.url, timeout=60) as c:
        _create_big(c, n)
        assert c.push("big", np.ones(n, np.float32)) == 1
    frames = _frames(tmp_path / f"data{p}" / "wal")
    lsn = max(frames)  # the push
    size = len(frames[lsn])
    assert size > 4 * PIECE
    assert _shipped(rs.addresses[p], 0, lsn, size, _member(rs, "p0")) == [size]
    pieces_ = _shipped(rs.addresses[p], 1, lsn, size, _member(rs, "p1"))
    assert len(pieces_) == 5 and sum(pieces_) == size
    assert max(pieces_) <= PIECE + FRAME.size + 4096  # the first holds the header
    log = _log(tmp_path, p, 1)
    assert "standby p0 (127.0.0.1:9) speaks log shipping protocol 0" in log
    assert "standby p1 (127.0.0.1:9) speaks" not in log


def _wal_with(
    tmp_path: Path, n: int, rotate_every: int
) -> tuple[Path, dict[int, bytes]]:
    """A real write-ahead log of ``n`` records in segments of ``rotate_every``."""
    wal_dir = tmp_path / "wal"
    wal_dir.mkdir()
    wal = WriteAheadLog(str(wal_dir), 1)
    try:
        for k in range(1, n + 1):
            lsn = wal.log({"op": "push", "group": "g"}, [np.full(8, k, np.float32)])
            wal.wait(lsn)
            if k % rotate_every == 0:
                wal.rotate()
    finally:
        wal.close()
    return wal_dir, _frames(wal_dir)


def test_a_log_cursor_reads_on_where_it_stopped_across_segments(
    tmp_path: Path,
) -> None:
    """The primary ships a standby's missing records on one cursor per stream: each
    call goes on where the last stopped (one pass over the log), across segment
    rotations, and a record asked for before its position is read again."""
    from onnxps.server.durability._walread import LogCursor

    wal_dir, frames = _wal_with(tmp_path, 30, rotate_every=7)
    assert len(list(wal_dir.glob("*"))) == 5  # 30 records in segments of 7
    cursor = LogCursor(str(wal_dir))
    try:
        got = {int(h["lsn"]): b"".join(c) for h, c in cursor.frames(12)}
        assert sorted(got) == list(range(1, 13))
        got.update({int(h["lsn"]): b"".join(c) for h, c in cursor.frames(30)})
        assert got == frames  # the bytes the log holds, every record once
        assert list(cursor.frames(30)) == []  # at its end: nothing more
        cursor.seek(19)  # backwards: from the segment holding record 20
        assert [int(h["lsn"]) for h, _ in cursor.frames(22)] == [20, 21, 22]
        cursor.seek(25)  # forwards: records 23 to 25 skipped, bodies unread
        assert [int(h["lsn"]) for h, _ in cursor.frames(26)] == [26]
    finally:
        cursor.close()


def test_a_log_cursor_raises_for_a_record_the_log_does_not_hold(
    tmp_path: Path,
) -> None:
    from onnxps.server.durability._walread import LogCursor, WalGapError

    wal_dir, _ = _wal_with(tmp_path, 10, rotate_every=4)
    cursor = LogCursor(str(wal_dir), after=8)
    with pytest.raises(WalGapError, match=r"record 11 is not in the log .* up to 12"):
        list(cursor.frames(12))
    cursor.close()
    for seg in sorted(wal_dir.glob("*"))[:1]:
        seg.unlink()  # pruned after a snapshot
    with pytest.raises(WalGapError, match=r"record 2 is not in the log"):
        list(LogCursor(str(wal_dir), after=1).frames(3))


def test_a_standby_snapshot_holds_what_it_applied_not_what_it_logged(
    replicas: object,
    tmp_path: Path,
) -> None:
    """Found by the chaos test: a standby logs (and acknowledges) records before
    it applies them, and its snapshot said it covered every record logged: the
    pushes logged but not applied yet were in no snapshot and skipped by the
    restart's replay (acknowledged pushes lost). Now a standby's snapshot waits
    for the record being applied and covers what it applied, exactly."""
    from onnxps.server.durability import Durability
    from onnxps.server.replication._member import PrimaryInfo
    from onnxps.server.store import ParameterStore

    rs: ReplicaSet = replicas(1, extra=("--sync-replicas", "0"))  # type: ignore[operator]
    p = rs.primary()
    _create(rs.url, "a")
    _create(rs.url, "z")
    store = ParameterStore()
    root = str(tmp_path / "follower")
    durability = Durability(store, root, mode="wal")
    durability.open()
    follower = _follower(rs, durability)
    # as Replication does: a standby's snapshot covers what it applied
    durability.set_position(follower.held)
    g = np.full(SIZE, 0.5, np.float32)
    follower.start()
    try:
        follower.follow(PrimaryInfo(f"m{p}", rs.addresses[p], 1))
        deadline = time.monotonic() + 60
        while follower.applied < 2:  # both creates
            assert time.monotonic() < deadline, "the follower did not catch up"
            time.sleep(0.02)
        saved: list[Any] = []
        saver = threading.Thread(target=lambda: saved.append(durability.snapshot()))
        with follower.held():  # the applier stops at the next record
            with Client(rs.url, timeout=30) as c:
                assert c.push("z", g) == 1
                assert [c.push("a", g) for _ in range(3)] == [1, 2, 3]
            while follower.durable < 6:  # logged (and acknowledged) here
                assert time.monotonic() < deadline, "the pushes did not arrive"
                time.sleep(0.02)
            assert follower.applied == 2
            saver.start()  # before, it captured now: T=0 as of record 6
            saver.join(timeout=1.0)
        saver.join(timeout=30)
        while follower.applied < 6:
            assert time.monotonic() < deadline, "the pushes were not applied"
            time.sleep(0.02)
    finally:
        follower.stop()
        durability.close()
    # as a kill -9 right after that snapshot leaves it: no later one (close wrote one)
    assert saved and saved[0] is not None
    for later in Path(saved[0].path).parent.iterdir():
        if later.name > Path(saved[0].path).name:
            shutil.rmtree(later)
    # restarted on the same data directory: the snapshot, then the log after it
    again = ParameterStore()
    restarted = Durability(again, root, mode="wal")
    restarted.open()
    try:
        assert again.describe("z").update_count == 1
        assert again.describe("a").update_count == 3
    finally:
        restarted.close()
