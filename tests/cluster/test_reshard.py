"""Live resharding (docs/resharding.md): a cluster found through etcd grows from 2 to
3 shards and shrinks back to 2 while 4 workers push to 20 groups (14 whole, 4 split,
an ids table, a sync group), and every acknowledged push is applied exactly once;
the tool killed -9 mid-way resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from _procs import clean_env
from _reshard import EtcdCluster, Workers, check_against_replay
from onnxps.cli.reshard import ReshardError, reshard, reshard_status
from onnxps.client import Client

pytestmark = pytest.mark.slow

# plain groups, split groups, an ids table, a sync group: 20 groups
SHAPE = (14, 4, True, True)


def test_grow_2_to_3_and_shrink_back_under_4_workers(
    etcd_cluster: EtcdCluster, servers: Callable[..., Any]
) -> None:
    cluster = etcd_cluster
    cluster.start_shards(2)
    names = cluster.create_groups(*SHAPE)
    with Workers(cluster, names) as workers:
        workers.wait_steps(100)
        cluster.start(2, 3)
        grown = reshard(cluster.url, 3)
        assert grown.from_shards == 2 and grown.to_shards == 3
        assert grown.moves, "growing to 3 shards moves some groups"
        assert all(m.target == 2 for m in grown.moves)
        workers.wait_steps(100)
        shrunk = reshard(cluster.url, 2)
        assert {m.source for m in shrunk.moves} == {2}
        workers.wait_steps(100)
    assert not workers.errors, workers.errors
    cluster.stop(2)
    state = reshard_status(cluster.url)
    assert state["state"] == "complete" and state["to"] == 2
    assert state["serving"] == 2 and state["moving"] == {}
    check_against_replay(cluster, names, workers, servers(), SHAPE)


def test_the_tool_killed_mid_move_resumes_and_every_push_lands_once(
    etcd_cluster: EtcdCluster, servers: Callable[..., Any]
) -> None:
    cluster = etcd_cluster
    cluster.start_shards(2)
    names = cluster.create_groups(*SHAPE)
    with Workers(cluster, names) as workers:
        workers.wait_steps(50)
        cluster.start(2, 3)
        _killed_after_first_move(cluster)
        killed = reshard_status(cluster.url)
        assert killed["state"] == "running" and killed["to"] == 3
        shown = subprocess.run(
            [sys.executable, "-m", "onnxps.cli", "reshard", cluster.url,
             "--status"],
            capture_output=True, text=True, env=clean_env(),
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("resharding 2 -> 3 shards: running; ")
        # another count is refused while this one is unfinished
        with pytest.raises(ReshardError, match="from 2 to 3 shards is under way"):
            reshard(cluster.url, 4)
        assert len(killed["moved"]) >= 1
        workers.wait_steps(20)  # a group fenced by the dead tool waits
        resumed = reshard(cluster.url, 3)
        assert resumed.resumed
        done = reshard_status(cluster.url)
        assert done["state"] == "complete" and done["moving"] == {}
        moved = {name for name, _, _ in done["moved"]}
        assert len(moved) == len(done["moved"])  # each group moved once
        assert {t for _, _, t in done["moved"]} == {2}
        workers.wait_steps(50)
    assert not workers.errors, workers.errors
    check_against_replay(cluster, names, workers, servers(), SHAPE, shards=3)


def _killed_after_first_move(cluster: EtcdCluster) -> None:
    """``onnxps reshard --shards 3`` killed -9 once it moved one group."""
    tool = subprocess.Popen(
        [sys.executable, "-m", "onnxps.cli", "reshard", cluster.url, "--shards", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=clean_env(),
    )
    assert tool.stdout is not None
    first = tool.stdout.readline().decode()
    assert first.startswith("moved "), first
    os.kill(tool.pid, signal.SIGKILL)  # in the next move, or between two
    tool.wait()
    tool.stdout.close()


def test_a_resharding_killed_mid_way_is_undone_and_every_push_lands_once(
    etcd_cluster: EtcdCluster, servers: Callable[..., Any]
) -> None:
    cluster = etcd_cluster
    cli = [sys.executable, "-m", "onnxps.cli", "reshard", cluster.url]
    cluster.start_shards(2)
    names = cluster.create_groups(*SHAPE)
    with Workers(cluster, names) as workers:
        workers.wait_steps(50)
        cluster.start(2, 3)
        _killed_after_first_move(cluster)
        undo = subprocess.run(
            [*cli, "--undo"], capture_output=True, text=True, env=clean_env()
        )
        assert undo.returncode == 0, undo.stdout + undo.stderr
        assert "the resharding is undone, back to 2 shards" in undo.stdout
        state = reshard_status(cluster.url)
        assert state["state"] == "complete" and state["to"] == 2
        assert state["undone"] == 3 and state["serving"] == 2
        workers.wait_steps(50)
    assert not workers.errors, workers.errors
    # shard 2 holds nothing again: it can be stopped
    with Client(cluster.addresses[2], timeout=10) as two:
        assert two.list_groups() == []
    cluster.stop(2)
    check_against_replay(cluster, names, workers, servers(), SHAPE, shards=2)
    again = subprocess.run(
        [*cli, "--undo"], capture_output=True, text=True, env=clean_env()
    )
    assert again.returncode == 1
    assert "no resharding is under way" in again.stderr
