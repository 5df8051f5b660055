"""The etcd layout of a replicated cluster is a contract: a client in another
language finds a shard's primary from docs/protocol.md alone. The test reads a live
cluster's keys over etcd's JSON gateway with plain HTTP calls (no onnxps code),
exactly as documented there. Real etcd, real ``onnxps serve`` processes.
"""

from __future__ import annotations

import base64
import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from _replicas import SIZE, ReplicaSet
from onnxps.client import Adagrad, Client

PROTOCOL_MD = Path(__file__).parents[2] / "docs" / "protocol.md"


def _range(endpoint: str, key: str, prefix: bool = False) -> list[tuple[str, bytes]]:
    """etcd v3's JSON gateway, by hand: POST /v3/kv/range, keys and values in
    base64; a prefix is the range [key, key with its last byte + 1)."""
    body: dict[str, str] = {"key": base64.b64encode(key.encode()).decode()}
    if prefix:
        end = bytearray(key.encode())
        end[-1] += 1
        body["range_end"] = base64.b64encode(bytes(end)).decode()
    request = urllib.request.Request(
        f"http://{endpoint}/v3/kv/range",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as reply:
        kvs = json.loads(reply.read()).get("kvs", [])
    return [
        (base64.b64decode(kv["key"]).decode(), base64.b64decode(kv.get("value", "")))
        for kv in kvs
    ]


def test_a_client_finds_the_primary_from_the_documented_etcd_keys(
    replicas: Any,
) -> None:
    doc = PROTOCOL_MD.read_text()
    for documented in (
        "`etcd://H:P/ps`",
        "`/ps/`",
        "`PREFIX/layout`",
        "`PREFIX/shards/I/primary`",
        "`PREFIX/shards/I/members/M`",
        '"address"',
        '"member"',
        '"term"',
    ):
        assert documented in doc, f"docs/protocol.md does not say {documented}"
    rs: ReplicaSet = replicas(2, prefix="ps")
    p = rs.primary()
    rs.wait_sync()
    endpoint = rs.etcd.endpoint
    assert rs.url == f"etcd://{endpoint}/ps"
    # etcd://H:P/ps: every key starts with /ps/
    keys = dict(_range(endpoint, "/ps/", prefix=True))
    assert "/ps/layout" in keys and "/ps/shards/0/primary" in keys, sorted(keys)
    count = int(dict(_range(endpoint, "/ps/layout"))["/ps/layout"])
    assert count == 1
    primaries = []
    for i in range(count):
        (key, raw), *_ = _range(endpoint, f"/ps/shards/{i}/primary")
        primaries.append(json.loads(raw))
    primary = primaries[0]
    assert primary["member"] == f"m{p}"
    assert primary["address"] == rs.addresses[p]
    assert isinstance(primary["term"], int) and primary["term"] >= 1
    members = {
        key.rsplit("/", 1)[1]: json.loads(raw)
        for key, raw in _range(endpoint, "/ps/shards/0/members/", prefix=True)
    }
    assert set(members) == {"m0", "m1"}
    assert members[f"m{p}"]["role"] == "primary"
    assert members[f"m{1 - p}"]["role"] == "standby"
    assert members[f"m{p}"]["address"] == primary["address"]
    # the address found is the primary's: it takes a create
    with Client(primary["address"], timeout=30) as c:
        c.create_group(
            "found", Adagrad(), learning_rate=0.1,
            tensors={"x": np.zeros(SIZE, np.float32)},
        )  # fmt: skip
        assert c.describe_group("found").update_count == 0
