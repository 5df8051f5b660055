"""A standby catching up groups its fsyncs (issue 23): the records it receives while
one batch is fsynced are fsynced together, and acknowledged by the last of them.
Real etcd, real ``onnxps serve`` processes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _replicas import SIZE, ReplicaSet, _create, _kill, _metrics_text
from onnxps.client import Client

RECORDS = 400


def _fsyncs(log: Path) -> int:
    found = re.search(
        r"^onnxps_wal_fsync_duration_seconds_count (\S+)$", _metrics_text(log), re.M
    )
    assert found
    return int(float(found.group(1)))


@pytest.mark.slow
def test_a_standby_catching_up_fsyncs_its_records_in_batches(
    replicas: Any,
    tmp_path: Path,
) -> None:
    rs: ReplicaSet = replicas(2, extra=("--sync-replicas", "0", "--metrics-port", "0"))
    p = rs.primary()
    s = 1 - p
    _create(rs.url)
    rs.wait_t(s, "g", 0)
    _kill(rs, s)
    with Client(rs.url, timeout=30) as c:
        for _ in range(RECORDS):
            c.push("g", np.full(SIZE, 0.5, np.float32))
    rs.start(s)  # resumes after the create: RECORDS records to catch up on
    rs.wait_t(s, "g", RECORDS)
    np.testing.assert_array_equal(rs.state(s, "g")[1], rs.state(p, "g")[1])
    # one fsync per record before (RECORDS or more); now one per batch received
    # meanwhile (about RECORDS / 2 on a loaded 2-core host, far fewer when idle)
    assert _fsyncs(tmp_path / f"server{s}-2.log") <= RECORDS * 3 // 4
