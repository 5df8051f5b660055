"""The standing chaos test (issue 36), short: tests/chaos.py with a fixed seed for
two minutes of faults (about three with the setup and the convergence watch).

It asserts the checker's verdicts, not its timings: every acknowledged push is in
the final state exactly once at its T, the state is a serial replay of the applied
pushes, one primary per term, no call past its deadline, every replica equal to its
primary within 30 s of the heal. Its figures are in the failure message and in
``chaos.txt`` under the test's temp dir. Longer runs: docs/cluster.md, "Standing
chaos test".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _etcd import INSTALL_HINT, etcd_binary

HERE = Path(__file__).resolve().parents[1]
SEED = 36
DURATION = 130


@pytest.mark.slow
@pytest.mark.skipif(etcd_binary() is None, reason=INSTALL_HINT)
@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("iptables") is None,
    reason="the chaos test needs root and iptables (a network namespace, iptables "
    "rules, tmpfs mounts)",
)
def test_a_seeded_chaos_run_keeps_every_acknowledged_push(tmp_path: Path) -> None:
    verdicts = tmp_path / "verdicts.json"
    with open(tmp_path / "chaos.txt", "wb") as out:
        proc = subprocess.run(
            [sys.executable, str(HERE / "chaos.py"), "--seed", str(SEED),
             "--duration", str(DURATION), "--out", str(tmp_path / "run"),
             "--json", str(verdicts)],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=DURATION + 600,
        )  # fmt: skip
    text = (tmp_path / "chaos.txt").read_text(errors="replace")
    ended = f"the run ended ({proc.returncode}) with no verdicts"
    assert verdicts.exists(), f"{ended}:\n{text[-3000:]}"
    got = json.loads(verdicts.read_text())
    failed = {k: v["why"] for k, v in got["verdicts"].items() if not v["ok"]}
    assert not failed, f"verdicts failed: {failed}\n{got['text']}\n{text[-3000:]}"
    assert proc.returncode == 0, text[-3000:]
