"""A cluster of 1 shard vs 2 shards, side by side in one run (rounds alternate).

    python benchmarks/cluster.py [--seconds 5] [--rounds 3] [--big-mib 256]

Shards are ``onnxps serve --shard I/N`` processes on loopback with no other flag (their
defaults: snapshot durability, each in a folder of its own); clients are
``Client([addresses])`` with no option (the same code path for 1 and 2 shards): what
a user gets.

- small pushes/s: 8 client processes push 1,000-element float32 Adam gradients to
  64 groups (spread over the shards by placement) for ``--seconds``; the count of
  acknowledged pushes over the time.
- server CPU per push: user+system CPU seconds of the shard processes (their own
  counters, /proc/<pid>/stat fields 14 and 15) over the same window, divided by the
  pushes.
- the same at an equal load per shard (``--paced``, pushes/s per shard): the clients
  pace themselves so that 1 shard and each of 2 shards serve the same rate, below
  saturation. Saturated, 2 shards on 2 shared cores each run at half the rate, so
  their fixed per-wakeup costs are spread over fewer pushes; paced, each shard sees
  what it would see on its own host, and the CPU per push compares like with like.
  The shards' idle CPU over an equal window is measured and subtracted.
- big step: push then pull of a ``--big-mib`` float32 Adam group from one client,
  whole on 1 shard vs split in 2 parts on 2 shards; median of 3 steps.

Then a projection for 8 shard hosts from the measured per-push CPU and bytes (its
assumptions are printed with it). This machine has 2 cores shared by clients and
shards: read the CPU per push and the ratios, not the absolute rates.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _proc import cpu_seconds
from onnxps.cli.process import start_default_server, stop_processes
from onnxps.client import Adam, Client

CLIENTS = 8
GROUPS = 64
SMALL = 1_000


class Cluster:
    def __init__(self, shards: int, tmp: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        for i in range(shards):
            proc, address = start_default_server(
                tmp / f"c{shards}-s{i}",
                "--shard",
                f"{i}/{shards}",
                log=tmp / f"c{shards}-s{i}.log",
            )
            self.procs.append(proc)
            self.addresses.append(address)

    def cpu(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs)

    def close(self) -> None:
        stop_processes(self.procs, timeout=60)  # each writes its snapshot


def _pusher(
    addresses: list[str],
    index: int,
    interval: float,
    go: Any,
    stop: Any,
    out: Any,
    ready: Any,
) -> None:
    g = np.random.default_rng(index).standard_normal(SMALL).astype(np.float32)
    n = 0
    with Client(addresses, client_id=f"bench-{index}", timeout=60) as ps:
        for k in range(GROUPS):  # learn every layout before the clock starts
            ps.describe_group(f"small-{k}")
        ready.put(index)
        go.wait()
        k = index
        start = time.perf_counter() + index * interval / CLIENTS  # spread the clients
        while not stop.is_set():
            if interval:  # paced: the n-th push is due at start + n * interval
                due = start + n * interval - time.perf_counter()
                if due > 0:
                    time.sleep(due)
            ps.push(f"small-{k % GROUPS}", g)
            n += 1
            k += 1
    out.put(n)


def idle_cpu(cluster: Cluster, seconds: float) -> float:
    """The shards' CPU seconds over ``seconds`` with no client calling."""
    cpu0 = cluster.cpu()
    time.sleep(seconds)
    return cluster.cpu() - cpu0


def small_pushes(
    cluster: Cluster, seconds: float, per_shard: float = 0.0
) -> tuple[float, float]:
    """(pushes/s, server CPU seconds per push) with CLIENTS processes; paced at
    ``per_shard`` pushes/s per shard in all when given, else as fast as they can."""
    ctx = mp.get_context("spawn")
    go, stop, out, ready = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Queue()
    interval = CLIENTS / (per_shard * len(cluster.procs)) if per_shard else 0.0
    procs = [
        ctx.Process(
            target=_pusher,
            args=(cluster.addresses, i, interval, go, stop, out, ready),
        )
        for i in range(CLIENTS)
    ]
    for p in procs:
        p.start()
    for _ in procs:  # every client started, connected, and knows every layout
        ready.get(timeout=120)
    cpu0, t0 = cluster.cpu(), time.perf_counter()
    go.set()
    time.sleep(seconds)
    stop.set()
    pushes = sum(out.get(timeout=60) for _ in procs)
    elapsed, cpu = time.perf_counter() - t0, cluster.cpu() - cpu0
    for p in procs:
        p.join()
    return pushes / elapsed, cpu / pushes


def big_step(cluster: Cluster, grad: np.ndarray) -> float:
    """Median seconds of push + pull of the big group."""
    times = []
    with Client(cluster.addresses, timeout=600) as ps:
        ps.pull("big")  # connect and learn the layout
        for _ in range(3):
            t0 = time.perf_counter()
            ps.push("big", grad)
            ps.pull("big")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def setup(cluster: Cluster, big_elements: int) -> int:
    with Client(cluster.addresses, timeout=600) as ps:
        for k in range(GROUPS):
            ps.create_group(
                f"small-{k}",
                Adam(),
                learning_rate=0.01,
                tensors={"w": np.zeros(SMALL, np.float32)},
            )
        info = ps.create_group(
            "big",
            Adam(),
            learning_rate=0.01,
            tensors={"w": np.zeros(big_elements, np.float32)},
        )
        return len(info.parts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--big-mib", type=int, default=256)
    p.add_argument(
        "--paced",
        type=float,
        default=100.0,
        help="pushes/s per shard for the equal-load CPU figure (0: skip it)",
    )
    args = p.parse_args()
    big_elements = args.big_mib * (1 << 20) // 4
    grad = np.random.default_rng(0).standard_normal(big_elements).astype(np.float32)
    rows: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
    with tempfile.TemporaryDirectory() as tmp:
        clusters = {n: Cluster(n, Path(tmp)) for n in (1, 2)}
        try:
            parts = {n: setup(c, big_elements) for n, c in clusters.items()}
            for r in range(args.rounds):
                for n, c in clusters.items():  # alternate: 1 shard, 2 shards, ...
                    rate, cpu = small_pushes(c, args.seconds)
                    step = big_step(c, grad)
                    got = {"rate": rate, "cpu": cpu, "step": step}
                    if args.paced:
                        idle = idle_cpu(c, args.seconds)
                        prate, pcpu = small_pushes(c, args.seconds, args.paced)
                        pushes = prate * args.seconds
                        got |= {"prate": prate, "pcpu": pcpu}
                        got["pnet"] = max(pcpu - idle / pushes, 0.0)
                    for key, v in got.items():
                        rows[n].setdefault(key, []).append(v)
                    paced = (
                        f"; paced {got['prate']:.0f} pushes/s, "
                        f"{got['pcpu'] * 1e6:.0f} us CPU/push "
                        f"({got['pnet'] * 1e6:.0f} net of idle)"
                        if args.paced
                        else ""
                    )
                    print(
                        f"round {r} shards {n}: {rate:7.0f} pushes/s, "
                        f"{cpu * 1e6:6.0f} us CPU/push, big step {step:.2f} s{paced}",
                        flush=True,
                    )
        finally:
            for c in clusters.values():
                c.close()
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
    print()
    print("| | 1 shard | 2 shards | 2 vs 1 |")
    print("|---|---:|---:|---:|")
    print(
        f"| small pushes/s ({CLIENTS} client processes) | {med[1]['rate']:.0f} | "
        f"{med[2]['rate']:.0f} | {med[2]['rate'] / med[1]['rate']:.2f}x |"
    )
    print(
        f"| server CPU per push (us) | {med[1]['cpu'] * 1e6:.0f} | "
        f"{med[2]['cpu'] * 1e6:.0f} | {med[2]['cpu'] / med[1]['cpu']:.2f}x |"
    )
    if args.paced:
        for key, what in (("pcpu", "as measured"), ("pnet", "net of idle")):
            print(
                f"| server CPU per push at {args.paced:.0f} pushes/s per shard (us, "
                f"{what}) | {med[1][key] * 1e6:.0f} | {med[2][key] * 1e6:.0f} | "
                f"{med[2][key] / med[1][key]:.2f}x |"
            )
        print(
            f"| paced pushes/s in all (offered {args.paced:.0f} per shard) | "
            f"{med[1]['prate']:.0f} | {med[2]['prate']:.0f} | "
            f"{med[2]['prate'] / med[1]['prate']:.2f}x |"
        )
    print(
        f"| push+pull {args.big_mib} MiB ({parts[1]} vs {parts[2]} parts), s | "
        f"{med[1]['step']:.2f} | {med[2]['step']:.2f} | "
        f"{med[1]['step'] / med[2]['step']:.2f}x faster |"
    )
    project(med, args.big_mib)


def project(med: dict[int, dict[str, float]], big_mib: int) -> None:
    # Saturated CPU per push: a shard on its own host runs saturated at its peak
    # rate (the paced figures carry each wakeup's fixed cost over fewer pushes).
    cpu = max(med[1]["cpu"], med[2]["cpu"])
    per_host = 1 / cpu
    push_bytes = SMALL * 4 + 200  # gradient + request/reply framing, about
    hosts = 8
    print()
    print(f"Projection for {hosts} shard hosts (one shard process per host):")
    print(
        f"- small pushes: {cpu * 1e6:.0f} us of server CPU per push -> about "
        f"{per_host:.0f} pushes/s per shard (one core: the GIL), {hosts * per_host:.0f}"
        f" pushes/s for {hosts} hosts, {hosts * per_host * push_bytes / 1e6:.0f} MB/s"
        " of gradients in all"
    )
    step = med[1]["step"]
    print(
        f"- a {big_mib} MiB group split in {hosts}: each shard moves "
        f"{big_mib / hosts:.0f} MiB per push and per pull; if a shard's rate is the "
        f"one measured here ({2 * big_mib / step:.0f} MiB/s through one shard), the "
        f"step takes about {step / hosts:.2f} s, unless the client's own link is "
        f"slower: {2 * big_mib} MiB per step at 10 Gb/s is "
        f"{2 * big_mib * 8 / 10240:.2f} s"
    )
    print(
        "- assumes: workers on other hosts (here they share the 2 cores), a network "
        "that carries the bytes, groups spread evenly (rendezvous placement of many "
        "groups), and per-push cost independent of the shard count (the table's "
        "CPU-per-push rows check that, saturated and at an equal paced load)"
    )


if __name__ == "__main__":
    main()
