"""What durability costs: push throughput and latency per mode, snapshot/restore time.

    python benchmarks/durability.py [--seconds 3] [--gib 1.0]

Part 1 runs a server process per mode (first ``no flags``: ``onnxps serve`` with
its defaults, snapshots every 300 s, what a user gets; then none = memory only, the
baseline; snapshot with a snapshot every second; wal) and pushes from concurrent
client threads to a 1,000-element and a 16 MiB float32 Adam group, printing pushes/s
and p50/p99 push latency, and each mode's throughput relative to memory-only.

Part 2 snapshots and restores about 1 GiB of state (four Adam groups, X+V+H) with the
server's own code, beside a plain ``np.save`` + fsync / ``np.load`` of the same arrays.

A/B of one cell against another checkout, in alternating rounds (the spread is the
lowest and highest round)::

    python benchmarks/durability.py --modes wal --cases small --skip-restore \
        --baseline /path/to/old --rounds 5

``--baseline`` is a directory holding an ``onnxps`` package (``onnxps/__init__.py``
and ``onnxps/{server,client,v1}`` linked to the old checkout's folders); the server
processes of the A rounds import it first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from onnxps.cli.process import start_default_server, stop_processes
from onnxps.client import Adam, Client
from onnxps.server.durability import Durability
from onnxps.server.kernels import make_attrs
from onnxps.server.store import ParameterStore

SERVER = r"""
import signal, sys, threading
from onnxps.server.app import ServerConfig, create_server
mode, data_dir = sys.argv[1], sys.argv[2]
config = ServerConfig(address="127.0.0.1:0", durability=mode,
                      data_dir=data_dir if mode != "none" else None,
                      snapshot_interval=1.0, threads=32)
handle = create_server(config).start()
print(handle.port, flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
done.wait()
handle.stop(grace=1)
"""

# key -> (label, n, clients)
CASES = {"small": ("1,000 elements", 1000, 8), "large": ("16 MiB", 4 << 20, 4)}


def _load(address: str, n: int, clients: int, seconds: float) -> tuple[float, list]:
    with Client(address) as c:
        c.create_group(
            "g", Adam(), learning_rate=0.01, tensors={"w": np.zeros(n, "f4")}
        )
    grad = np.full(n, 1e-3, np.float32)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    deadline = [0.0]

    def worker(i: int) -> None:
        with Client(address, timeout=60) as c:
            c.describe_group("g")
            start.wait()
            while time.perf_counter() < deadline[0]:
                t0 = time.perf_counter()
                c.push("g", grad)
                latencies[i].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    deadline[0] = time.perf_counter() + seconds + 0.05
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    flat = sorted(x for lat in latencies for x in lat)
    return len(flat) / elapsed, flat


def _cell(
    mode: str, n: int, clients: int, seconds: float, src: str | None = None
) -> tuple[float, list]:
    """One server process in ``mode`` (importing onnxps from ``src`` first, if
    given) under push load: (pushes/s, sorted latencies)."""
    if mode == "no flags":
        return _default_cell(n, clients, seconds)
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as data:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, mode, os.path.join(data, "d")],
            stdout=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None
        address = f"127.0.0.1:{int(proc.stdout.readline())}"
        try:
            return _load(address, n, clients, seconds)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            proc.stdout.close()


def _default_cell(n: int, clients: int, seconds: float) -> tuple[float, list]:
    """``_cell`` for ``onnxps serve`` with no flags (in a folder of its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_default_server(Path(tmp), log=Path(tmp) / "server.log")
        try:
            return _load(address, n, clients, seconds)
        finally:
            stop_processes([proc], timeout=60)


def part1(seconds: float, modes: list[str], cases: list[str]) -> None:
    print(
        f"Push load, {seconds:.0f} s per cell, Adam float32, server in its own process"
    )
    header = f"{'group':<15} {'mode':<10} {'clients':>7} {'pushes/s':>10} "
    header += f"{'p50 ms':>8} {'p99 ms':>8} {'vs none':>8}"
    print(header)
    for key, (label, n, clients) in CASES.items():
        if key not in cases:
            continue
        cells = {mode: _cell(mode, n, clients, seconds) for mode in modes}
        base = cells["none"][0] if "none" in cells else next(iter(cells.values()))[0]
        for mode, (rate, lat) in cells.items():
            p50 = lat[len(lat) // 2] * 1e3
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3
            print(
                f"{label:<15} {mode:<10} {clients:>7} {rate:>10.1f} {p50:>8.2f} "
                f"{p99:>8.2f} {rate / base:>7.2f}x"
            )


def ab(
    seconds: float, modes: list[str], cases: list[str], baseline: str, rounds: int
) -> None:
    """Each cell with the ``baseline`` checkout (A) and this one (B), alternating."""
    print(f"A/B, {rounds} alternating rounds of {seconds:.0f} s; A = {baseline}")
    for key, (label, n, clients) in CASES.items():
        if key not in cases:
            continue
        for mode in modes:
            rates: dict[str, list[float]] = {"A": [], "B": []}
            for r in range(rounds):
                order = ("A", "B") if r % 2 == 0 else ("B", "A")
                for side in order:
                    src = baseline if side == "A" else None
                    rates[side].append(_cell(mode, n, clients, seconds, src)[0])
                print(
                    f"  round {r + 1}: A {rates['A'][-1]:8.1f}  B {rates['B'][-1]:8.1f}"
                    " pushes/s"
                )
            a, b = statistics.median(rates["A"]), statistics.median(rates["B"])
            print(
                f"{label} {mode} {clients} clients: A median {a:.1f} "
                f"[{min(rates['A']):.1f}, {max(rates['A']):.1f}], B median {b:.1f} "
                f"[{min(rates['B']):.1f}, {max(rates['B']):.1f}] pushes/s; "
                f"B/A {b / a:.2f}x"
            )


def _fsync_save(path: str, a: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, a, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def part2(gib: float) -> None:
    groups = 4
    n = int(gib * (1 << 30) / 4 / 3 / groups)  # float32 X, V, H
    store = ParameterStore()
    rng = np.random.default_rng(0)
    for i in range(groups):
        x = rng.standard_normal(n, dtype=np.float32)
        store.create_group(
            f"g{i}",
            make_attrs("Adam"),
            0.01,
            [("w", x)],
            state=[x.copy(), np.abs(x)],
            update_count=7,
        )
    total = store.total_state_bytes()
    print(f"\nSnapshot and restore of {total / (1 << 30):.2f} GiB ({groups} groups)")
    with tempfile.TemporaryDirectory() as root:
        d = Durability(store, os.path.join(root, "data"), mode="snapshot")
        d.open()
        t0 = time.perf_counter()
        d.snapshot()
        snap = time.perf_counter() - t0
        d.close()

        restored = ParameterStore()
        t0 = time.perf_counter()
        d2 = Durability(restored, os.path.join(root, "data"), mode="snapshot")
        d2.open()
        restore = time.perf_counter() - t0
        d2.close()
        pulled = {
            g.name: store.pull(g.name, with_state=True).arrays for g in store.groups()
        }
        for name, want in pulled.items():
            got = restored.pull(name, with_state=True).arrays
            assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        del restored

        arrays = [a for held in pulled.values() for a in held]
        base = Path(root, "plain")
        base.mkdir()
        t0 = time.perf_counter()
        for k, a in enumerate(arrays):
            _fsync_save(str(base / f"{k}.npy"), a)
        save = time.perf_counter() - t0
        t0 = time.perf_counter()
        loaded = [np.load(base / f"{k}.npy") for k in range(len(arrays))]
        load = time.perf_counter() - t0
        del loaded
    gbs = total / (1 << 30)
    print(f"{'operation':<42} {'seconds':>8} {'GiB/s':>7} {'vs np':>6}")
    rows = [
        ("snapshot (copy under lock, sha256, fsync)", snap, save),
        ("np.save + fsync of the same arrays", save, save),
        ("restore (read, verify sha256, install)", restore, load),
        ("np.load of the same arrays", load, load),
    ]
    for name, secs, ref in rows:
        print(f"{name:<42} {secs:>8.2f} {gbs / secs:>7.2f} {secs / ref:>5.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument(
        "--modes",
        default="no flags,none,snapshot,wal",
        help="part 1's modes ('no flags': onnxps serve with its defaults)",
    )
    p.add_argument("--cases", default="small,large", help="part 1's groups")
    p.add_argument("--skip-restore", action="store_true", help="skip part 2")
    p.add_argument("--baseline", help="A/B part 1 against this onnxps directory")
    p.add_argument("--rounds", type=int, default=5, help="A/B rounds")
    args = p.parse_args()
    modes, cases = args.modes.split(","), args.cases.split(",")
    if args.baseline:
        ab(args.seconds, modes, cases, args.baseline, args.rounds)
    else:
        part1(args.seconds, modes, cases)
    if not args.skip_restore:
        part2(args.gib)


if __name__ == "__main__":
    main()
