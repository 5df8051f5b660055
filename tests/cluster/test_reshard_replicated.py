"""Resharding a cluster of replicated shards (docs/resharding.md): every shard a
primary and a synchronous standby. The moved groups' create records reach the
targets' standbys and the sources' deletes reach theirs: with the target's and a
source's primaries killed -9 after the resharding, the standbys that take over
serve the moved groups where the map says, and every push lands once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _reshard import EtcdCluster, Workers, check_against_replay
from onnxps.cli.reshard import reshard, reshard_status
from onnxps.client._discovery import Discovery

pytestmark = pytest.mark.slow

SHAPE = (8, 3, True, False)


def _primary_key(cluster: EtcdCluster, shard: int) -> Any:
    address = Discovery(cluster.url).primary(shard, time.monotonic() + 30)
    (key,) = [k for k, a in cluster.addresses.items() if a == address]
    return key


def _wait_new_primary(cluster: EtcdCluster, shard: int, old: str) -> None:
    end = time.monotonic() + 30
    discovery = Discovery(cluster.url)
    while discovery.primary(shard, time.monotonic() + 5) == old:
        assert time.monotonic() < end, f"shard {shard} kept its killed primary"
        time.sleep(0.1)


def test_resharding_replicated_shards_survives_primaries_killed_after_it(
    etcd_cluster: EtcdCluster, servers: Callable[..., Any]
) -> None:
    cluster = etcd_cluster
    cluster.start_shards(2, members=2, sync=1)
    names = cluster.create_groups(*SHAPE)
    with Workers(cluster, names) as workers:
        workers.wait_steps(40)
        cluster.start_shard(2, 3, members=2, sync=1)
        report = reshard(cluster.url, 3)
        assert report.moves and {m.target for m in report.moves} == {2}
        sources = {m.source for m in report.moves}
        workers.wait_steps(40)
        for shard in (2, min(sources)):
            victim = _primary_key(cluster, shard)
            old = cluster.addresses[victim]
            cluster.procs[victim].kill()  # SIGKILL: its standby takes over
            cluster.procs[victim].wait()
            # back as a standby (the new primary needs one to acknowledge)
            count = 3 if shard == 2 else 2
            cluster.start_member(shard, count, victim[1], sync=1)
            _wait_new_primary(cluster, shard, old)
        workers.wait_steps(40)
    assert not workers.errors, workers.errors
    check_against_replay(cluster, names, workers, servers(), SHAPE, shards=3)


def test_primaries_killed_during_a_resharding_and_it_goes_on(
    etcd_cluster: EtcdCluster, servers: Callable[..., Any]
) -> None:
    """The source's and the target's primaries killed -9 while ``reshard`` runs
    (after its first move): its calls follow the new primaries, a copy cut off is
    abandoned and made again, and every push lands once."""
    cluster = etcd_cluster
    shape = (16, 3, False, False)
    cluster.start_shards(2, members=2, sync=1)
    names = cluster.create_groups(*shape)
    with Workers(cluster, names) as workers:
        workers.wait_steps(40)
        cluster.start_shard(2, 3, members=2, sync=1)
        _wait_ready(cluster, 2)
        done: list[Any] = []
        tool = threading.Thread(
            target=lambda: done.append(reshard(cluster.url, 3, timeout=10))
        )
        tool.start()
        end = time.monotonic() + 60
        while not reshard_status(cluster.url).get("moved"):
            assert tool.is_alive() and time.monotonic() < end
            time.sleep(0.05)
        for shard, count in ((0, 2), (2, 3)):
            victim = _primary_key(cluster, shard)
            old = cluster.addresses[victim]
            cluster.procs[victim].kill()
            cluster.procs[victim].wait()
            cluster.start_member(shard, count, victim[1], sync=1)
            _wait_new_primary(cluster, shard, old)
        tool.join(timeout=120)
        assert done, "reshard did not finish"
        state = reshard_status(cluster.url)
        assert state["state"] == "complete" and state["moving"] == {}
        workers.wait_steps(40)
    assert not workers.errors, workers.errors
    check_against_replay(cluster, names, workers, servers(), shape, shards=3)


def _wait_ready(cluster: EtcdCluster, shard: int) -> None:
    """Until ``shard``'s primary has its synchronous standby (a create lands)."""
    end = time.monotonic() + 30
    while True:
        members = [m for m in Discovery(cluster.url).replicas(5)
                   if m["shard"] == shard]  # fmt: skip
        if any(m["sync"] for m in members):
            return
        assert time.monotonic() < end, members
        time.sleep(0.1)
