"""Helpers for tests that run onnxps as real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

LISTENING = re.compile(r"onnxps listening on (\S+)")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without ONNXPS_* (flags decide), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXPS_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def start_server(
    log: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``onnxps serve`` on 127.0.0.1 port 0 as a process; returns it and its address."""
    cmd = [sys.executable, "-m", "onnxps.server.cli", "serve", *args]
    if "--address" not in args:
        cmd += ["--address", "127.0.0.1:0"]
    if "--durability" not in args:
        cmd += ["--durability", "none"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env or clean_env()
        )
    return proc, wait_for_listening(proc, log)


def wait_for_listening(proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = LISTENING.search(log.read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError(f"server did not start:\n{log.read_text(errors='replace')}")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


def gone(pid: int) -> bool:
    """True when ``pid`` no longer exists (or is a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
