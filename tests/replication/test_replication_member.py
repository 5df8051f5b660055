"""A replica set member's identity in etcd: a second process started with a member
id a live process holds is refused (its key is not overwritten); a member killed
and restarted at once with its data dir takes its id back. Real etcd, real
``onnxps serve`` processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs import clean_env, stop
from _replicas import SIZE, TTL, ReplicaSet, _kill
from onnxps.cli.process import wait_for_listening
from onnxps.client import Client, OnnxpsError, UnavailableError


def _serve(rs: ReplicaSet, member: str, data: Path, log: Path) -> Any:
    """``onnxps serve`` as member ``member`` of shard 0/1, not waited for."""
    cmd = [
        sys.executable, "-m", "onnxps.cli", "serve",
        "--address", "127.0.0.1:0",
        "--durability", "wal",
        "--data-dir", str(data),
        "--coordinator", rs.url,
        "--shard", "0/1",
        "--member-id", member,
        "--lease-ttl", str(TTL),
    ]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=clean_env()
        )


@pytest.mark.slow
def test_a_second_process_with_a_live_member_id_is_refused(
    replicas: Any,
    tmp_path: Path,
) -> None:
    rs: ReplicaSet = replicas(2)
    p = rs.primary_with_group()
    s = 1 - p
    held = rs.key(f"members/m{s}")
    assert isinstance(held, dict) and held["address"] == rs.addresses[s]
    log = tmp_path / "duplicate.log"
    dup = _serve(rs, f"m{s}", tmp_path / "duplicate-data", log)
    seen = []  # the addresses the member key named meanwhile
    try:
        deadline = time.monotonic() + 4 * TTL + 20
        while dup.poll() is None and time.monotonic() < deadline:
            key = rs.key(f"members/m{s}")
            seen.append(key["address"] if isinstance(key, dict) else None)
            time.sleep(0.1)
        code = dup.poll()
    finally:
        stop(dup)
    text = log.read_text(errors="replace")
    assert set(seen) == {rs.addresses[s]}, f"the key was taken: {set(seen)}\n{text}"
    assert code == 2, f"exit status {code}:\n{text[-3000:]}"
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"onnxps: member id m{s} of shard 0/1 under {rs.url}"), last
    assert "--member-id" in last
    # The real member goes on: it is still the synchronous standby.
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", g) == 1
    rs.wait_t(s, "g", 1)
    # Killed and restarted at once with its data dir (its lease still alive), it
    # takes its member id back without waiting for the lease to expire.
    _kill(rs, s)
    started = time.monotonic()
    rs.start(s)
    deadline = started + 20
    while True:
        key = rs.key(f"members/m{s}")
        if isinstance(key, dict) and key["address"] == rs.addresses[s]:
            break
        assert time.monotonic() < deadline, f"m{s} did not register again: {key}"
        time.sleep(0.05)
    took = time.monotonic() - started
    assert took < 15, took
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", g) == 2  # it follows (the push needs its ack)
    rs.wait_t(s, "g", 2)
    # Killed, and replaced at once by a server with another data dir: the new one
    # waits for the old process's lease to expire, then takes the member id. The
    # old process runs with a lease of 8 s here, so that its lease outlives the
    # replacement's start however loaded the machine is (with 2 s it could be gone
    # before the replacement looks, and no wait would be seen).
    rs.extra = ("--lease-ttl", "8")
    _kill(rs, s)
    rs.start(s)
    with Client(rs.url, timeout=30) as c:
        assert c.push("g", g) == 3  # it follows again (the push needs its ack)
    rs.wait_t(s, "g", 3)
    gateway = rs.etcd.gateway()
    key = f"/{rs.prefix}/shards/0/members/m{s}"
    [(_, meta)] = gateway.get(key, metadata=True)
    old_lease = int(meta["lease"])
    _kill(rs, s)
    log = tmp_path / "replacement.log"
    new = _serve(rs, f"m{s}", tmp_path / "replacement-data", log)
    try:
        address = wait_for_listening(new, log)
        deadline = time.monotonic() + 30
        while True:
            held = rs.key(f"members/m{s}")
            if isinstance(held, dict) and held["address"] == address:
                break
            assert time.monotonic() < deadline, f"not taken over: {held}"
            time.sleep(0.05)
        # taken only once the old process's lease was gone
        # (etcd3gw's Lease.ttl posts to a path etcd 3.4+ does not serve)
        ttl = gateway.post(gateway.get_url("/lease/timetolive"), json={"ID": old_lease})
        assert int(ttl["TTL"]) == -1, ttl
        assert "waiting up to" in log.read_text()
        # It follows the primary from its empty data dir; named synchronous (with
        # its data dir) once it holds every acknowledged push, it acknowledges
        # the next one, and is promoted with all of them when the primary dies.
        instance = (tmp_path / "replacement-data" / "member-instance").read_text()
        with Client(rs.url, timeout=60) as c:
            assert c.push("g", g) == 4
        sync = rs.key("sync")
        assert isinstance(sync, dict) and sync["standbys"] == [f"m{s}"], sync
        assert sync["instances"][f"m{s}"] == instance.strip(), sync
        _kill(rs, p)
        deadline = time.monotonic() + 30
        while not (
            isinstance(lead := rs.key("primary"), dict) and lead["address"] == address
        ):
            assert time.monotonic() < deadline, f"not promoted: {lead}"
            time.sleep(0.05)
        with Client(address, timeout=30) as c:
            deadline = time.monotonic() + 60
            while True:  # it answers once it applied what it received
                try:
                    assert c.describe_group("g").update_count == 4
                    break
                except UnavailableError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
    finally:
        stop(new)


@pytest.mark.parametrize("member", [".m1", "m 1", "replica/0", "m" * 129])
def test_a_member_id_no_primary_would_accept_is_refused_at_start(
    etcd_server: Any,
    tmp_path: Path,
    member: str,
) -> None:
    """A primary refuses a hello whose member id is not 1 to 128 characters of
    [A-Za-z0-9._:@-] starting with a letter or a digit (docs/SECURITY.md): a
    standby started with such a --member-id used to start, register, and be
    refused by its primary on every attempt, for ever. It is refused at start."""
    done = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--address", "127.0.0.1:0",
         "--durability", "wal", "--data-dir", str(tmp_path / "data"),
         "--coordinator", etcd_server.url("ps"), "--shard", "0/1",
         "--member-id", member],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert (
        "--member-id must be 1 to 128 characters of [A-Za-z0-9._:@-], the first a "
        "letter or a digit (a primary refuses any other in a standby's hello), got "
        f"{member!r}"
    ) in done.stderr, done.stderr[-2000:]
    assert etcd_server.gateway().get_prefix("/ps/shards/0/members/") == []


@pytest.mark.slow
def test_a_member_id_on_another_data_dir_does_not_take_the_lead_without_the_data(
    replicas: Any,
    tmp_path: Path,
) -> None:
    """The synchronous standby's data dir is lost (its process killed, a new one
    started under its member id on an empty data dir, as an operator replacing a
    broken disk does) while the primary is down: the new process is named in
    etcd's ``sync`` by member id, but it does not hold what the old one
    acknowledged, so it must not take the lead. The primary, back with its data
    dir, takes it; the new standby follows it and gets every push."""
    rs: ReplicaSet = replicas(2)
    p = rs.primary_with_group()
    s = 1 - p
    g = np.full(SIZE, 0.5, np.float32)
    with Client(rs.url, timeout=30) as c:
        assert [c.push("g", g) for _ in range(3)] == [1, 2, 3]
    rs.wait_t(s, "g", 3)
    sync = rs.key("sync")
    assert isinstance(sync, dict) and sync["standbys"] == [f"m{s}"], sync
    _kill(rs, s)
    _kill(rs, p)
    # both members' keys go with their leases
    deadline = time.monotonic() + 4 * TTL + 10
    while rs.key(f"members/m{s}") is not None or rs.key("primary") is not None:
        assert time.monotonic() < deadline, "the killed members' keys stayed"
        time.sleep(0.1)
    log = tmp_path / "replacement.log"
    new = _serve(rs, f"m{s}", tmp_path / "replacement-data", log)
    try:
        address = wait_for_listening(new, log)
        # registered under the member id (the old process's lease is gone) ...
        deadline = time.monotonic() + 20
        while not isinstance(held := rs.key(f"members/m{s}"), dict):
            assert time.monotonic() < deadline, "the replacement did not register"
            time.sleep(0.05)
        assert held["address"] == address
        # ... but it does not campaign: for 5 lease TTLs, no primary
        for _ in range(int(5 * TTL / 0.1)):
            primary = rs.key("primary")
            assert primary is None, (
                f"took the lead with no data: {primary}\n" + (log.read_text()[-2000:])
            )
            time.sleep(0.1)
        # the primary comes back with its data dir and leads; the new process
        # follows it (a snapshot) and holds every push
        rs.start(p)
        assert rs.primary() == p
        with Client(address, timeout=30) as c:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if c.describe_group("g").update_count == 3:
                        break
                except OnnxpsError:
                    pass
                assert time.monotonic() < deadline, "the replacement did not catch up"
                time.sleep(0.1)
        assert rs.state(p, "g")[0] == 3
        with Client(rs.url, timeout=30) as c:
            assert c.push("g", g) == 4  # acknowledged: a standby follows again
    finally:
        stop(new)


@pytest.mark.slow
def test_a_member_whose_id_was_taken_while_it_was_frozen_exits(
    replicas: Any,
    tmp_path: Path,
) -> None:
    """A standby frozen (SIGSTOP) past its lease, whose member id another process
    (another data dir) took meanwhile, exits with status 75 when it runs again,
    saying so, instead of writing the key back: one process per member id."""
    rs: ReplicaSet = replicas(2)
    p = rs.primary_with_group()
    s = 1 - p
    os.kill(rs.procs[s].pid, signal.SIGSTOP)
    log = tmp_path / "replacement.log"
    new = _serve(rs, f"m{s}", tmp_path / "replacement-data", log)
    try:
        address = wait_for_listening(new, log)
        deadline = time.monotonic() + 30
        while not (
            isinstance(held := rs.key(f"members/m{s}"), dict)
            and held["address"] == address
        ):
            assert time.monotonic() < deadline, f"not taken over: {held}"
            time.sleep(0.05)
        os.kill(rs.procs[s].pid, signal.SIGCONT)
        assert rs.procs[s].wait(timeout=30) == 75
        text = (tmp_path / f"server{s}-1.log").read_text()
        assert f"member id m{s} was taken by the process at {address}" in text
        held = rs.key(f"members/m{s}")
        assert isinstance(held, dict) and held["address"] == address
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rs.procs[s].pid, signal.SIGCONT)
        stop(new)
