"""Where a replica's restart goes, and how long a shard runs with one copy less
(issue 36 item 3).

    python benchmarks/restart.py [--rounds 4] [--records 3000] [--large 30]
        [--large-elements 1000000] [--baseline REV [--new REV]] [--keep DIR]

Needs etcd (Debian's etcd-server; tests/_etcd.py starts one on free loopback ports).

Per side (this tree, and with ``--baseline REV`` that commit's checkout,
benchmarks/_baseline.py): a 2-replica shard, primary m0 and standby m1 (``--durability
wal --coordinator etcd://... --shard 0/1 --sync-replicas 1``), a group of 1,000
float32 and one of ``--large-elements``; ``--records`` small pushes and ``--large``
large ones, two thirds of each before the standby's snapshot (it is stopped with
SIGTERM once, which writes one) and a third after, so its log holds records before
its newest snapshot and after it. Then, ``--rounds`` times, with a warm kernel
cache (numba's ``NUMBA_CACHE_DIR``, filled by the side's first start) and a cold one
(an empty directory), in alternating order, each side in turn: the standby is killed
with SIGKILL and started again, and its start is timed from just before the process
is created to:

- ``python``: its first log line (Python, onnxps' imports, the flags);
- ``kernels``: "fused kernels ready" (the baseline waits for it before replaying;
  this tree loads them beside the rest: printed, off the path to ready);
- ``replayed``: "replayed N write-ahead log records" (N is printed);
- ``listening``: "onnxps listening on";
- ``following``: the primary's "standby m1 ... resumes after record" (its stream
  accepted);
- ``ready``: ``onnxps.ready`` SERVING on the standby's health service (polled every
  20 ms by this script): it holds what the primary logged.

Printed: each phase's time from start, median and min-max over rounds, per side and
cache; then ready's ratio (this tree / baseline). Also the time of ``python -c
"import onnxps.server.app"`` per side (median of 5). The servers share this host's
cores with this script and with each other; an idle primary costs little.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _baseline import Checkout, checkout, describe, tree_env  # noqa: E402
from _etcd import EtcdProcess, etcd_binary, free_port, start_etcd  # noqa: E402
from _procs import clean_env, stop  # noqa: E402
from onnxps.cli.process import wait_for_listening  # noqa: E402
from onnxps.client import Adagrad, Client  # noqa: E402

PHASES = ("python", "kernels", "replayed", "listening", "following", "ready")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)
REPLAYED = re.compile(r"replayed (\d+) write-ahead log records")


def _when(line: str) -> float:
    """The wall-clock time of a server log line (its asctime, this host's zone)."""
    found = STAMP.match(line)
    assert found is not None, line
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _lines(log: Path) -> list[str]:
    return [
        ln for ln in log.read_text(errors="replace").splitlines() if STAMP.match(ln)
    ]


class Side:
    """One checkout's shard: etcd prefix, primary m0, standby m1, warm cache dir."""

    def __init__(self, found: Checkout, etcd: EtcdProcess, tmp: Path) -> None:
        self.label, self.etcd = found.label, etcd
        self.tmp = tmp / found.label
        self.tmp.mkdir()
        self.prefix = f"restart-{found.label.replace('+', 'x')}"
        self.env = clean_env(PYTHONPATH=tree_env(found.tree)["PYTHONPATH"])
        self.warm = self.tmp / "numba-warm"
        self.ports = {i: free_port() for i in (0, 1)}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, Path] = {}
        self.starts = 0

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def start(self, i: int, cache: Path) -> float:
        """Start member ``i`` with numba's cache in ``cache``; returns the time just
        before the process was created."""
        self.starts += 1
        log = self.logs[i] = self.tmp / f"m{i}-{self.starts}.log"
        cmd = [
            sys.executable, "-m", "onnxps.cli", "serve",
            "--address", self.address(i),
            "--durability", "wal",
            "--data-dir", str(self.tmp / f"data{i}"),
            "--coordinator", self.etcd.url(self.prefix),
            "--shard", "0/1",
            "--member-id", f"m{i}",
            "--sync-replicas", "1",
            "--snapshot-interval", "0",
        ]  # fmt: skip
        env = dict(self.env, NUMBA_CACHE_DIR=str(cache))
        with open(log, "wb") as out:
            t0 = time.time()
            self.procs[i] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        return t0

    def wait_listening(self, i: int) -> None:
        wait_for_listening(self.procs[i], self.logs[i], timeout=300)

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()

    def terminate(self, i: int) -> None:
        self.procs[i].terminate()
        self.procs[i].wait(60)

    def close(self) -> None:
        for p in self.procs.values():
            stop(p)


def _ready_at(address: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    """When ``onnxps.ready`` first answers SERVING (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    # reconnect within a poll, not after gRPC's 1 s back-off
    backoff = [(f"grpc.{k}_reconnect_backoff_ms", 20) for k in ("initial", "min")]
    options = [*backoff, ("grpc.max_reconnect_backoff_ms", 40)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="onnxps.ready")
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the standby at {address} exited")
            try:
                got = stub.Check(request, timeout=0.5)
                if got.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.time()
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.02)
    raise RuntimeError(f"the standby at {address} was not ready in {timeout} s")


def _wait_line(log: Path, pattern: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if pattern in log.read_text(errors="replace") or proc.poll() is not None:
            return
        time.sleep(0.1)


def _push(side: Side, records: int, large: int, n_large: int) -> None:
    rng = np.random.default_rng(0)
    small_g = rng.standard_normal(1000).astype(np.float32)
    large_g = rng.standard_normal(n_large).astype(np.float32)
    url = side.etcd.url(side.prefix)
    with Client(url, timeout=120) as c:
        for k in range(records):
            c.push("small", small_g)
            if large and k % max(1, records // large) == 0:
                c.push("large", large_g)


def setup(side: Side, records: int, large: int, n_large: int) -> None:
    """The shard, its groups and records; the standby's snapshot after 2/3 of them."""
    side.start(0, side.warm)
    side.wait_listening(0)
    side.start(1, side.warm)
    side.wait_listening(1)
    _ready_at(side.address(1), side.procs[1], 120)
    with Client(side.etcd.url(side.prefix), timeout=120) as c:
        for name, n in (("small", 1000), ("large", n_large)):
            c.create_group(
                name,
                Adagrad(),
                learning_rate=0.1,
                tensors={"x": np.zeros(n, np.float32)},
            )
    before = records * 2 // 3
    _push(side, before, large * 2 // 3, n_large)
    side.terminate(1)  # a graceful stop: its last snapshot
    side.start(1, side.warm)
    side.wait_listening(1)
    _ready_at(side.address(1), side.procs[1], 120)
    _push(side, records - before, large - large * 2 // 3, n_large)


def restart(side: Side, cache: Path) -> tuple[dict[str, float], int]:
    """Kill -9 the standby, start it again; (each phase's time from start, the
    records it replayed)."""
    side.kill(1)
    primary_log = side.logs[0]
    t0 = side.start(1, cache)
    ready = _ready_at(side.address(1), side.procs[1], 300) - t0
    # the kernels may still be loading (this tree): their time too
    _wait_line(side.logs[1], "fused kernels ready", side.procs[1])
    marks: dict[str, float] = {"ready": ready}
    replayed = 0
    lines = _lines(side.logs[1])
    if lines:
        marks["python"] = _when(lines[0]) - t0
    for line in lines:
        at = _when(line) - t0
        if "fused kernels ready" in line:
            marks.setdefault("kernels", at)
        elif (found := REPLAYED.search(line)) is not None:
            marks.setdefault("replayed", at)
            replayed = int(found.group(1))
        elif "onnxps listening on" in line:
            marks.setdefault("listening", at)
    for line in _lines(primary_log):
        if "standby m1 (" in line and _when(line) >= t0 - 0.001:
            if "resumes after record" in line or "sending snapshot" in line:
                marks.setdefault("following", _when(line) - t0)
    return marks, replayed


def _import_time(side: Side, times: int = 5) -> float:
    code = ["-c", "import onnxps.server.app"]
    subprocess.run([sys.executable, *code], env=side.env, check=True)  # .pyc files
    took = []
    for _ in range(times):
        t = time.perf_counter()
        subprocess.run([sys.executable, *code], env=side.env, check=True)
        took.append(time.perf_counter() - t)
    return statistics.median(took)


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):6.2f} ({min(values):5.2f}-{max(values):5.2f})"


@contextmanager
def _checkouts(baseline: str | None, new: str | None) -> Iterator[list[Checkout]]:
    with ExitStack() as stack:
        found = []
        if baseline is not None:
            found.append(stack.enter_context(checkout(baseline)))
        found.append(stack.enter_context(checkout(new)))
        yield found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--records", type=int, default=3000, help="small pushes")
    ap.add_argument("--large", type=int, default=30, help="large pushes")
    ap.add_argument("--large-elements", type=int, default=1_000_000)
    ap.add_argument("--baseline", help="a commit to compare with (its own checkout)")
    ap.add_argument("--new", help="the commit to measure (default: this tree)")
    ap.add_argument("--keep", type=Path, help="keep logs and data here")
    args = ap.parse_args()
    binary = etcd_binary()
    if binary is None:
        print("etcd is not installed (apt-get install etcd-server)", file=sys.stderr)
        return 2
    for name, rev in (("baseline", args.baseline), ("new", args.new)):
        if name == "new" or rev is not None:
            print(f"{name}: {describe(rev)}")
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="onnxps-restart-"))
    tmp.mkdir(parents=True, exist_ok=True)
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    replays: dict[str, list[int]] = {}
    with ExitStack() as stack:
        found = stack.enter_context(_checkouts(args.baseline, args.new))
        etcd = start_etcd(binary, tmp)
        stack.callback(etcd.stop)
        sides = [Side(f, etcd, tmp) for f in found]
        for side in sides:
            stack.callback(side.close)
        imports = {side.label: _import_time(side) for side in sides}
        for side in sides:
            t = time.perf_counter()
            setup(side, args.records, args.large, args.large_elements)
            print(f"{side.label}: set up in {time.perf_counter() - t:.1f} s")
        for r in range(args.rounds):
            caches = ("warm", "cold") if r % 2 == 0 else ("cold", "warm")
            order = sides if r % 2 == 0 else sides[::-1]
            for cache in caches:
                for side in order:
                    where = side.warm
                    if cache == "cold":
                        where = Path(tempfile.mkdtemp(prefix="numba-", dir=side.tmp))
                    marks, replayed = restart(side, where)
                    if cache == "cold":
                        shutil.rmtree(where, ignore_errors=True)
                    replays.setdefault(side.label, []).append(replayed)
                    got = results.setdefault((side.label, cache), {})
                    for phase, at in marks.items():
                        got.setdefault(phase, []).append(at)
                    print(
                        f"round {r + 1} {side.label:>9} {cache}: "
                        + ", ".join(f"{p} {marks[p]:.2f}" for p in PHASES if p in marks)
                    )
    print()
    print("python -c 'import onnxps.server.app', median of 5:")
    for label, took in imports.items():
        print(f"  {label:>9}: {took:.2f} s")
    print()
    print(
        f"standby restart, s from the process's start: median (min-max) over "
        f"{args.rounds} rounds"
    )
    print(f"{'side':>9} {'cache':>5} " + " ".join(f"{p:>18}" for p in PHASES))
    for (label, cache), got in results.items():
        cells = " ".join(f"{_fmt(got.get(p, [])):>18}" for p in PHASES)
        print(f"{label:>9} {cache:>5} {cells}")
    print()
    for label, counts in replays.items():
        print(f"records replayed per restart, {label}: {sorted(set(counts))}")
    if len(sides) == 2:
        base, new = sides[0].label, sides[1].label
        for cache in ("warm", "cold"):
            b = statistics.median(results[(base, cache)]["ready"])
            n = statistics.median(results[(new, cache)]["ready"])
            print(f"ready, {cache} cache: {new} / {base} = {n / b:.2f} ({n:.2f} s)")
    if args.keep is None:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
