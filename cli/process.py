"""``onnxps serve`` as a child process: start it, learn its address, stop it.

Used by ``onnxps demo``, and by the tests and benchmarks that need a real server
process. The server is started on port 0 and its address is read from its
``onnxps listening on HOST:PORT`` log line, so no port is ever guessed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "LISTENING",
    "start_default_server",
    "start_server_process",
    "stop_processes",
    "wait_for_listening",
]

LISTENING = re.compile(r"onnxps listening on (\S+)")


def start_server_process(
    *args: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``onnxps serve ARGS``, output in ``log``; return it and its address.

    ``--address 127.0.0.1:0`` and ``--durability none`` are added unless ``args``
    names them.
    """
    cmd = [sys.executable, "-m", "onnxps.cli", "serve", *args]
    if "--address" not in args:
        cmd += ["--address", "127.0.0.1:0"]
    if "--durability" not in args:
        cmd += ["--durability", "none"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
        )
    return proc, wait_for_listening(proc, log, timeout)


def start_default_server(
    workdir: Path,
    *args: str,
    log: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``onnxps serve`` as a user would, with no flag but a free loopback port
    (``--address 127.0.0.1:0``) and ``args``, the flags a deployment cannot do
    without (e.g. ``--shard 0/2``): every other setting its default (snapshot
    durability in ``workdir/onnxps-data``, the default transports). The first row
    of a benchmark is measured against this server."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "onnxps.cli", "serve", "--address", "127.0.0.1:0"]
    cmd += args
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=None if env is None else dict(env),
        )
    return proc, wait_for_listening(proc, log, timeout)


def wait_for_listening(
    proc: subprocess.Popen[Any], log: Path, timeout: float = 30.0
) -> str:
    """The address a starting server logs; kills it and raises if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = LISTENING.search(log.read_text(errors="replace"))
        if found:
            return found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    tail = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"the server did not start (log {log}):\n{tail}")


def stop_processes(
    procs: Sequence[subprocess.Popen[Any]], timeout: float = 10.0
) -> None:
    """SIGTERM every process still running, wait, then SIGKILL the stragglers."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
