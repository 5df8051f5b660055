"""A server with an empty numba cache answers its first calls without waiting for
the fused kernels (or the encoding loops) to compile, with the NumPy path's bits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import clean_env

pytest.importorskip("numba", reason="numba is not installed: nothing compiles")

# An embedded server (create_server, as tests, benchmarks and notebooks start one)
# and a client, in a process of their own whose numba cache is the empty tmp dir.
CHILD = r"""
import json, sys, time
import ml_dtypes
import numpy as np
from onnxps.client import Adam, Client
from onnxps.server.app import ServerConfig, create_server
from onnxps.server.kernels import Stepper, _select, make_attrs
from onnxps.wire import encoding

rng = np.random.default_rng(3)
x0 = [rng.standard_normal(n).astype(np.float32) for n in (1000, 50_000, 7)]
grads = [[rng.standard_normal(a.size).astype(np.float32) for a in x0] for _ in range(3)]
handle = create_server(ServerConfig(address="127.0.0.1:0", durability="none")).start()
with Client(handle.address, timeout=60) as ps:
    start = time.perf_counter()
    ps.create_group("g", Adam(), learning_rate=0.01,
                    tensors=[(f"t{i}", a) for i, a in enumerate(x0)])
    ps.push("g", *grads[0])
    ps.push("g", *grads[1], encoding="bfloat16")
    answered = time.perf_counter() - start
    loading = not _select._loaded, "loops" not in encoding._codec_loaded
    _select.fused_kernels()  # now wait for them: the next step takes them
    ps.push("g", *grads[2])
    fused = [g.stepper.kernels for g in handle.store._groups.values()]
    x = ps.pull("g")
handle.stop(grace=0)
# the reference: NumPy's steps on the same gradients (the bfloat16 one widened)
ref = [a.copy() for a in x0]
v = [np.zeros_like(a) for a in x0]
h = [np.zeros_like(a) for a in x0]
stepper = Stepper(make_attrs("Adam", {}), np.float32, [a.size for a in x0],
                  kernels="numpy")
for t, gs in enumerate(grads):
    if t == 1:
        gs = [g.astype(ml_dtypes.bfloat16).astype(np.float32) for g in gs]
    stepper.step(0.01, t, ref, gs, v, h)
print(json.dumps({
    "answered": answered,
    "loading": loading,
    "fused": fused,
    "same": [a.tobytes() == b.tobytes() for a, b in zip(x, ref)],
}))
"""


@pytest.mark.slow
def test_first_calls_do_not_wait_for_a_compile_and_give_numpys_bits(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "numba-cache"
    cache.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=clean_env(NUMBA_CACHE_DIR=str(cache)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    # create_group and two pushes (one bfloat16) answered while numba compiled
    assert found["loading"] == [True, True]
    assert found["answered"] < 10.0
    assert found["fused"] == ["numba"]  # taken at the first step after the load
    assert found["same"] == [True, True, True]
    assert any(cache.rglob("*.nbi"))  # the compile filled the empty cache
