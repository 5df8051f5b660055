"""Who may follow a primary, and what a follower's acknowledgements count for
(issue 35, items 1 to 3), attacked as a tenant would: real etcd, real
``onnxps serve`` processes.

- Only a replica follows: ``Replicate`` needs the replication role (an admin token,
  even one for every prefix, is refused), and the hello must prove the member id
  with the lease of that member's key in etcd.
- An acknowledgement counts only for records shipped on that stream.
- Refused streams leave nothing behind: no memory, one log line.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _pki import Pki
from _procs import clean_env
from _replica_sets import G, Replicas, _create, _raw_push
from _replicas import SIZE
from onnxps.client import Adagrad
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

ADMIN_A = "adm-a-71c2e0"  # admin of tenant a/ only
ADMIN_ALL = "adm-all-5c1d9e"
REPLICATION = "rep-8b2f4a"


def _replicate(
    address: str,
    hello: pb.ReplicateHello,
    *,
    token: str | None = None,
    acks: tuple[int, ...] = (),
    timeout: float = 5.0,
    tls: dict[str, bytes] | None = None,
) -> tuple[grpc.StatusCode, str, list[str]]:
    """One Replicate stream: the hello, then ``acks``; (the status it ended with,
    its details, the kinds of the messages received)."""
    requests: queue.Queue[pb.ReplicateRequest | None] = queue.Queue()
    requests.put(pb.ReplicateRequest(hello=hello))
    for lsn in acks:
        requests.put(pb.ReplicateRequest(ack=pb.ReplicateAck(lsn=lsn)))

    def send() -> Iterator[pb.ReplicateRequest]:
        while (item := requests.get()) is not None:
            yield item

    got: list[str] = []
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    channel = (
        grpc.insecure_channel(address)
        if tls is None
        else grpc.secure_channel(address, grpc.ssl_channel_credentials(**tls))
    )
    with channel as ch:
        call: Any = pb_grpc.ParameterServerServiceStub(ch).Replicate(
            send(), timeout=timeout, metadata=metadata
        )
        try:
            for msg in call:
                got.append(str(msg.WhichOneof("part")))
        except grpc.RpcError as exc:
            REASONS.append(_reason(exc))
            return exc.code(), str(exc.details()), got
        finally:
            requests.put(None)
    return grpc.StatusCode.OK, "", got


def _reason(err: grpc.RpcError) -> str:
    """The refusal's reason (google.rpc ErrorInfo in the status details)."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return ""


REASONS: list[str] = []  # of the refusals _replicate met, in order


def _lease_of(rs: Replicas, member: str) -> int:
    got = rs.etcd.gateway().get(f"/ps/shards/0/members/{member}", metadata=True)
    assert got, f"member {member} is not registered"
    return int(got[0][1]["lease"])


def _term(rs: Replicas) -> int:
    primary = rs.key("primary")
    assert isinstance(primary, dict)
    return int(primary["term"])


def _one_push_acknowledged(
    replica_sets: Any, env: dict[str, str] | None = None
) -> tuple[Replicas, int, int]:
    """Two replicas, a group and one push acknowledged: (them, the primary, the
    synchronous standby)."""
    rs: Replicas = replica_sets(2) if env is None else replica_sets(2, env=env)
    p = rs.primary()
    s = 1 - p
    assert rs.wait_sync() == [f"m{s}"]
    _create(rs)
    with rs.connect() as c:
        assert c.push("g", G) == 1
    return rs, p, s


def _reached(rs: Replicas, i: int) -> int:
    """How many of the test's unacknowledged pushes replica ``i`` holds (0 to 4):
    its T once it settled, less the one acknowledged push."""
    deadline, seen = time.monotonic() + 30, -1
    while time.monotonic() < deadline:
        try:
            seen = rs.state(i, "g")[0]
        except Exception:  # noqa: BLE001 - promoting: not serving yet
            time.sleep(0.1)
            continue
        if seen >= 1:
            break
        time.sleep(0.1)
    assert 1 <= seen <= 5, f"replica {i} is at T={seen}"
    return seen - 1


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_an_admin_token_may_not_follow_a_primary(
    replica_sets: Any,
    tmp_path: Path,
) -> None:
    """An admin token confined to ``a/`` used to receive the primary's snapshot and
    log: every tenant's groups. Replicate is the replication role's alone."""
    tokens = tmp_path / "tokens"
    tokens.write_text(
        f"{ADMIN_A} admin a/\n{ADMIN_ALL} admin *\n{REPLICATION} replication *\n"
        "wr-3e9d1c write *\nrd-7a2b4f read *\n"
    )
    rs: Replicas = replica_sets(
        2,
        extra=("--tokens-file", str(tokens)),
        env={"ONNXPS_REPLICATION_TOKEN": REPLICATION},
        client={"token": ADMIN_ALL},
    )
    p = rs.primary()
    assert rs.wait_sync() == [f"m{1 - p}"]  # the standby follows with its token
    with rs.connect() as c:
        c.create_group(
            "b/secret", Adagrad(), learning_rate=0.1,
            tensors={"x": np.arange(SIZE, dtype=np.float32)},
        )  # fmt: skip
    hello = pb.ReplicateHello(
        member_id=f"m{1 - p}", term=_term(rs), address="127.0.0.1:9",
        lease=_lease_of(rs, f"m{1 - p}"), protocol=1,
    )  # fmt: skip
    for token, role in (
        (ADMIN_A, "admin"), (ADMIN_ALL, "admin"), ("wr-3e9d1c", "write"),
        ("rd-7a2b4f", "read"),
    ):  # fmt: skip
        code, details, got = _replicate(rs.addresses[p], hello, token=token)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert details == f"a {role} token may not call Replicate"
        assert got == []  # not one snapshot chunk, not one record
    code, details, got = _replicate(rs.addresses[p], hello, token="not-a-token")
    assert (code, got) == (grpc.StatusCode.UNAUTHENTICATED, [])
    # the real standby still follows and acknowledges
    with rs.connect() as c:
        assert c.push("b/secret", G) == 1
    rs.wait_t(1 - p, "b/secret", 1)


def test_a_replication_token_confined_to_a_prefix_is_refused_at_start(
    tmp_path: Path,
) -> None:
    """A replication token follows every group of the shard: a prefix on it would
    be a promise the server cannot keep, so the tokens file is refused."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN_ALL} admin *\n{REPLICATION} replication a/\n")
    done = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--address", "127.0.0.1:0",
         "--durability", "none", "--tokens-file", str(tokens)],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        "tokens file line 2: a replication token follows the whole shard (every "
        "group): give it the prefix '*'"
    ) in done.stderr


@pytest.mark.slow
def test_a_stream_that_cannot_prove_its_member_id_is_refused(
    replica_sets: Any,
) -> None:
    """The issue's attack: the synchronous standby frozen, a stream opened under its
    member id acknowledged lsn 2^63 and the primary acknowledged pushes no standby
    held, which the failover then lost. Without the member's lease the stream is
    refused; the pushes wait, none is acknowledged, and the failover loses none."""
    rs, p, s = _one_push_acknowledged(replica_sets)
    term = _term(rs)
    os.kill(rs.procs[s].pid, signal.SIGSTOP)
    try:
        for lease in (0, 7587891234567890):
            hello = pb.ReplicateHello(
                member_id=f"m{s}", term=term, address="127.0.0.1:9", lease=lease,
                protocol=1,
            )  # fmt: skip
            code, details, got = _replicate(
                rs.addresses[p], hello, acks=(1 << 63,), timeout=10
            )
            assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
            assert f"member m{s}" in details
            assert "only a replica of this shard follows its primary" in details
            assert REASONS[-1] == "STANDBY_NOT_MEMBER"
            assert got == []
        outcomes = [_raw_push(rs.addresses[p], seq, timeout=1.5)[0]
                    for seq in range(100, 104)]  # fmt: skip
        assert grpc.StatusCode.OK not in outcomes, outcomes
        rs.procs[p].kill()
        rs.procs[p].wait()
    finally:
        os.kill(rs.procs[s].pid, signal.SIGCONT)
    assert rs.primary(not_=p, timeout=60) == s
    # The pushes refused may have reached the standby (shipped to its socket before
    # it woke): applied or not, their callers were told nothing was acknowledged.
    rs.wait_t(s, "g", 1 + _reached(rs, s))


@pytest.mark.slow
def test_an_acknowledgement_beyond_what_was_shipped_ends_the_stream(
    replica_sets: Any,
) -> None:
    """Even under the member's own lease (read from etcd), a stream acknowledging
    a record it was not sent counts for nothing: the primary ends it, and no push
    is acknowledged on its word."""
    rs, p, s = _one_push_acknowledged(replica_sets)
    term, lease = _term(rs), _lease_of(rs, f"m{s}")
    os.kill(rs.procs[s].pid, signal.SIGSTOP)
    try:
        hello = pb.ReplicateHello(
            member_id=f"m{s}", term=term, address="127.0.0.1:9", lease=lease,
            protocol=1,
        )  # fmt: skip
        outcome: list[Any] = []
        pusher = threading.Thread(
            target=lambda: outcome.append(_raw_push(rs.addresses[p], 100, 4.0)[0])
        )
        code, details, _ = _replicate(
            rs.addresses[p], hello, acks=(1 << 63,), timeout=10
        )
        pusher.start()
        pusher.join(timeout=30)
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "the stream was not ended"
        line = rs.wait_log(p, f"standby m{s} acknowledged record {1 << 63}")
        assert "ending its stream (nothing it acknowledges counts)" in line
        assert outcome and outcome[0] != grpc.StatusCode.OK, outcome
        rs.procs[p].kill()
        rs.procs[p].wait()
    finally:
        os.kill(rs.procs[s].pid, signal.SIGCONT)
    assert rs.primary(not_=p, timeout=60) == s
    rs.wait_t(s, "g", 1 + _reached(rs, s))


@pytest.mark.slow
def test_refused_streams_leave_no_memory_and_one_log_line(
    replica_sets: Any,
) -> None:
    """300 streams with a 1 MiB member id took a primary from 203 to 1,122 MiB and
    grew its log by 600 MiB. Now: refused on the hello, logged once. (NumPy
    kernels: numba's, loaded in the background at start, would grow it meanwhile.)"""
    rs: Replicas = replica_sets(2, env={"ONNXPS_KERNELS": "numpy"})
    p = rs.primary()
    assert rs.wait_sync()
    pid = rs.procs[p].pid
    log_path = rs.tmp / f"server{p}-{rs.starts[p]}.log"
    before_rss, before_log = _rss_kib(pid), log_path.stat().st_size
    huge = "m" * (1 << 20)
    for _ in range(150):
        hello = pb.ReplicateHello(member_id=huge, term=1, address="a" * 1000)
        code, details, got = _replicate(rs.addresses[p], hello)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert details == (
            "ReplicateHello.member_id must be 1 to 128 characters of "
            "[A-Za-z0-9._:@-], the first a letter or a digit, got 1048576 characters"
        )
        assert REASONS[-1] == "BAD_MEMBER_ID"
        assert got == []
    for _ in range(50):
        hello = pb.ReplicateHello(member_id="ghost", term=1, address="127.0.0.1:9")
        code, details, got = _replicate(rs.addresses[p], hello)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert details.startswith("no member ghost is registered in this shard")
        assert REASONS[-1] == "STANDBY_NOT_MEMBER"
    grown_rss = (_rss_kib(pid) - before_rss) / 1024
    grown_log = log_path.stat().st_size - before_log
    assert grown_rss < 64, f"the primary grew {grown_rss:.0f} MiB"
    # one access-log line a call (about 150 bytes), the member id in none of them
    assert grown_log < 64 << 10, f"the primary's log grew {grown_log} bytes"
    text = log_path.read_text()
    assert max(len(line) for line in text.splitlines()) < 1000
    assert text.count("refused a Replicate stream under member id ghost") == 1
    assert text.count("refused a Replicate stream: bad member id") == 1
    # The bound and the characters, as docs/SECURITY.md gives them.
    for member_id in ("a" * 129, "m/1", "m 1", ".m1"):
        hello = pb.ReplicateHello(member_id=member_id, term=1, address="127.0.0.1:9")
        code, details, _ = _replicate(rs.addresses[p], hello)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (member_id, code, details)
        assert details.endswith(f"got {len(member_id)} characters")
        assert REASONS[-1] == "BAD_MEMBER_ID"
    for member_id in ("a" * 128, "A-z_0.9:@x"):
        hello = pb.ReplicateHello(member_id=member_id, term=1, address="127.0.0.1:9")
        code, details, _ = _replicate(rs.addresses[p], hello)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (member_id, code, details)
        assert REASONS[-1] == "STANDBY_NOT_MEMBER"
    # A member of another shard (its key and lease real, in shards/1) is no
    # member of this one: a replica of one shard does not follow another's primary.
    etcd = rs.etcd.gateway()
    lease = etcd.lease(ttl=30)
    etcd.put("/ps/shards/1/members/other", '{"address": "127.0.0.1:9"}', lease=lease)
    hello = pb.ReplicateHello(
        member_id="other", term=1, address="127.0.0.1:9", lease=int(lease.id)
    )
    code, details, got = _replicate(rs.addresses[p], hello)
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
    assert details.startswith("no member other is registered in this shard")
    assert REASONS[-1] == "STANDBY_NOT_MEMBER"
    assert got == []
    lease.revoke()
    # the real standby still follows
    _create(rs)
    with rs.connect() as c:
        assert c.push("g", G) == 1
    rs.wait_t(1 - p, "g", 1)


@pytest.mark.slow
def test_a_standby_whose_disk_filled_follows_again_once_there_is_room(
    replica_sets: Any,
    tmp_path: Path,
) -> None:
    """Issue 35 item 6: after ENOSPC the standby's log position was past the records
    it refused, so every resumed stream failed with 'record 9 is not after the last
    one, 9' for ever, tracebacks a few times a second, and the primary (its standby
    reconnecting at once) let every push burn its deadline. Now the standby forgets
    the refused records, stays away until its disk takes writes (the primary
    refuses at once meanwhile), then follows again by itself."""
    from _servers import _fill, _tmpfs

    rs: Replicas = replica_sets(2)
    p = rs.primary()
    s = 1 - p
    assert rs.wait_sync() == [f"m{s}"]
    with _tmpfs(tmp_path / "disk", "3m") as disk:
        rs.procs[s].kill()
        rs.procs[s].wait()
        rs.member_extra[s] = ("--data-dir", str(disk / "data"))
        rs.start(s)
        assert rs.wait_sync() == [f"m{s}"]
        _create(rs)
        with rs.connect() as c:
            assert [c.push("g", G) for _ in range(3)] == [1, 2, 3]
        rs.wait_t(s, "g", 3)
        filler = disk / "filler"
        assert _fill(filler) > 0
        # (the last page of the standby's log segment still takes a few records)
        for seq in range(100, 140):
            if _raw_push(rs.addresses[p], seq, timeout=3.0)[0] != grpc.StatusCode.OK:
                break
        else:
            raise AssertionError("the standby's full disk refused nothing")
        rs.wait_log(s, "this server's write-ahead log refused a record")
        # Away while its disk is full: the primary refuses at once, not at the
        # deadline (NOT_ENOUGH_REPLICAS, as for a missing standby), push after push.
        for seq in (200, 201, 202):
            start = time.monotonic()
            code, details, _ = _raw_push(rs.addresses[p], seq, timeout=10.0)
            took = time.monotonic() - start
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "0 of the 1 synchronous standbys" in details
            assert took < 3.0, f"refused after {took:.1f} s of a 10 s deadline"
        filler.unlink()
        with rs.connect(timeout=60) as c:
            t = c.push("g", G)
        assert t >= 4
        rs.wait_t(s, "g", t)
        np.testing.assert_array_equal(rs.state(s, "g")[1], rs.state(p, "g")[1])
        log = rs.log(s)
        assert "is not after the last one" not in log
        assert log.count("Traceback") == 0, log[-3000:]
        rs.procs[s].kill()
        rs.procs[s].wait()


@pytest.mark.slow
def test_over_mutual_tls_a_client_certificate_does_not_make_a_replica(
    replica_sets: Any,
    pki: Pki,
    tmp_path: Path,
) -> None:
    """TLS between replicas: a tenant's client certificate from the cluster's CA
    opens a TLS connection, and its admin token is still refused Replicate; the
    replication token itself, leaked, does not follow without a member's lease."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN_ALL} admin *\n{REPLICATION} replication *\n")
    rs: Replicas = replica_sets(
        2,
        extra=(*pki.flags(), "--tokens-file", str(tokens)),
        env={"ONNXPS_REPLICATION_TOKEN": REPLICATION},
        client={**pki.client(), "token": ADMIN_ALL},
    )
    p = rs.primary()
    assert rs.wait_sync() == [f"m{1 - p}"]  # the standby follows over TLS
    hello = pb.ReplicateHello(
        member_id=f"m{1 - p}", term=_term(rs), address="127.0.0.1:9", protocol=1
    )
    tls = pki.client()
    code, details, got = _replicate(rs.addresses[p], hello, token=ADMIN_ALL, tls=tls)
    assert (code, details, got) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "a admin token may not call Replicate",
        [],
    )
    code, details, got = _replicate(rs.addresses[p], hello, token=REPLICATION, tls=tls)
    assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
    assert f"the hello's lease (0) is not the one of member m{1 - p}" in details
    assert got == []
    with rs.connect() as c:
        c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": G})
        assert c.push("g", G) == 1
    rs.wait_t(1 - p, "g", 1)


def _silent_replicate(
    address: str, token: str, timeout: float
) -> tuple[grpc.StatusCode, str, str, float]:
    """A Replicate stream that never sends its hello: (its status, details, reason,
    seconds until it ended)."""
    stop = threading.Event()

    def nothing() -> Iterator[pb.ReplicateRequest]:
        stop.wait()  # sends nothing until the stream ended
        yield from ()

    start = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        call: Any = pb_grpc.ParameterServerServiceStub(ch).Replicate(
            nothing(), timeout=timeout, metadata=(("authorization", f"Bearer {token}"),)
        )
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return (
                exc.code(), str(exc.details()), _reason(exc), time.monotonic() - start
            )  # fmt: skip
        finally:
            stop.set()
    raise AssertionError("a Replicate stream with no hello was answered")


@pytest.mark.slow
def test_a_replicate_stream_that_never_says_hello_is_ended(
    replica_sets: Any,
    tmp_path: Path,
) -> None:
    """An idle Replicate stream is exempt from --stall-seconds (a primary with
    nothing to ship hears nothing from its standbys), but it used to be exempt
    before its hello too: streams that never sent one held a thread and a stream
    slot each until the client gave up (with no deadline: for ever), and with the
    slots taken the shard's real standby could not follow. Now the hello must come
    within --stall-seconds; after it the standby's stream stays, idle or not."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ADMIN_ALL} admin *\n{REPLICATION} replication *\n")
    rs: Replicas = replica_sets(
        2,
        extra=("--tokens-file", str(tokens), "--stall-seconds", "1"),
        env={"ONNXPS_REPLICATION_TOKEN": REPLICATION},
        client={"token": ADMIN_ALL},
    )
    p = rs.primary()
    assert rs.wait_sync() == [f"m{1 - p}"]
    ended: list[tuple[grpc.StatusCode, str, str, float]] = []
    silent = [
        threading.Thread(
            target=lambda: ended.append(
                _silent_replicate(rs.addresses[p], REPLICATION, 30.0)
            )
        )
        for _ in range(6)
    ]
    for t in silent:
        t.start()
    for t in silent:
        t.join(60)
    assert len(ended) == 6
    for code, details, reason, seconds in ended:
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
        assert details == (
            "the Replicate stream sent nothing for 1 s (--stall-seconds): the "
            "server ended it"
        )
        assert reason == ""  # ended from outside its handler: code and message only
        assert seconds < 15, f"ended after {seconds:.1f} s"
    # The real standby's stream, idle for several times --stall-seconds, still
    # follows: the push is acknowledged on the stream it had before.
    stopped = rs.log(p).count(f"standby m{1 - p} stopped following")
    time.sleep(3)
    _create(rs)
    with rs.connect() as c:
        assert c.push("g", G) == 1
    rs.wait_t(1 - p, "g", 1)
    assert rs.log(p).count(f"standby m{1 - p} stopped following") == stopped


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads")


def _cancelled_after_first(address: str, hello: pb.ReplicateHello) -> str:
    """A Replicate stream cancelled by its client once its first message came: the
    kind of that message."""
    stop = threading.Event()

    def send() -> Iterator[pb.ReplicateRequest]:
        yield pb.ReplicateRequest(hello=hello)
        stop.wait()

    with grpc.insecure_channel(address) as ch:
        call: Any = pb_grpc.ParameterServerServiceStub(ch).Replicate(send(), timeout=30)
        try:
            first = next(iter(call))
            return str(first.WhichOneof("part"))
        except grpc.RpcError as exc:
            # the member's real standby, following again, replaced this stream
            # before its first message (one live stream per member)
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise
            return "replaced"
        finally:
            call.cancel()
            stop.set()


@pytest.mark.slow
def test_a_members_streams_replace_each_other_and_leave_nothing_when_cancelled(
    replica_sets: Any,
) -> None:
    """One live stream per member: a second stream under a member's id and lease
    replaces the first (the real standby's stream ends, and it follows again once
    the other is gone). 300 such streams, each cancelled after its first message,
    leave the primary's threads, memory and table of standbys as they were (the
    issue's 300 cancelled streams took it from 203 to 1,122 MiB)."""
    rs, p, s = _one_push_acknowledged(replica_sets, env={"ONNXPS_KERNELS": "numpy"})
    rs.wait_t(s, "g", 1)
    pid = rs.procs[p].pid
    hello = pb.ReplicateHello(
        member_id=f"m{s}", term=_term(rs), address="127.0.0.1:9",
        lease=_lease_of(rs, f"m{s}"), protocol=1,
    )  # fmt: skip
    ended = rs.log(p).count(f"standby m{s} stopped following")
    assert _cancelled_after_first(rs.addresses[p], hello) == "snapshot_chunk"
    rs.wait_log(p, f"standby m{s} stopped following")  # (both streams' lines)
    deadline = time.monotonic() + 30
    while rs.log(p).count(f"standby m{s} stopped following") < ended + 2:
        assert time.monotonic() < deadline, "the first stream was not replaced"
        time.sleep(0.1)
    threads, rss = _threads(pid), _rss_kib(pid)
    kinds = [_cancelled_after_first(rs.addresses[p], hello) for _ in range(300)]
    # each got the primary's snapshot, unless the real standby's stream replaced it
    # first (it follows again at once, racing these): never anything else
    assert set(kinds) <= {"snapshot_chunk", "replaced"}, set(kinds)
    assert kinds.count("snapshot_chunk") >= 150, kinds.count("replaced")
    # The real standby follows again, and is the only standby the primary keeps.
    with rs.connect(timeout=60) as c:
        assert c.push("g", G) == 2
    rs.wait_t(s, "g", 2)
    grown = (_rss_kib(pid) - rss) / 1024
    assert grown < 32, f"the primary grew {grown:.0f} MiB"
    deadline = time.monotonic() + 10
    while _threads(pid) > threads + 2:
        assert time.monotonic() < deadline, f"threads {threads} -> {_threads(pid)}"
        time.sleep(0.1)
    # (the primary publishes the standbys it follows at its next registration)
    deadline = time.monotonic() + 10
    while not (
        isinstance(key := rs.key(f"members/m{p}"), dict)
        and list(key["standbys"]) == [f"m{s}"]
    ):
        assert time.monotonic() < deadline, key
        time.sleep(0.1)
