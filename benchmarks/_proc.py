"""What a benchmark reads of a process from /proc: its CPU time and its memory
figures (Linux)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_mib(pid: int, key: str) -> float:
    """One kB figure of /proc/PID/status (VmRSS, VmHWM, RssShmem...) in MiB; 0 when
    the kernel does not give it."""
    return status_mibs(pid, key)[0]


def status_mibs(pid: int, *keys: str) -> list[float]:
    """Several kB figures of /proc/PID/status in MiB, from one read of it (so they
    are of one moment); 0 for one the kernel does not give."""
    got: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            got[key] = int(value.split()[0]) / 1024
    return [got.get(k, 0.0) for k in keys]
