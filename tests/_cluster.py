"""Sharded clusters of ``onnxps serve`` processes (``shards``) and the optimizers the
cluster tests split groups with. Moved here from test_cluster.py so that no test module
imports another."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _procs import start_server, stop
from onnxps.client import (
    Adagrad,
    Adam,
    Momentum,
    Nesterov,
    OptimizerSpec,
)

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adagrad": Adagrad(epsilon=1e-7, decay_factor=0.01, norm_coefficient=0.001),
    "momentum": Momentum(alpha=0.9, beta=0.5, norm_coefficient=0.01),
    "nesterov": Nesterov(alpha=0.9, beta=1.0),
    "adam": Adam(norm_coefficient=0.01, norm_coefficient_post=0.001),
}


@contextmanager
def shards(
    tmp: Path, count: int, *args: str, tag: str = "s"
) -> Iterator[tuple[list[str], list[subprocess.Popen[bytes]]]]:
    """``count`` shard processes; their addresses (in shard order) and processes."""
    procs: list[subprocess.Popen[bytes]] = []
    addresses = []
    try:
        for i in range(count):
            extra = [a.replace("{i}", str(i)) for a in args]
            proc, address = start_server(
                tmp / f"{tag}{i}.log", "--shard", f"{i}/{count}", *extra
            )
            procs.append(proc)
            addresses.append(address)
        yield addresses, procs
    finally:
        for p in procs:
            stop(p)
