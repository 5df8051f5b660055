"""What a group costs in memory: its state and nothing more held for good.

A new group's V and H are zeros that take no memory until the first step writes
them (calloc'd pages), and the gradient buffers the server keeps between pushes are
bounded by ``--gradient-pool-bytes`` (tests/service/test_gradient_pool.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


def _run_json(script: str, *args: str) -> Any:
    """What ``script`` prints as JSON, run in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    return json.loads(out)


def test_a_new_groups_optimizer_state_takes_no_memory_until_it_steps() -> None:
    got = _run_json(_SCRIPT)
    # X is copied in (64 MiB); V and H (another 128 MiB) are not touched yet
    assert got["x"] <= got["created"] < 1.5 * got["x"]


def test_the_trimmer_hands_memory_back_only_when_the_process_grew() -> None:
    from onnxps.server import _malloc

    libc = _malloc._libc()
    if libc is None:
        pytest.skip("glibc is not this process's allocator")
    grown = _malloc.Trimmer(libc, growth=1 << 40)  # never grows that much
    assert grown.check() is False and grown.trims == 0
    always = _malloc.Trimmer(libc, growth=-(1 << 40))  # any RSS counts as grown
    assert always.check() is True and always.trims == 1
    assert _malloc.rss_bytes() > 0


def test_the_trimmer_does_not_count_a_mapped_shared_segment_as_growth(
    tmp_path: Path,
) -> None:
    """A client's segment mapped by the server is shared memory, not malloc's: the
    trimmer watches private memory, which mapping 32 MiB of a file leaves alone."""
    import mmap

    import numpy as np
    from onnxps.server import _malloc

    path = tmp_path / "segment"
    with open(path, "wb") as out:
        out.truncate(32 << 20)
    before_rss, before_private = _malloc.rss_bytes(), _malloc.private_bytes()
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 32 << 20) as m:
        np.frombuffer(m, np.uint8)[:] = 1  # every page touched: resident, shared
        grown_rss = _malloc.rss_bytes() - before_rss
        grown_private = _malloc.private_bytes() - before_private
    assert grown_rss >= 28 << 20, grown_rss
    assert grown_private < 8 << 20, grown_private


# What numba's compiler (LLVM's library) holds resident in a process after onnxps
# loaded or compiled its loops, the last use of numba being: the fused kernels, the
# encoding loops, or a row kernel's first call after an unrelated compile had paged
# LLVM back in. Private pages only: a page another process maps stays (it is shared).
_LLVM_SCRIPT = """
import json, sys
import numpy as np

def llvm_private():
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):
                inside = line.rstrip().rsplit("/", 1)[-1].startswith("libllvmlite")
            elif inside and head in ("Private_Clean:", "Private_Dirty:"):
                total += int(line.split()[1]) * 1024
    return total

last = sys.argv[1]
if last == "codec":
    from onnxps.wire.encoding import compiled_codec
    loops = compiled_codec()
    bits = np.array([0x3F800000], np.uint32)
    out = np.zeros(1, np.uint16)
    loops["bfloat16"](bits, out)
    assert out[0] == 0x3F80, out  # 1.0 in bfloat16, computed after the page-out
else:
    from onnxps.server.kernels import Stepper, make_attrs
    x, g = np.ones(8, np.float32), np.full(8, 0.5, np.float32)
    v, h = np.zeros(8, np.float32), np.zeros(8, np.float32)
    s = Stepper(make_attrs("Adam", {}), np.float32, [8], kernels="numba")
    if last == "rows":
        import numba
        numba.njit(lambda a: a + 1)(1)  # an unrelated compile: LLVM back in
        assert s.step_rows(0.1, 0, x, g[:4], v, h, np.array([1]), 4)
        assert x[4:].tolist() != [1.0] * 4 and x[:4].tolist() == [1.0] * 4
    else:
        s.step(0.1, 0, [x], [g], [v], [h])
        y, w, k = np.ones(8, np.float32), np.zeros(8, np.float32), np.zeros(8)
        numpy_path = Stepper(make_attrs("Adam", {}), np.float32, [8], kernels="numpy")
        numpy_path.step(0.1, 0, [y], [g], [w], [k.astype(np.float32)])
        assert x.tobytes() == y.tobytes() != np.ones(8, np.float32).tobytes()
print(json.dumps({"llvm": llvm_private()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("last", ["kernels", "codec", "rows"])
def test_numbas_compiler_is_not_kept_resident_after_onnxps_compiled(
    last: str,
) -> None:
    pytest.importorskip("numba")
    if not sys.platform.startswith("linux"):
        pytest.skip("MADV_PAGEOUT is Linux's")
    got = _run_json(_LLVM_SCRIPT, last)
    # 90-100 MiB resident before; what stays is the pages written at load time
    assert got["llvm"] < 8 << 20


def _minor_faults(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def test_a_servers_repeated_calls_take_no_page_faults(
    tmp_path: Path, server_processes: Any
) -> None:
    """docs/configuration.md: onnxps serve keeps glibc's thresholds where its own
    trimmer does the trimming, so a call's buffers (here a 200 x 1,000 push + pull
    over TCP: 800 KB frames) are reused from the heap call after call. Before,
    whether a server mapped and unmapped them on every call (about 750 minor page
    faults a call, twice the server CPU) depended on what it had allocated
    earlier: 2 runs of 3 did on one tree."""
    import numpy as np
    from _procs import clean_env
    from onnxps.client import Adam, Client

    env = clean_env(ONNXPS_KERNELS="numpy")
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        env.pop(key, None)
    proc, address = server_processes(tmp_path / "server.log", env=env)
    rng = np.random.default_rng(5)
    tensors = {
        f"t{i}": rng.standard_normal(1000).astype(np.float32) for i in range(200)
    }
    grads = [np.full(1000, 1e-3, np.float32)] * 200
    with Client(address, shared_memory="off", timeout=60) as ps:
        ps.create_group("many", Adam(), learning_rate=1e-3, tensors=tensors)
        for _ in range(30):  # warm: the pools, the channel, the heap
            ps.push("many", *grads)
            ps.pull("many")
        before = _minor_faults(proc.pid)
        for _ in range(40):
            ps.push("many", *grads)
            ps.pull("many")
        per_call = (_minor_faults(proc.pid) - before) / 40
        assert ps.describe_group("many").update_count == 70
    assert per_call < 50, f"{per_call:.0f} minor page faults a push + pull"
