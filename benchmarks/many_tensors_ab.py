"""A/B: a group of many small tensors against one big tensor, this tree against an
older commit, client and server of the same version, in one run.

    python benchmarks/many_tensors_ab.py [--baseline main] [--rounds 5] [--reps 20]
                                         [--tensors 200] [--elements 1000] [--new REV]
                                         [--kinds "push + pull,push,pull,step (store)"]
                                         [--no-flags-over-tcp]

Two float32 Adam groups hold the same number of elements: ``--tensors`` tensors of
``--elements`` each ("many") and one tensor of all of them ("one"). Each side is
its own checkout (``_baseline``) with its own ``onnxps serve`` (``--durability
none``) and a worker process for its client (gRPC unary: ``shared_memory="off",
data_channel="off"``). A round measures, on each side, the median of ``--reps``
calls of: push + pull, push alone, pull alone (wall time in the worker), and a
step alone at the store level (``ParameterStore.push`` in the worker's own
process, gradients as a transport hands them over), as wall time and as CPU time
of the worker and its server process together (less disturbed by a shared
machine's load), with the client's and the server's CPU and each one's minor page
faults also given apart. ``--no-flags-over-tcp``: the worker's client is
``Client(address)`` with no flags and each side's server is ``onnxps serve`` with no
flags in a /dev/shm of its own (``paths.py``'s "no flags over TCP" row: needs
root), so the calls go over TCP as between two hosts. The side that goes first
alternates each round; round 0 warms up (the servers run with
``ONNXPS_KERNELS=numba`` where numba is installed, so their first step waits for the
fused kernels instead of a server compiling them in the background during the
measured rounds: without it one run had one side's server at 2.5x the other's CPU
for a call whose server code was the same on both). Prints medians over rounds
with their spreads (min-max), the many/one ratios, and new/old.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _baseline import Worker, checkout, describe, serve_requests, tree_env
from paths import _start_apart

KINDS = ("push + pull", "push", "pull", "step (store)")


def _worker(address: str, tensors: int, elements: int, flags: str) -> None:
    import numpy as np
    from onnxps.client import Adam, Client
    from onnxps.server.kernels import make_attrs
    from onnxps.server.store import ParameterStore

    try:  # this tree: a transport hands the store one flat buffer
        from onnxps.server.store._flat import FlatArrays
    except ImportError:  # an older tree: a list of arrays
        FlatArrays = None  # noqa: N806

    rng = np.random.default_rng(0)
    shapes = {"many": [elements] * tensors, "one": [elements * tensors]}
    values = {
        k: {f"t{i}": rng.standard_normal(n, np.float32) for i, n in enumerate(s)}
        for k, s in shapes.items()
    }
    grads = {k: [np.full(n, 1e-3, np.float32) for n in s] for k, s in shapes.items()}
    store = ParameterStore()
    if flags == "none":
        c = Client(address, timeout=600)
    else:
        c = Client(address, shared_memory="off", data_channel="off", timeout=600)
    for k in shapes:
        c.create_group(k, Adam(), learning_rate=1e-3, tensors=values[k])
        store.create_group(k, make_attrs("Adam", {}), 1e-3, list(values[k].items()))

    def store_grads(k: str) -> Any:
        if FlatArrays is None or len(grads[k]) == 1:
            return grads[k]
        flat = np.concatenate(grads[k])
        views, pos = [], 0
        for g in grads[k]:
            views.append(flat[pos : pos + g.size])
            pos += g.size
        return FlatArrays(views, flat)

    flat_grads = {k: store_grads(k) for k in shapes}

    def one(kind: str, k: str) -> None:
        if kind in ("push + pull", "push"):
            c.push(k, *grads[k])
        if kind in ("push + pull", "pull"):
            c.pull(k)
        if kind == "step (store)":
            store.push(k, flat_grads[k])

    def call(kind: str, k: str, reps: int) -> dict[str, float]:
        got = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu = time.process_time()  # this process, all its threads
        for _ in range(reps):
            t0 = time.perf_counter()
            one(kind, k)
            got.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu) / reps
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return {"wall": statistics.median(got), "cpu": cpu, "faults": faults / reps}

    try:
        serve_requests(call, "ready")
    finally:
        c.close()


def _cell(values: list[float], digits: int = 3) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="main")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--elements", type=int, default=1000)
    p.add_argument("--new", help="measure this commit instead of the working tree")
    p.add_argument("--kinds", default=",".join(KINDS), help="what to measure")
    p.add_argument(
        "--no-flags-over-tcp",
        action="store_true",
        help="a client and servers with no flags, the servers in a /dev/shm of "
        "their own (needs root): the calls go over TCP",
    )
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        w = args.worker
        _worker(w[0], int(w[1]), int(w[2]), w[3])
        return 0
    from onnxps.cli.process import start_server_process, stop_processes

    kinds = [k for k in KINDS if k in args.kinds.split(",")]
    print(f"new: {describe(args.new)}\nold: {describe(args.baseline)}")
    # (side, kind, group) -> per-round medians in ms
    got: dict[tuple[str, str, str], list[float]] = {}
    cpus: dict[tuple[str, str, str], list[float]] = {}  # client + server CPU
    clients: dict[tuple[str, str, str], list[float]] = {}  # client CPU
    servers: dict[tuple[str, str, str], list[float]] = {}  # server CPU
    faults: dict[tuple[str, str, str], list[float]] = {}  # client minor faults
    server_faults: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with checkout(args.new) as new, checkout(args.baseline) as old:
            procs, workers = [], {}
            try:
                for side, tree in (("new", new), ("old", old)):
                    env = tree_env(tree.tree)
                    if importlib.util.find_spec("numba") is not None:
                        # the first step waits for the fused kernels (round 0's),
                        # instead of one side compiling them in the background
                        # while the other is measured
                        env = {**env, "ONNXPS_KERNELS": "numba"}
                    log = Path(tmp) / f"{side}.log"
                    if args.no_flags_over_tcp:
                        # (snapshot durability, as paths.py's "no flags" rows)
                        data = ["--durability", "snapshot", "--data-dir"]
                        data += [str(Path(tmp) / f"{side}-data")]
                        proc, address = _start_apart(*data, log=log, env=dict(env))
                    else:
                        proc, address = start_server_process(log=log, env=env)
                    procs.append(proc)
                    argv = [__file__, "--worker", address]
                    argv += [str(args.tensors), str(args.elements)]
                    argv += ["none" if args.no_flags_over_tcp else "grpc"]
                    workers[side] = Worker(tree, argv, Path(tmp) / f"{side}-w.log")
                pids = dict(zip(workers, (p.pid for p in procs), strict=True))
                clocks = {side: _cpu_clock(pid) for side, pid in pids.items()}
                for r in range(args.rounds + 1):
                    sides = ["new", "old"] if r % 2 == 0 else ["old", "new"]
                    for kind in kinds:
                        for side in sides:
                            for k in ("many", "one"):
                                server = time.clock_gettime(clocks[side])
                                sfaults = _minor_faults(pids[side])
                                ans = workers[side].call(kind, k, args.reps)
                                server = time.clock_gettime(clocks[side]) - server
                                sfaults = _minor_faults(pids[side]) - sfaults
                                if not r:
                                    continue
                                key = (side, kind, k)
                                got.setdefault(key, []).append(ans["wall"] * 1e3)
                                cpu = ans["cpu"] + server / args.reps
                                cpus.setdefault(key, []).append(cpu * 1e3)
                                clients.setdefault(key, []).append(ans["cpu"] * 1e3)
                                servers.setdefault(key, []).append(
                                    server / args.reps * 1e3
                                )
                                faults.setdefault(key, []).append(ans["faults"])
                                server_faults.setdefault(key, []).append(
                                    sfaults / args.reps
                                )
            finally:
                for w in workers.values():
                    w.close()
                stop_processes(procs)
    _report("wall ms", got, kinds, args)
    _report("CPU ms (client + server processes)", cpus, kinds, args)
    _report("client CPU ms", clients, kinds, args)
    _report("server CPU ms", servers, kinds, args)
    _report("client minor page faults", faults, kinds, args)
    _report("server minor page faults", server_faults, kinds, args)
    return 0


def _report(
    title: str,
    got: dict[tuple[str, str, str], list[float]],
    kinds: list[str],
    args: argparse.Namespace,
) -> None:
    many = f"{args.tensors} x {args.elements:,}"
    one = f"1 x {args.tensors * args.elements:,}"
    print(f"\n{title} a call ({args.reps} a round); median (min-max) of rounds")
    head = f"{'':14s} {'side':4s} {many:>22s} {one:>22s} {'many / one':>20s}"
    print(head)
    for kind in kinds:
        for side in ("new", "old"):
            a, b = got[(side, kind, "many")], got[(side, kind, "one")]
            ratio = [_ratio(x, y) for x, y in zip(a, b, strict=True)]
            print(
                f"{kind:14s} {side:4s} {_cell(a):>22s} {_cell(b):>22s} "
                f"{_cell(ratio, 2):>20s}"
            )
        for k, label in (("many", many), ("one", one)):
            a, b = got[("new", kind, k)], got[("old", kind, k)]
            wins = sum(x < y for x, y in zip(a, b, strict=True))
            ab = [_ratio(x, y) for x, y in zip(a, b, strict=True)]
            print(f"{'':14s} new/old, {label}: {_cell(ab, 2)}; less in {wins}/{len(a)}")


def _ratio(x: float, y: float) -> float:
    """x / y; NaN where y is 0 (a count such as no page faults at all)."""
    return x / y if y else float("nan")


def _minor_faults(pid: int) -> int:
    """The minor page faults process ``pid`` has taken (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


def _cpu_clock(pid: int) -> int:
    """The CPU-time clock of process ``pid`` (all its threads), for
    ``time.clock_gettime``."""
    clock = ctypes.c_int()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.clock_getcpuclockid(pid, ctypes.byref(clock)):
        raise OSError(ctypes.get_errno(), f"clock_getcpuclockid({pid})")
    return clock.value


if __name__ == "__main__":
    raise SystemExit(main())
