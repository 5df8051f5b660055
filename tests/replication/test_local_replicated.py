"""scripts/local_replicated.sh, the copy-paste recipe of docs/cluster.md ("Replicated
shards on one machine"), run as a user runs it: a real etcd (Debian's etcd-server;
skipped without it), three replicas, a worker, a kill -9 of the primary, T exact."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _etcd import INSTALL_HINT, etcd_binary, free_port
from _procs import clean_env

ROOT = Path(__file__).resolve().parents[2]


def _three_free_ports() -> int:
    """A port P with P, P+1 and P+2 free on loopback (the recipe's replicas)."""
    for _ in range(50):
        base = free_port()
        sockets = []
        try:
            for port in range(base, base + 3):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no three consecutive free ports")


def _left_running(work: Path) -> list[str]:
    """Processes whose command line names ``work`` (the recipe's, if any remain)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(work) in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.mark.slow
def test_the_local_replicated_recipe_keeps_t_exact_across_a_kill_9(
    tmp_path: Path,
) -> None:
    binary = etcd_binary()
    if binary is None:
        pytest.skip(INSTALL_HINT)
    work = tmp_path / "work"
    env = clean_env(
        PYTHON=sys.executable,
        WORK=str(work),
        ETCD_PORT=str(free_port()),
        ETCD_PEER_PORT=str(free_port()),
        PORT=str(_three_free_ports()),
        STEPS="200",
        ONNXPS_ETCD_BIN=binary,
    )
    run = subprocess.run(
        ["bash", "scripts/local_replicated.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    logs = "".join(f"\n-- {p.name}\n{p.read_text()[-2000:]}" for p in
                   sorted(work.glob("*.log")))  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr + logs
    out = run.stdout
    killed = re.search(r"^== kill -9 the primary (r\d) \(pid \d+\)", out, re.M)
    new = re.search(r"^== new primary: (r\d)$", out, re.M)
    assert killed and new and killed.group(1) != new.group(1), out
    # the kill came under the worker, a quarter of the way through its pushes
    assert out.index("step 50/200: T=50") < out.index("step 200/200: T=200")
    assert "worker done: T=200" in out.splitlines()
    rows = [line.split() for line in out.splitlines()]
    assert ["recipe", "adam", "float32", "1", "1000", "200"] in [r[:6] for r in rows]
    members = {r[1]: r[3] for r in rows if len(r) == 8 and re.fullmatch(r"r\d", r[1])}
    assert members[new.group(1)] == "primary"
    assert killed.group(1) not in members  # killed: its member key lapsed
    assert out.splitlines()[-1] == (
        f"== T=200 after the kill -9 of {killed.group(1)}: every push applied "
        "exactly once"
    )
    assert _left_running(work) == []  # the script stopped all it started
