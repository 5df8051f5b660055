"""A standby taking the lead reads the placement map at once (``read_now``), so a
group a resharding fenced since its last half-second poll is fenced before it
acknowledges anything; and says when etcd does not answer. Real etcd."""

from __future__ import annotations

import json
import time

import pytest
from _etcd import EtcdProcess
from onnxps.server.errors import Moved
from onnxps.server.replication._etcd import Etcd
from onnxps.server.replication._placement import PlacementWatch
from onnxps.server.store import ParameterStore
from onnxps.wire.coordinator import parse_coordinator


def test_read_now_fences_a_group_moving_away_at_once(
    etcd_server: EtcdProcess,
) -> None:
    etcd = Etcd(parse_coordinator(f"etcd://{etcd_server.endpoint}/ps"), timeout=2.0)
    store = ParameterStore()
    watch = PlacementWatch(etcd, "/ps", 0, store)  # never started: no poll loop
    store.moves.check("g")  # nothing moves: served here
    placement = {
        "version": 7,
        "shards": 2,
        "serving": 2,
        "owners": {},
        # the copy is done: the source is fenced (no "copy" key)
        "moving": {"g": {"from": 0, "to": 1}},
    }
    etcd.put("/ps/placement", json.dumps(placement))
    store.moves.check("g")  # not read yet
    assert watch.read_now(seconds=5.0)
    with pytest.raises(Moved) as err:
        store.moves.check("g")
    assert err.value.metadata["shard"] == "1"
    assert err.value.metadata["map_version"] == "7"
    # while the move still copies (its log followed), the source serves it
    placement["version"] = 8
    placement["moving"] = {"h": {"from": 0, "to": 1, "copy": True}}
    etcd.put("/ps/placement", json.dumps(placement))
    assert watch.read_now(seconds=5.0)
    store.moves.check("h")


def test_read_now_says_when_etcd_does_not_answer(etcd_server: EtcdProcess) -> None:
    etcd = Etcd(parse_coordinator(f"etcd://{etcd_server.endpoint}/ps"), timeout=0.3)
    watch = PlacementWatch(etcd, "/ps", 0, ParameterStore())
    assert watch.read_now(seconds=1.0)  # no map yet: nothing to adopt, answered
    etcd_server.stop()
    started = time.monotonic()
    assert not watch.read_now(seconds=1.0)
    assert time.monotonic() - started < 5.0
