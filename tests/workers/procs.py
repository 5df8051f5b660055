"""Start a server and workers as real processes, and stop them without leaks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from onnxps.cli.process import start_server_process, stop_processes

WORKER = Path(__file__).with_name("worker.py")


@contextmanager
def server_process(lease_seconds: float = 10.0) -> Iterator[str]:
    """``onnxps serve`` on 127.0.0.1 port 0 in its own process; yields its address."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_server_process(
            "--lease-seconds", str(lease_seconds), log=Path(tmp) / "server.log"
        )
        try:
            yield address
        finally:
            stop_processes([proc])


def start_worker(
    address: str, group: str, worker: int, *, mode: str, steps: int, seed: int = 0
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            address,
            group,
            str(worker),
            "--mode",
            mode,
            "--steps",
            str(steps),
            "--seed",
            str(seed),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 45.0) -> tuple[int, str, str]:
    """Wait for a worker (killed if it overruns): (exit code, stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err
