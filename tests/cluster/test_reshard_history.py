"""A group's history after a resharding moved it (docs/recovering.md, "After a
resharding"): the target shard keeps it from the move on; a rewind or fork to a step
before the move is refused, saying so; `onnxps history` says where it starts."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _reshard import EtcdCluster, create_groups, push
from onnxps import cli
from onnxps.cli.reshard import reshard
from onnxps.client import Client, FailedPreconditionError

pytestmark = pytest.mark.slow


def test_a_moved_groups_history_starts_at_the_move_and_older_steps_are_refused(
    etcd_cluster: EtcdCluster,
    servers: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    cluster = etcd_cluster
    cluster.start_shards(2)
    with cluster.connect(client_id="w") as c:
        names = create_groups(c, 6, 0, ids=False)
        for name in names:
            for step in range(3):
                push(c, name, 0, step)
        cluster.start(2, 3)
        before = time.time()
        report = reshard(cluster.url, 3)
        after = time.time()
        moved = {m.name: m for m in report.moves}
        name = sorted(moved)[0]
        assert moved[name].target == 2
        for step in range(3, 6):  # T=4, 5, 6
            push(c, name, 0, step)
        # the history on the target starts at the move: T=3, taken then
        h = c.history(name)
        assert [(s.step, s.kind) for s in h.steps] == [
            (3, "moved"),
            (4, "step"),
            (5, "step"),
            (6, "step"),
        ]
        assert before <= h.steps[0].unix_time <= after
        assert (h.oldest_step, h.update_count) == (3, 6)
        when = datetime.datetime.fromtimestamp(h.steps[0].unix_time, datetime.UTC)
        iso = when.isoformat(timespec="seconds").replace("+00:00", "Z")
        # a step before the move: refused, saying why and what to do
        with pytest.raises(FailedPreconditionError) as refused:
            c.rewind(name, to_step=1)
        err = refused.value
        assert err.reason == "STEP_NOT_RETAINED"
        assert err.metadata["oldest_step"] == "3"
        assert err.metadata["newest_step"] == "6"
        assert err.metadata["moved_step"] == "3"
        assert float(err.metadata["moved_unix"]) == h.steps[0].unix_time
        assert (
            f"step T=1 of group {name!r} is from before a resharding moved the "
            f"group to this shard (at T=3, on {iso})" in str(err)
        )
        assert "the oldest step it can go back to is T=3 (the newest, T=6)" in str(err)
        assert "export the group (onnxps export to a .npz file" in str(err)
        assert c.describe_group(name).update_count == 6  # nothing changed
        # the move's step and those after it are reached, bit for bit
        done = c.rewind(name, to_step=4)
        assert (done.base, done.base_step, done.replayed) == ("create", 3, 1)
        got = c.pull(name, state=True)
        with Client(f"127.0.0.1:{servers().port}") as ref:
            create_groups(ref, 6, 0, ids=False)
            for step in range(4):
                push(ref, name, 0, step)
            want = ref.pull(name, state=True)
        assert len(got) == len(want) == 2  # X and Adagrad's H
        for a, b in zip(got, want, strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        # `onnxps history` says where the history starts and why
        address = ",".join(cluster.addresses[k] for k in range(3))
        assert cli.main(["history", address, name]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[1].split()[0::2] == ["3", "moved"]
        assert out[-1] == (
            f"its history here starts at T=3, where a resharding moved it to this "
            f"shard ({_when(h.steps[0].unix_time)}): the steps before the move "
            "cannot be reached (export a group before resharding to keep its state)"
        )
        assert cli.main(["rewind", address, name, "--to-step", "2"]) == 1
        assert "before a resharding moved the group" in capsys.readouterr().err
        assert cli.main(["rewind", address, name, "--to-time", str(before)]) == 1
        assert (
            f"its oldest: {_when(h.steps[0].unix_time)}, where a resharding moved "
            "it to this shard); nothing was rewound"
        ) in capsys.readouterr().err
        assert c.describe_group(name).update_count == 4


def _when(unix: float) -> str:
    t = datetime.datetime.fromtimestamp(unix, datetime.UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")
