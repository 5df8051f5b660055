"""Replicated shards under partitions and with TLS (issue 23): real etcd, real
``onnxps serve`` processes, real ``iptables`` rules on loopback.

A partition is a DROP rule in the OUTPUT chain for one port, matched on one
process's group (``-m owner --gid-owner``: the standby runs as root with group
65534, so it still reads a checkout in a 0700 directory) or on the one etcd port
that only the primary uses. Every rule is removed when the test ends, passed or
failed. Without root or iptables those tests are skipped.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _etcd import EtcdProcess
from _pki import Pki
from _replica_sets import G, Replicas, _create, _raw_push
from _replicas import SIZE, TTL, _serial
from onnxps.client import Adagrad, UnavailableError
from onnxps.server.app import ServerConfig, create_server

NOGROUP = 65534


# -- partitions ------------------------------------------------------------------
def _iptables_works() -> bool:
    if shutil.which("iptables") is None:
        return False
    probe = subprocess.run(
        ["iptables", "-w", "5", "-S", "OUTPUT"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


needs_iptables = pytest.mark.skipif(
    not _iptables_works(), reason="partitions need iptables and root (CAP_NET_ADMIN)"
)


@contextlib.contextmanager
def partition(*rule: str) -> Iterator[None]:
    """``iptables -I OUTPUT RULE -j DROP`` until the block ends (however it ends)."""
    spec = ["OUTPUT", *rule, "-j", "DROP"]
    subprocess.run(["iptables", "-w", "5", "-I", *spec], check=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-w", "5", "-D", *spec], check=True, timeout=30)


def _port(address: str) -> str:
    return address.rsplit(":", 1)[1]


@needs_iptables
@pytest.mark.slow
def test_a_partition_between_the_primary_and_its_standby_refuses_then_heals(
    replica_sets: Any,
) -> None:
    rs: Replicas = replica_sets(1)
    assert rs.primary() == 0
    rs.gids[1] = NOGROUP  # the standby's packets are the ones the rule matches
    rs.start(1)
    assert rs.wait_sync() == ["m1"]
    _create(rs)
    with rs.connect() as c:
        assert [c.push("g", G) for _ in range(3)] == [1, 2, 3]
    rs.wait_t(1, "g", 3)
    primary = rs.addresses[0]
    cut = ("-p", "tcp", "-d", "127.0.0.1", "--dport", _port(primary))
    with partition(*cut, "-m", "owner", "--gid-owner", str(NOGROUP)):
        # Logged and shipped, but the standby's acknowledgement never arrives: the
        # push is not acknowledged within its deadline (it waits for the standby).
        code, _, _ = _raw_push(primary, seq=1, timeout=10)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        # After --lease-ttl * 3 (at least 5 s) without an acknowledgement the
        # primary ends the standby's stream; with none left following it refuses
        # the next change before logging it.
        rs.wait_log(0, "standby m1 did not acknowledge record")
        code, details, _ = _raw_push(primary, seq=2, timeout=10)
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details.startswith(
            "0 of the 1 synchronous standbys this shard needs (--sync-replicas) "
            "follow its primary: the change is refused"
        ), details
        # The timed-out push was logged: once its caller left it is applied here
        # (memory is the log's replay), unacknowledged; the refused one never was.
        rs.wait_t(0, "g", 4, timeout=15)
        assert rs.procs[0].poll() is None  # still the primary: no failover
    # Healed: the standby follows again, holds the waiting push, which is then
    # acknowledged (applied once, at T=4), and pushes are acknowledged again.
    with rs.connect(timeout=90) as c:
        assert c.push("g", G * 2) == 5
    code, _, again = _raw_push(primary, seq=1, timeout=30)  # the resend is answered
    assert (code, again.update_count, again.duplicate) == (grpc.StatusCode.OK, 4, True)
    rs.wait_t(1, "g", 5)
    info = rs.key("primary")
    assert isinstance(info, dict) and (info["member"], info["term"]) == ("m0", 1)
    x0, x1 = rs.state(0, "g")[1], rs.state(1, "g")[1]
    np.testing.assert_array_equal(x0, x1)
    np.testing.assert_array_equal(x0, _serial([G, G, G, G, G * 2]))


@needs_iptables
@pytest.mark.slow
def test_a_partitioned_synchronous_standby_is_replaced_by_a_caught_up_one(
    replica_sets: Any,
) -> None:
    rs: Replicas = replica_sets(1)
    assert rs.primary() == 0
    rs.gids[1] = NOGROUP
    rs.start(1)
    assert rs.wait_sync() == ["m1"]
    rs.start(2)  # follows too, not synchronous: one place (--sync-replicas 1)
    _create(rs)
    with rs.connect() as c:
        assert [c.push("g", G) for _ in range(3)] == [1, 2, 3]
    rs.wait_t(2, "g", 3)
    primary = rs.addresses[0]
    cut = ("-p", "tcp", "-d", "127.0.0.1", "--dport", _port(primary))
    with partition(*cut, "-m", "owner", "--gid-owner", str(NOGROUP)):
        # m1 is silent: its stream ends and m2, which holds every acknowledged push
        # and this one, is named in its place; the push is acknowledged.
        code, details, reply = _raw_push(primary, seq=1, timeout=60)
        assert (code, details) == (grpc.StatusCode.OK, "")
        assert (reply.update_count, reply.applied) == (4, True)
        sync = rs.key("sync")
        assert isinstance(sync, dict)
        assert {k: sync[k] for k in ("primary", "term", "standbys")} == {
            "primary": "m0", "term": 1, "standbys": ["m2"],
        }  # fmt: skip
        # named with its data dir, and the primary with its own
        assert sorted(sync["instances"]) == ["m0", "m2"]
        assert all(sync["instances"].values())
        with rs.connect() as c:
            assert c.push("g", G) == 5
    rs.wait_t(1, "g", 5)  # healed: m1 follows again
    info = rs.key("primary")
    assert isinstance(info, dict) and (info["member"], info["term"]) == ("m0", 1)
    xs = [rs.state(i, "g")[1] for i in range(3)]
    for x in xs:
        np.testing.assert_array_equal(x, _serial([G] * 5))


@needs_iptables
@pytest.mark.slow
def test_a_primary_cut_from_etcd_stops_acknowledging_before_another_is_elected(
    replica_sets: Any,
    etcd_server: EtcdProcess,
    tmp_path: Path,
) -> None:
    from _etcd import free_port
    from _replicas import _acked, _replay, _wait_acked, _workers
    from workers.replica_pusher import gradient

    # A second client port that only the first server (the primary) uses: cutting
    # it cuts the primary from etcd and nothing else.
    etcd_server.stop()
    etcd_server.extra_client_ports = (free_port(),)
    etcd_server.start()
    own = f"etcd://127.0.0.1:{etcd_server.extra_client_ports[0]}/ps"
    # TTL 9: renewed every 3 s, no acknowledgement 6 s after the last renewal,
    # the lease expires after 9 s: 3 s between the fence and an election.
    rs: Replicas = replica_sets(0, ttl=9)
    rs.coordinators[0] = own
    rs.start(0)
    assert rs.primary() == 0
    rs.start(1)
    rs.start(2)
    rs.wait_sync()
    _create(rs)
    out = tmp_path / "acked.jsonl"
    workers, count = 4, 40
    procs = _workers(rs.url, workers, count, out)
    probes: list[dict[str, int]] = []
    try:
        _wait_acked(out, 40, procs)
        for w in procs:  # no push in flight on the old primary when it is cut
            w.send_signal(signal.SIGSTOP)
        with partition(
            "-p",
            "tcp",
            "-d",
            "127.0.0.1",
            "--dport",
            str(etcd_server.extra_client_ports[0]),
        ):
            # Pushes go on until the primary fences itself off.
            code, details, reply = grpc.StatusCode.OK, "", None
            for k in range(600):  # at most about 60 s
                code, details, reply = _raw_push(
                    rs.addresses[0], 1 + k, 5, gradient(9, k, SIZE)
                )
                if code != grpc.StatusCode.OK:
                    break
                probes.append({"w": 9, "k": k, "t": reply.update_count})
                time.sleep(0.1)
            # Its key still names it (the lease has not expired): only its own
            # clock stopped it, before etcd could elect another primary.
            info = rs.key("primary")
            assert isinstance(info, dict) and (info["member"], info["term"]) == (
                "m0", 1,
            ), info  # fmt: skip
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                assert details.startswith(
                    "this server is not the primary of shard 0/1 that may "
                    "acknowledge: no primary is known"
                ), details
                unknown = None
            else:  # a probe in flight at the fence: the primary exits
                assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
                assert rs.procs[0].wait(timeout=30) == 75
                unknown = len(probes)
            new = rs.primary(not_=0, timeout=60)
            rs.wait_sync()
            for w in procs:
                w.send_signal(signal.SIGCONT)
            with rs.connect(timeout=60) as c:  # a client of etcd finds it
                c.describe_group("g")
                assert c.address == rs.addresses[new]
            _wait_acked(out, 80, procs)
        # Healed: the old primary learns its lease expired and exits (status 75),
        # restarted it follows the new primary.
        assert rs.procs[0].wait(timeout=60) == 75
        rs.start(0)
        for w in procs:
            assert w.wait(timeout=180) == 0, out.with_suffix(".w0.err").read_text()
    finally:
        for w in procs:
            if w.poll() is None:
                w.send_signal(signal.SIGCONT)
                w.kill()
                w.wait()
    if unknown is not None:  # its outcome: resent, applied once or answered
        code, _, reply = _raw_push(
            rs.addresses[new], 1 + unknown, 30, gradient(9, unknown, SIZE)
        )
        assert code == grpc.StatusCode.OK
        probes.append({"w": 9, "k": unknown, "t": reply.update_count})
    records = _acked(out) + probes
    total = workers * count + len(probes)
    assert sorted(r["t"] for r in records) == list(range(1, total + 1))
    for i in rs.procs:
        rs.wait_t(i, "g", total)
    xs = [rs.state(i, "g")[1] for i in rs.procs]
    for x in xs[1:]:
        np.testing.assert_array_equal(x, xs[0])
    np.testing.assert_array_equal(xs[0], _replay(records))


# -- TLS between standby and primary -----------------------------------------------
@pytest.mark.slow
def test_a_replica_set_with_mutual_tls_replicates_and_fails_over(
    replica_sets: Any,
    pki: Pki,
) -> None:
    rs: Replicas = replica_sets(2, extra=pki.flags(), client=pki.client())
    p = rs.primary()
    # Named synchronous once it acknowledged the primary's snapshot: over TLS,
    # with its own certificate as its client certificate.
    assert rs.wait_sync() == [f"m{1 - p}"]
    _create(rs)
    with rs.connect(timeout=60) as c:
        assert [c.push("g", G) for _ in range(3)] == [1, 2, 3]
        rs.procs[p].kill()
        rs.procs[p].wait()
        assert rs.primary(not_=p) == 1 - p
        rs.start(p)  # follows the new primary, over TLS too
        assert rs.wait_sync() == [f"m{p}"]
        assert c.push("g", G) == 4
        assert c.address == rs.addresses[1 - p]
    rs.wait_t(p, "g", 4)
    np.testing.assert_array_equal(rs.state(p, "g")[1], rs.state(1 - p, "g")[1])
    np.testing.assert_array_equal(rs.state(p, "g")[1], _serial([G] * 4))


@pytest.mark.slow
@pytest.mark.parametrize("credentials", ["rogue certificate", "unknown token"])
def test_a_standby_without_valid_credentials_is_refused_by_its_primary(
    replica_sets: Any,
    pki: Pki,
    tmp_path: Path,
    credentials: str,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("adm-5c1d9e admin *\nrep-8b2f4a replication *\n")
    rs: Replicas = replica_sets(
        1,
        extra=(*pki.flags(), "--tokens-file", str(tokens)),
        env={"ONNXPS_REPLICATION_TOKEN": "rep-8b2f4a"},
        client={**pki.client(), "token": "adm-5c1d9e"},
    )
    assert rs.primary() == 0
    if credentials == "rogue certificate":
        # Its certificate chains to another CA: the primary ends the handshake.
        rs.member_extra[1] = pki.flags(pki.rogue_cert, pki.rogue_key)
        expected = f"following {rs.addresses[0]}: UNAVAILABLE: "
    else:
        rs.env = {"ONNXPS_REPLICATION_TOKEN": "rep-forged"}
        expected = (
            f"following {rs.addresses[0]}: UNAUTHENTICATED: Replicate: the token is "
            "not known to this server"
        )
    rs.start(1)
    line = rs.wait_log(1, f"following {rs.addresses[0]}: ")
    assert expected in line, line
    if credentials == "rogue certificate":
        rs.wait_log(0, "CERTIFICATE_VERIFY_FAILED")  # gRPC's log of the handshake
    sync = rs.key("sync")
    assert isinstance(sync, dict) and sync["standbys"] == []
    # No standby follows: changes are refused before anything is logged.
    with rs.connect(0, timeout=5) as c:
        with pytest.raises(UnavailableError) as err:
            c.create_group("g", Adagrad(), learning_rate=0.1, tensors={"x": G})
    assert err.value.reason == "NOT_ENOUGH_REPLICAS"
    # The same standby with valid credentials follows.
    rs.procs[1].kill()
    rs.procs[1].wait()
    rs.member_extra[1] = ()
    rs.env = {"ONNXPS_REPLICATION_TOKEN": "rep-8b2f4a"}
    rs.start(1)
    assert rs.wait_sync() == ["m1"]


def test_tls_ca_without_tls_on_the_server_is_refused(tmp_path: Path) -> None:
    from onnxps.server.interceptors.security import ConfigError

    with pytest.raises(ConfigError) as err:
        create_server(
            ServerConfig(
                address="127.0.0.1:0", durability="none", tls_ca=str(tmp_path / "ca")
            )
        )
    assert str(err.value) == (
        "--tls-ca is the CA a standby checks its primary's certificate against: a "
        "replica set's servers serve TLS, so pass --tls-cert and --tls-key too"
    )


# -- a standby named synchronous holds every acknowledged push --------------------
@pytest.mark.slow
def test_a_new_primary_names_a_standby_only_once_it_holds_the_earlier_terms_log(
    replica_sets: Any,
) -> None:
    """A promoted primary holds records that earlier terms acknowledged: a standby
    that has acknowledged only the snapshot before them must not be named
    synchronous (it could be promoted next and lose them). The standby here is the
    test itself, speaking the Replicate protocol."""
    import queue
    import threading

    from onnxps.v1 import parameter_server_pb2 as pb
    from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

    rs: Replicas = replica_sets(2)
    p = rs.primary()
    assert rs.wait_sync() == [f"m{1 - p}"]
    _create(rs)
    with rs.connect() as c:
        assert [c.push("g", G) for _ in range(3)] == [1, 2, 3]
    rs.procs[p].kill()
    rs.procs[p].wait()
    new = rs.primary(not_=p)  # holds lsn 1..4 (the create, 3 pushes), term 2
    acks: queue.Queue[pb.ReplicateRequest | None] = queue.Queue()
    # A member registers in etcd, and its hello proves it with its key's lease.
    etcd = rs.etcd.gateway()
    lease = etcd.lease(30)
    etcd.put("/ps/shards/0/members/m9", '{"address": "127.0.0.1:9"}', lease=lease)
    hello = pb.ReplicateHello(
        member_id="m9", term=2, address="127.0.0.1:9", lease=lease.id
    )
    acks.put(pb.ReplicateRequest(hello=hello))

    def requests() -> Iterator[pb.ReplicateRequest]:
        while (item := acks.get()) is not None:
            yield item

    records: list[int] = []
    done = threading.Event()
    with grpc.insecure_channel(rs.addresses[new]) as ch:
        call: Any = pb_grpc.ParameterServerServiceStub(ch).Replicate(requests())

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled at the end
                for msg in call:
                    part = msg.WhichOneof("part")
                    if part == "snapshot_done":
                        records.append(msg.snapshot_done.wal_lsn)
                        done.set()
                    elif part == "record":
                        records.append(msg.record.lsn)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            assert done.wait(30)
            acks.put(pb.ReplicateRequest(ack=pb.ReplicateAck(lsn=0)))
            deadline = time.monotonic() + 3 * TTL  # it would be named at once
            while time.monotonic() < deadline:
                sync = rs.key("sync")
                assert isinstance(sync, dict) and sync["standbys"] == [], sync
                time.sleep(0.05)
            # Holding everything the new primary held: named.
            acks.put(pb.ReplicateRequest(ack=pb.ReplicateAck(lsn=4)))
            assert rs.wait_sync(timeout=30) == ["m9"]
        finally:
            call.cancel()
            acks.put(None)
            reader.join(timeout=10)
    assert records[:5] == [0, 1, 2, 3, 4]  # the snapshot (wal lsn 0), the log


@pytest.mark.slow
def test_an_idle_replica_set_keeps_its_standbys_streams(replica_sets: Any) -> None:
    """No change for longer than --stall-seconds: no acknowledgement comes, and the
    standby's stream stays (it used to be ended, the standby starting again from a
    snapshot every --stall-seconds)."""
    rs: Replicas = replica_sets(2, extra=("--stall-seconds", "1"))
    p = rs.primary()
    assert rs.wait_sync() == [f"m{1 - p}"]
    _create(rs)
    with rs.connect() as c:
        assert c.push("g", G) == 1
    time.sleep(4)  # idle for four times --stall-seconds
    with rs.connect() as c:
        assert c.push("g", G) == 2
    rs.wait_t(1 - p, "g", 2)
    assert "sent nothing" not in rs.log(1 - p)
    assert rs.log(p).count(f"standby m{1 - p} (") == 1  # one snapshot sent
