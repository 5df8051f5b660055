"""A push refused NOT_ENOUGH_REPLICAS was not applied, and stays so: real etcd,
real ``onnxps serve`` processes, a cluster client (``Client([address])``: its pushes
go through the parts' fan-out, which keeps what may land later).

The primary refuses a change before writing anything when fewer synchronous
standbys follow it than ``--sync-replicas``. The cluster client used to keep such a
push pending and send it again before the group's next push or pull, so a caller
who retried on the error ("nothing was applied") applied its gradient twice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _etcd import EtcdProcess
from _replicas import SIZE, ReplicaSet, _create, _kill, _serial, _wait_log
from onnxps.client import Client, UnavailableError

G = np.full(SIZE, 0.5, np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("through", ["addresses", "etcd"])
def test_a_push_refused_not_enough_replicas_is_not_sent_again(
    tmp_path: Path,
    etcd_server: EtcdProcess,
    through: str,
) -> None:
    """Through ``Client([address])`` and through ``Client("etcd://...")``, which
    follows the primary and routes a replicated cluster as a cluster too."""
    rs = ReplicaSet(tmp_path, etcd_server, 2)
    try:
        p = rs.primary()
        s = 1 - p
        rs.wait_sync()
        _create(rs.url)
        target = [rs.addresses[p]] if through == "addresses" else rs.url
        with Client(target, timeout=30) as c:
            assert c.push("g", G) == 1
            _kill(rs, s)
            # once the primary saw its synchronous standby's stream end, a push is
            # refused at once (before that it waits for the standby's ack, which a
            # loaded CI host made outlast the 2 s deadline)
            _wait_log(
                tmp_path / f"server{p}-{rs.starts[p]}.log",
                rf"standby m{s} stopped following",
            )
            with pytest.raises(UnavailableError) as err:
                c.push("g", G, timeout=2)  # resent until the deadline, refused
            assert err.value.reason == "NOT_ENOUGH_REPLICAS"
            assert "nothing was applied" in err.value.details
            assert rs.state(p, "g")[0] == 1
            rs.start(s)
            rs.wait_sync()
            # The caller retries the push it was told was not applied: it lands
            # once (before: the refused one was sent first, then this one, T=3).
            assert c.push("g", G) == 2
        assert rs.state(p, "g")[0] == 2
        np.testing.assert_array_equal(rs.state(p, "g")[1], _serial([G, G]))
        rs.wait_t(s, "g", 2)
    finally:
        rs.close()
