"""A 256 MiB group through the chunked streams, bit-exact, with bounded server memory.

The server runs as its own process (``python -m onnxps.cli serve``) so its
peak resident set (VmHWM) can be read from /proc and compared with the state it holds.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxps.cli.process import start_server_process, stop_processes
from onnxps.client import Adagrad, Client
from onnxps.server.kernels import Stepper, make_attrs

pytestmark = pytest.mark.slow  # 256 MiB tensors

Array = np.ndarray[Any, Any]
MIB = 1 << 20
ELEMENTS = 32 * MIB  # per tensor; two tensors: 64M float32 = 256 MiB of X
SPEC = Adagrad(epsilon=1e-5, decay_factor=0.5, norm_coefficient=0.001)


class ServerProcess:
    """``onnxps serve`` on a free loopback port, in a child process."""

    def __init__(self, *args: str) -> None:
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115
        self.proc, self.address = start_server_process(*args, log=Path(self._log.name))

    def status(self, field: str) -> int:
        """A /proc/PID/status memory figure in bytes (VmHWM: peak resident set)."""
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        found = re.search(rf"^{field}:\s+(\d+) kB$", text, re.MULTILINE)
        assert found, text
        return int(found.group(1)) * 1024

    def stop(self) -> None:
        stop_processes([self.proc], timeout=15)
        self._log.close()


@pytest.fixture
def server_process() -> Iterator[ServerProcess]:
    server = ServerProcess()
    try:
        yield server
    finally:
        server.stop()


def ramp(n: int, period: int, scale: float, shift: float) -> Array:
    """Cheap varied float32 values (a random generator takes seconds at this size)."""
    a = np.arange(n, dtype=np.int64)
    a %= period
    out = a.astype(np.float32)
    out *= np.float32(scale)
    out += np.float32(shift)
    return out


def test_256_mib_group_round_trips_bit_exactly(server_process: ServerProcess) -> None:
    xs = [ramp(ELEMENTS, 1009, 1e-3, -0.5), ramp(ELEMENTS, 997, -2e-3, 1.0)]
    state_bytes = 2 * sum(x.nbytes for x in xs)  # X and H
    assert state_bytes == 512 * MIB
    # the streams (this test bounds what they hold); shared memory would count the
    # client's segments the server maps in its resident set
    with Client(server_process.address, timeout=120, shared_memory="off") as c:
        started = time.monotonic()
        info = c.create_group(
            "big", SPEC, learning_rate=0.01, tensors={"a": xs[0], "b": xs[1]}
        )
        assert info.element_count == 2 * ELEMENTS
        assert info.state_bytes == state_bytes

        # the same steps locally, in place, with the server's own kernel
        local_x = [x.copy() for x in xs]
        local_h = [np.zeros_like(x) for x in xs]
        stepper = Stepper(make_attrs("Adagrad", vars(SPEC)), np.float32, [ELEMENTS] * 2)
        for t in range(2):
            grads = [ramp(ELEMENTS, 101 + t, 1e-2, -0.45), ramp(ELEMENTS, 89, 3e-3, t)]
            assert c.push("big", *grads) == t + 1
            stepper.step(0.01, t, local_x, grads, None, local_h)
            del grads
        version, pulled = c.pull_versioned("big", state=True)
        elapsed = time.monotonic() - started

    assert version == 2
    assert [a.shape for a in pulled] == [(ELEMENTS,)] * 4
    for got, expected in zip(pulled, local_x + local_h, strict=True):
        assert got.dtype == np.float32
        assert np.array_equal(got, expected)  # no NaN here: equal means bit-equal
        assert got.tobytes() == expected.tobytes()
    assert not np.array_equal(pulled[0], xs[0])

    peak = server_process.status("VmHWM")
    moved = 256 * MIB * 3 + state_bytes  # create, two pushes, pull with state
    print(
        f"\n256 MiB group: {elapsed:.1f} s for {moved / MIB:.0f} MiB through the "
        f"streams; server peak RSS {peak / MIB:.0f} MiB for {state_bytes / MIB:.0f} "
        f"MiB of state ({peak / state_bytes:.2f}x)"
    )
    assert peak < 3 * state_bytes + 300 * MIB, peak / MIB
