"""Start a server and workers as real processes, and stop them without leaks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")
_LISTENING = re.compile(r"listening on (\S+)")


@contextmanager
def server_process(lease_seconds: float = 10.0) -> Iterator[str]:
    """``onnxps serve`` on 127.0.0.1 port 0 in its own process; yields its address."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "onnxps.server.cli",
                "serve",
                "--address",
                "127.0.0.1:0",
                "--durability",
                "none",
                "--lease-seconds",
                str(lease_seconds),
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            yield _wait_listening(proc, log)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_listening(proc: subprocess.Popen[bytes], log: object) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        log.seek(0)  # type: ignore[attr-defined]
        text = log.read()  # type: ignore[attr-defined]
        m = _LISTENING.search(text)
        if m:
            return m.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{text}")
        time.sleep(0.05)
    raise RuntimeError("server did not report its address within 20 s")


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
