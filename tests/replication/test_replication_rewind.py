"""A rewind on a replicated shard (issue 40) is a logged record: shipped to the
standby, which applies it; after a failover the new primary holds the rewound line
and can rewind again from its own log."""

from __future__ import annotations

import numpy as np
import pytest
from _replicas import SIZE, ReplicaSet
from onnxps.client import Client

F32 = np.float32


def _state(address: str) -> tuple[int, list[np.ndarray]]:
    with Client(address, timeout=30) as c:
        return c.pull_versioned("g", state=True)


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b) == 2  # Adagrad: X and H
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, strict=True)


@pytest.mark.slow
def test_a_rewind_reaches_the_standby_and_survives_a_failover(
    replicas: object,
) -> None:
    rs: ReplicaSet = replicas(2)  # type: ignore[operator]
    p = rs.primary_with_group()
    s = 1 - p
    rng = np.random.default_rng(40)
    grads = [rng.standard_normal(SIZE).astype(F32) for _ in range(30)]
    with Client(rs.url, timeout=60) as c:
        for k, g in enumerate(grads[:20]):
            c.push("g", g)
            if k + 1 == 12:
                at12 = c.pull("g", state=True)
        done = c.rewind("g", to_step=12)
        assert (done.from_step, done.group.update_count) == (20, 12)
        rs.wait_t(s, "g", 12)
        t_s, on_standby = _state(rs.addresses[s])
        assert t_s == 12
        _equal(on_standby, at12)
        for g in grads[20:23]:
            c.push("g", g)
        rs.wait_t(s, "g", 15)
        _equal(_state(rs.addresses[s])[1], _state(rs.addresses[p])[1])
        before = _state(rs.addresses[p])[1]
        rs.procs[p].kill()
        rs.procs[p].wait()
        new = rs.primary(not_=p)
        assert new == s
        rs.start(p)  # rejoins as a standby: pushes need a synchronous standby
        t_new, after = _state(rs.addresses[new])
        assert t_new == 15
        _equal(after, before)
        # the new primary rewinds from its own copy of the log: the rewind's
        # record (T=12) and one push after it
        again = c.rewind("g", to_step=13)
        assert (again.base, again.base_step, again.replayed) == ("rewind", 12, 1)
        assert c.address == rs.addresses[new]
    rs.wait_t(p, "g", 13)
    _equal(_state(rs.addresses[p])[1], _state(rs.addresses[new])[1])
