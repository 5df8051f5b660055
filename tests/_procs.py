"""Helpers for tests that run onnxps as real processes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from onnxps.cli.process import start_server_process


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without ONNXPS_* (flags decide), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXPS_")}
    env.pop("GRPC_VERBOSITY", None)  # a server's log keeps gRPC's own lines
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


# ``server_processes`` (tests/conftest.py): ``start_server``'s arguments, its result
StartServer = Callable[..., tuple[subprocess.Popen[bytes], str]]


def start_server(
    log: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``onnxps serve`` on 127.0.0.1 port 0 as a process; returns it and its address."""
    return start_server_process(*args, log=log, env=env or clean_env())


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
