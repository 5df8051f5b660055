"""A split group, and an ids table on a cluster, are rewound on every part to the
same T (issue 40): shard processes with write-ahead logs, the cluster client
rewinding each part."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _cluster import shards
from onnxps.client import Adam, Client, IdsTable, InvalidArgumentError, _sharded

F32 = np.float32
N = 3_000  # 12 kB of X: split in 3 parts by split_bytes below


@pytest.mark.slow
def test_a_split_group_rewinds_every_part_to_one_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = ("--durability", "wal", "--data-dir", str(tmp_path / "d{i}"))
    rng = np.random.default_rng(40)
    grads = [rng.standard_normal(N).astype(F32) for _ in range(30)]
    with (
        shards(tmp_path, 3, *wal, "--snapshot-interval", "0") as (addresses, _),
        Client(addresses, timeout=60, split_bytes=4000) as c,
    ):
        info = c.create_group(
            "g", Adam(), learning_rate=0.01, tensors={"w": np.ones(N, F32)}
        )
        assert len(info.parts) == 3 and len({p.shard for p in info.parts}) == 3
        for k, g in enumerate(grads[:20]):
            c.push("g", g)
            if k + 1 == 8:
                c.save()
            if k + 1 == 12:
                at12 = c.pull("g", state=True)
        done = c.rewind("g", to_step=12)
        assert (done.from_step, done.group.update_count) == (20, 12)
        assert (done.base, done.base_step, done.replayed) == ("snapshot", 8, 4)
        assert [p.update_count for p in done.group.parts] == [12, 12, 12]
        for got, want in zip(c.pull("g", state=True), at12, strict=True):
            np.testing.assert_array_equal(got, want, strict=True)
        # the parts go on together from there, as one server would
        with Client(addresses[0], timeout=60) as one:
            one.create_group(
                "ref",
                Adam(),
                learning_rate=0.01,
                tensors={"w": at12[0]},
                state=at12[1:],
                update_count=12,
            )
            for step in grads[20:25]:
                c.push("g", step)
                one.push("ref", step)
            serial = one.pull("ref", state=True)
        for got, ref in zip(c.pull("g", state=True), serial, strict=True):
            np.testing.assert_array_equal(got, ref, strict=True)
        history = c.history("g")
        assert history.oldest_step == 8 and history.steps[-1].step == 17
        # asked in pages of 4 steps (each part pages on its own): the same list
        monkeypatch.setattr(_sharded, "HISTORY_PAGE", 4)
        assert c.history("g") == history
        with pytest.raises(InvalidArgumentError, match="fork of 'g' on a cluster"):
            c.fork("g", "g2", at_step=12)


@pytest.mark.slow
def test_an_ids_table_on_a_cluster_rewinds_every_part(tmp_path: Path) -> None:
    wal = ("--durability", "wal", "--data-dir", str(tmp_path / "d{i}"))
    rng = np.random.default_rng(40)
    ids = rng.choice(1 << 40, size=60, replace=False).astype(np.int64)
    with (
        shards(tmp_path, 2, *wal, "--snapshot-interval", "0") as (addresses, _),
        Client(addresses, timeout=60) as c,
    ):
        info = c.create_group(
            "g", Adam(), learning_rate=0.01, tables={"emb": IdsTable(4)}
        )
        assert [p.shard for p in info.parts] == [0, 1]
        for k in range(12):  # 5 new ids a step
            rows = rng.standard_normal((5, 4)).astype(F32)
            c.push_rows("g", {"emb": (ids[5 * k : 5 * k + 5], rows)})
            if k + 1 == 6:
                at6 = c.export_rows("g", "emb", state=True)
        done = c.rewind("g", to_step=6)
        assert [p.update_count for p in done.group.parts] == [6, 6]
        assert c.count_rows("g", "emb") == 30
        got_ids, got = c.export_rows("g", "emb", state=True)
        np.testing.assert_array_equal(got_ids, at6[0], strict=True)
        assert sorted(got) == sorted(at6[1])
        for key in got:
            np.testing.assert_array_equal(got[key], at6[1][key], strict=True)
