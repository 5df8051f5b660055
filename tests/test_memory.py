"""What a group costs in memory: its state and nothing more held for good.

A new group's V and H are zeros that take no memory until the first step writes
them (calloc'd pages), and the gradient buffers the server keeps between pushes are
bounded by ``--gradient-pool-bytes`` (tests/test_gradient_pool.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = """
import json
from pathlib import Path
import numpy as np
from onnxps.server.kernels import make_attrs
from onnxps.server.store import ParameterStore

def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

n = 64 << 18  # 64 MiB of float32
store = ParameterStore()
adam = make_attrs("Adam", {})
store.create_group("first", adam, 1e-3, [("w", np.zeros(n, np.float32))])  # JIT
before = rss()
store.create_group("second", adam, 1e-3, [("w", np.zeros(n, np.float32))])
print(json.dumps({"created": rss() - before, "x": n * 4}))
"""


def test_a_new_groups_optimizer_state_takes_no_memory_until_it_steps() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    got = json.loads(out)
    # X is copied in (64 MiB); V and H (another 128 MiB) are not touched yet
    assert got["x"] <= got["created"] < 1.5 * got["x"]


def test_the_trimmer_hands_memory_back_only_when_the_process_grew() -> None:
    import pytest
    from onnxps.server import _malloc

    libc = _malloc._libc()
    if libc is None:
        pytest.skip("glibc is not this process's allocator")
    grown = _malloc.Trimmer(libc, growth=1 << 40)  # never grows that much
    assert grown.check() is False and grown.trims == 0
    always = _malloc.Trimmer(libc, growth=-(1 << 40))  # any RSS counts as grown
    assert always.check() is True and always.trims == 1
    assert _malloc.rss_bytes() > 0
