"""The flat form on a cluster (docs/protocol.md, "The flat form"): a group held
whole by one shard goes flat as on one server, a split group's parts each in their
own layout; both step bit for bit alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from _cluster import shards
from onnxps.client import Adam, Client

Array = np.ndarray[Any, Any]
SHAPES = [(3, 5), (), (0,), (700,), (2, 0, 3), (129, 3)]


def test_a_whole_group_and_a_split_one_go_flat_alike(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(0)
    x0 = {f"t{i}": rng.standard_normal(s).astype("f4") for i, s in enumerate(SHAPES)}
    with (
        shards(tmp_path, 2) as (addresses, _),
        Client(addresses, timeout=60) as c,
        Client(addresses, timeout=60, split_bytes=2048) as s,
    ):
        c.create_group("whole", Adam(), learning_rate=0.05, tensors=x0)
        s.create_group("split", Adam(), learning_rate=0.05, tensors=x0)
        assert len(s.describe_group("split").parts) == 2
        assert len(c.describe_group("whole").parts) == 1
        assert "whole" in c.ops.flat_forms
        for step in range(3):
            g = [rng.standard_normal(s).astype("f4") for s in SHAPES]
            a = c.push("whole", *g, return_values=True)
            b = s.push("split", *g, return_values=True)
            assert [x.tobytes() for x in a] == [x.tobytes() for x in b], step
        got, want = c.pull("whole", state=True), s.pull("split", state=True)
        assert [x.shape for x in got] == SHAPES * 3
        assert [x.tobytes() for x in got] == [x.tobytes() for x in want]
