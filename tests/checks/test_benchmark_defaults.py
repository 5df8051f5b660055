"""Benchmarks measure what a user gets first (docs/benchmarks.md): every script in
benchmarks/ that starts a server process measures one started with no flags
(``onnxps.cli.process.start_default_server``), or says here why it may not.

And ``start_default_server`` starts what it says: ``onnxps serve`` with its
defaults (snapshot durability in ``WORKDIR/onnxps-data``), on a free port."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from onnxps.cli.process import start_default_server, stop_processes
from onnxps.client import Adam, Client

ROOT = Path(__file__).resolve().parents[2]

# Scripts that start servers but lead with no no-flags row, and why.
EXEMPT = {
    "call_anatomy.py": "dissects the gRPC path's server CPU against the raw floor",
    "encode_overlap_ab.py": "an A/B of two trees on the data channel",
    "hardening.py": "replays attacks; each server's flags are the attack's setting",
    "many_tensors_ab.py": "an A/B of two trees over gRPC unary",
    "refactor_ab.py": "an A/B of two trees on every named transport",
    "restart.py": "a replicated shard needs --coordinator and --shard",
    "rewind.py": "a rewind needs --durability wal (the default keeps no log)",
    "socket_path.py": "measures a design alternative to gRPC, not a product path",
    "stream_ab.py": "an A/B of two trees on the stream paths",
    # their own no-flags server (the default durability spelled out), first row:
    "paths.py": "its 'no flags' row is onnxps serve --durability snapshot --data-dir",
    "small_calls.py": "its _default_server is onnxps serve with the default flags",
}

STARTS_A_SERVER = re.compile(r"start_(server_process|default_server)\(|\"serve\"")


def _scripts_starting_servers() -> list[Path]:
    return sorted(
        p
        for p in (ROOT / "benchmarks").glob("*.py")
        if STARTS_A_SERVER.search(p.read_text())
    )


def test_every_benchmark_that_starts_a_server_measures_one_with_no_flags() -> None:
    scripts = _scripts_starting_servers()
    assert len(scripts) >= 15, [p.name for p in scripts]
    leading = [p.name for p in scripts if "start_default_server(" in p.read_text()]
    assert {"transport.py", "peers.py", "samehost.py", "cluster.py"} <= set(leading)
    missing = [p.name for p in scripts if p.name not in leading + list(EXEMPT)]
    assert missing == [], (
        f"{missing} start servers with flags only: lead with a no-flags row "
        "(start_default_server) or say in EXEMPT why not"
    )
    stale = [name for name in EXEMPT if not (ROOT / "benchmarks" / name).exists()]
    assert stale == [], f"EXEMPT names scripts that are gone: {stale}"


@pytest.mark.slow
def test_start_default_server_runs_onnxps_serve_with_its_defaults(
    tmp_path: Path,
) -> None:
    proc, address = start_default_server(tmp_path / "work", log=tmp_path / "s.log")
    try:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", address), address
        with Client(address, timeout=30) as c:
            c.create_group(
                "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(4, "f4")}
            )
            c.push("g", np.ones(4, "f4"))
            assert c.describe_group("g").update_count == 1
    finally:
        stop_processes([proc], timeout=60)
    assert proc.returncode == 0
    # the default durability: a snapshot in ./onnxps-data of its working folder
    snapshots = list((tmp_path / "work" / "onnxps-data" / "snapshots").iterdir())
    assert len(snapshots) == 1, snapshots
    log = (tmp_path / "s.log").read_text()
    assert "onnxps listening on " + address in log
    assert "1 groups" in log
