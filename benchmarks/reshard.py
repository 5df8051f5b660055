"""What a live resharding costs (issue 39, docs/resharding.md).

    python benchmarks/reshard.py [--rounds 3] [--groups 20] [--elements 65536]
        [--workers 4] [--window 4] [--copy-under-fence]
    python benchmarks/reshard.py --mib 64 [--rounds 3]

Needs etcd (Debian's etcd-server; tests/_etcd.py starts one on free loopback ports).

A cluster of 2 shards found through etcd (one member each, ``--durability wal``,
``--sync-replicas 0``) holds ``--groups`` Adagrad groups of ``--elements`` float32
(a quarter of them split in 2 parts); ``--workers`` threads, each with its own
client, push to them in turn. Each round: the workers' pushes per second over
``--window`` seconds with nothing moving ("before"), then while ``onnxps reshard``
grows the cluster to 3 shards ("during"), then again before and during the shrink
back to 2. Printed per round and as medians over rounds (min-max spread): the
longest time a group's writes were held in its cutover (median and max over the
groups moved), the pushes/s before and during, and the bytes moved against the
ideal 1/3 of the state (growing 2 -> 3). ``--copy-under-fence``: every group is
copied whole under the fence (the default follows the source's log first).

``--mib N``: one Adagrad group of N MiB of X (2N MiB with its H, not split) that
growing 2 -> 3 moves, while a worker pushes rows of it (64 rows a push); each
round moves it there and back twice, once followed and once copied under the
fence, in alternating order. Printed: the writes held per cutover and the bytes
sent while held, per way (median, min-max spread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _etcd import etcd_binary, start_etcd  # noqa: E402
from _reshard import EtcdCluster  # noqa: E402
from onnxps.cli.reshard import reshard, target_shard  # noqa: E402
from onnxps.client import Adagrad  # noqa: E402


def _groups(c: Any, n: int, elements: int) -> list[str]:
    names = []
    for i in range(n):
        name = f"g{i}"
        size = elements * 2 if i % 4 == 0 else elements  # split by the client
        c.create_group(
            name,
            Adagrad(epsilon=1e-7),
            learning_rate=0.01,
            tensors={"w": np.zeros(size, np.float32)},
        )
        names.append(name)
    return names


class Pushers:
    def __init__(self, cluster: EtcdCluster, names: list[str], workers: int) -> None:
        self.count = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(cluster, names[w::workers], w))
            for w in range(workers)
        ]

    def _run(self, cluster: EtcdCluster, mine: list[str], w: int) -> None:
        try:
            with cluster.connect(client_id=f"w{w}", timeout=60) as c:
                grads = {n: np.full(c.describe_group(n).element_count, 0.1, np.float32)
                         for n in mine}  # fmt: skip
                step = 0
                while not self._stop.is_set():
                    name = mine[step % len(mine)]
                    c.push(name, grads[name])
                    step += 1
                    with self._lock:
                        self.count += 1
        except BaseException as exc:  # noqa: BLE001
            self.errors.append(exc)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def rate(self, seconds: float) -> float:
        start, t0 = self.count, time.monotonic()
        time.sleep(seconds)
        return (self.count - start) / (time.monotonic() - t0)


def _during(
    pushers: Pushers, url: str, shards: int, follow: bool = True
) -> tuple[float, Any]:
    start, t0 = pushers.count, time.monotonic()
    report = reshard(url, shards, timeout=30, follow=follow)
    return (pushers.count - start) / (time.monotonic() - t0), report


def _spread(xs: list[float], fmt: str = "{:.0f}") -> str:
    return (
        f"{fmt.format(statistics.median(xs))} "
        f"({fmt.format(min(xs))}-{fmt.format(max(xs))})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--groups", type=int, default=20)
    p.add_argument("--elements", type=int, default=65536)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--window", type=float, default=4.0)
    p.add_argument("--copy-under-fence", action="store_true")
    p.add_argument("--mib", type=int, default=0)
    args = p.parse_args()
    if args.mib:
        big(args)
        return
    binary = etcd_binary()
    if binary is None:
        sys.exit("etcd is not installed: apt-get install -y etcd-server")
    tmp = Path(tempfile.mkdtemp(prefix="onnxps-reshard-bench-"))
    etcd = start_etcd(binary, tmp)
    cluster = EtcdCluster(tmp, etcd)
    # split groups of 2 x elements float32 in 2 parts
    split_bytes = args.elements * 4 + 1
    holds: list[float] = []
    before: list[float] = []
    during: list[float] = []
    moved_ratio: list[float] = []
    try:
        cluster.start(0, 2)
        cluster.start(1, 2)
        cluster.start(2, 3)
        with cluster.connect(split_bytes=split_bytes) as admin:
            names = _groups(admin, args.groups, args.elements)
            state = sum(g.state_bytes for g in admin.list_groups())
        pushers = Pushers(cluster, names, args.workers)
        pushers.start()
        time.sleep(1.0)
        print(f"{args.groups} groups, {state / 2**20:.1f} MiB of state, "
              f"{args.workers} workers")  # fmt: skip
        for r in range(args.rounds):
            for shards in (3, 2):
                rate_before = pushers.rate(args.window)
                rate_during, report = _during(
                    pushers, cluster.url, shards, not args.copy_under_fence
                )
                held = [m.held_seconds for m in report.moves]
                moved = sum(m.bytes for m in report.moves)
                holds += held
                before.append(rate_before)
                during.append(rate_during)
                if shards == 3:
                    moved_ratio.append(moved / (state / 3))
                print(
                    f"round {r + 1}, 2 <-> 3 to {shards}: {len(report.moves)} moved, "
                    f"{moved / 2**20:.2f} MiB (ideal {state / 3 / 2**20:.2f} MiB "
                    f"when growing), held median "
                    f"{statistics.median(held) * 1000:.0f} ms max "
                    f"{max(held) * 1000:.0f} ms; pushes/s before {rate_before:.0f}, "
                    f"during {rate_during:.0f}",
                    flush=True,
                )
        pushers.stop()
        if pushers.errors:
            print(f"worker errors: {pushers.errors[:3]}")
        ratios = [d / b for d, b in zip(during, before, strict=True)]
        print()
        print(
            f"writes held per group (ms), {len(holds)} cutovers: median "
            f"{statistics.median(holds) * 1000:.0f}, max {max(holds) * 1000:.0f}"
        )
        print(
            f"pushes/s before: {_spread(before)}; during: {_spread(during)}; "
            f"ratio {_spread(ratios, '{:.2f}')}"
        )
        print(f"bytes moved growing 2 -> 3 / ideal 1/3 of the state: "
              f"{_spread(moved_ratio, '{:.2f}')}")  # fmt: skip
    finally:
        cluster.close()
        etcd.stop()


def big(args: argparse.Namespace) -> None:
    """``--mib``: one large group moved followed and under the fence, alternating."""
    binary = etcd_binary()
    if binary is None:
        sys.exit("etcd is not installed: apt-get install -y etcd-server")
    tmp = Path(tempfile.mkdtemp(prefix="onnxps-reshard-bench-"))
    etcd = start_etcd(binary, tmp)
    cluster = EtcdCluster(tmp, etcd)
    cols = 64
    rows = args.mib * 2**20 // (4 * cols)
    name = next(
        f"big{i}"
        for i in range(100)
        if target_shard(f"big{i}", 2) == 0 and target_shard(f"big{i}", 3) == 2
    )
    held: dict[bool, list[float]] = {True: [], False: []}
    fenced: dict[bool, list[float]] = {True: [], False: []}
    stop = threading.Event()
    pushes = [0]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with cluster.connect(client_id="w", timeout=60, split_bytes=1 << 40) as c:
                rng = np.random.default_rng(0)
                g = rng.standard_normal((64, cols)).astype(np.float32)
                while not stop.is_set():
                    ids = rng.integers(0, rows, 64)
                    c.push_rows(name, {"w": (ids, g)})
                    pushes[0] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        cluster.start(0, 2)
        cluster.start(1, 2)
        cluster.start(2, 3)
        with cluster.connect(split_bytes=1 << 40) as admin:
            admin.create_group(
                name,
                Adagrad(epsilon=1e-7),
                learning_rate=0.01,
                tensors={"w": np.zeros((rows, cols), np.float32)},
            )
        worker = threading.Thread(target=work)
        worker.start()
        time.sleep(1.0)
        print(f"one group of {args.mib} MiB of X (+ H), row pushes of 64 rows")
        for r in range(args.rounds):
            for follow in (True, False) if r % 2 == 0 else (False, True):
                for shards in (3, 2):
                    report = reshard(cluster.url, shards, timeout=60, follow=follow)
                    (m,) = report.moves
                    held[follow].append(m.held_seconds)
                    fenced[follow].append(m.fenced_bytes)
                    way = "followed" if follow else "copy under fence"
                    print(
                        f"round {r + 1}, {way}, to {shards} shards: held "
                        f"{m.held_seconds * 1000:.0f} ms, {m.fenced_bytes} bytes "
                        f"sent while held of {m.bytes}; pushes {pushes[0]}",
                        flush=True,
                    )
        stop.set()
        worker.join()
        if errors:
            print(f"worker errors: {errors[:3]}")
        print()
        for follow in (True, False):
            way = "followed        " if follow else "copy under fence"
            print(
                f"{way}: writes held (ms) {_spread([h * 1000 for h in held[follow]])}, "
                f"bytes sent while held {_spread(fenced[follow])}"
            )
    finally:
        stop.set()
        cluster.close()
        etcd.stop()


if __name__ == "__main__":
    main()
