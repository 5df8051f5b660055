"""scripts/call_walk.py walks one warm push through the code and counts the onnxps
modules it enters and the hops between them: it runs, and prints counts for the
client's thread and the server's (a figure for reading, not a timing)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _walk(way: str, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "call_walk.py"), "--only", way, *flags],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return done.stdout


def _counts(out: str, label: str) -> tuple[int, int]:
    found = re.search(rf"^{label}: (\d+) modules in (\d+) hops$", out, re.M)
    assert found is not None, out
    return int(found[1]), int(found[2])


def test_the_walk_counts_a_grpc_push_on_both_ends() -> None:
    out = _walk("grpc")
    modules, hops = _counts(out, "grpc push")
    assert modules > 5 and hops > modules, out
    # the caller's thread and a server thread that ran the Push handler
    assert re.search(r"thread MainThread: \d+ modules, \d+ hops", out), out
    assert re.search(r"thread onnxps-rpc\S*: \d+ modules, \d+ hops", out), out
    listed = out.split("modules: ", 1)[1]
    assert "client." in listed and "server." in listed and "kernels." in listed


def test_the_walk_counts_a_frame_push() -> None:
    out = _walk("frames")
    modules, hops = _counts(out, "frames push")
    assert modules > 5 and hops > modules, out
    assert "server._frames" in out or "frames" in out.split("modules: ", 1)[1]


def test_the_trace_prints_one_line_per_hop() -> None:
    out = _walk("grpc", "--trace")
    _, hops = _counts(out, "grpc push")
    steps = re.findall(r"^    (->|<-) (\S+)\.(\w+|<\w+>)$", out, re.M)
    assert len(steps) == hops, out
    # the push enters the client's call and the server's Push handler
    assert ("->", "client._requests", "_push") in steps, out
    assert ("->", "server.rpc._tensors", "Push") in steps, out
