"""A replica set member's identity in etcd: a second process started with a member
id a live process holds is refused (its key is not overwritten); a member killed
and restarted at once with its data dir takes its id back. Real etcd, real
``onnxps serve`` processes.
"""

from __future__ import annotations

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
from onnxps.client import Client


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
    # waits for the old process's lease to expire (longer than its own lease
    # lives unrenewed), then takes the member id.
    _kill(rs, s)
    log = tmp_path / "replacement.log"
    new = _serve(rs, f"m{s}", tmp_path / "replacement-data", log)
    try:
        address = wait_for_listening(new, log)
        deadline = time.monotonic() + 20
        while True:
            key = rs.key(f"members/m{s}")
            if isinstance(key, dict) and key["address"] == address:
                break
            assert time.monotonic() < deadline, f"not taken over: {key}"
            time.sleep(0.05)
        assert "waiting up to" in log.read_text()
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
