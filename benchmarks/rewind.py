"""What a rewind costs (issue 40), against a snapshot restore plus the replay of one
snapshot interval, in the same run; and what retention costs on disk per hour.

    python benchmarks/rewind.py [--mib 64] [--interval 50] [--rounds 3] [--keep DIR]

The issue's aim is a 256 MiB group rewound 1,000 steps back: ``--mib 256
--interval 1000`` (its log holds 2,000 records of 85 MiB: 170 GB of disk). The
defaults are scaled down so that the run takes a few minutes on a 2-core box: a
64 MiB group (X, V and H of Adam: 5.6 M float32 each, X 21 MiB) and a snapshot
every 50 steps. Say so with the figures.

One ``onnxps serve --durability wal`` process; one Adam group of ``--mib`` MiB.
A snapshot at T=0, ``--interval`` pushes, a snapshot at T=I, ``--interval`` pushes
more (T=2I). Then ``--rounds`` times, alternating:

- **rewind**: ``Client.rewind(g, to_step=I-1-r)``, timed by the client (and the
  server's own seconds): the nearest base is the snapshot at T=0, so the server
  reads the group's copy in it and replays I-1-r of the group's records (the worst
  case inside retention is one interval less one step), then logs the rewound
  state (a record the size of X, V and H) and installs it;
- **restore + replay**: what a restart does for that group, in this process: the
  snapshot at T=0 loaded and installed in a fresh store, then the log records of
  the next interval (I records) replayed through the store's replay path (the
  server's own code, ``onnxps.server.durability``), timed.

Printed: per round both times; their medians and min-max; the rewind's base and
records replayed. Then the push rate of the run, the log's bytes per push, and
the disk retention holds per hour of pushes at that rate (the log since the oldest
snapshot kept, with ``--keep-snapshots 3`` and a snapshot every I steps) and per
hour of log written.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from onnxps.cli.process import start_server_process
from onnxps.client import Adam, Client
from onnxps.server.durability._redo import redo
from onnxps.server.durability._snapshot import list_snapshots, load_snapshot
from onnxps.server.durability._walread import LogReader
from onnxps.server.store import ParameterStore


def restore_and_replay(data: Path, generation: int, records: int) -> float:
    """Seconds to load snapshot ``generation``, install it, and replay the next
    ``records`` log records through a fresh store (what a restart does)."""
    started = time.perf_counter()
    snaps = dict(list_snapshots(str(data / "snapshots")))
    manifest, groups = load_snapshot(snaps[generation])
    store = ParameterStore()
    for captured in groups:
        store.install(captured.image, captured.runtime)
    wal = str(data / "wal")
    done = 0
    for header, arrays in LogReader(wal, manifest.wal_lsn):
        redo(store, header, arrays, wal)
        done += 1
        if done == records:
            break
    elapsed = time.perf_counter() - started
    store.close()
    assert done == records, (done, records)
    return elapsed


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=64.0, help="group size (X, V, H)")
    p.add_argument("--interval", type=int, default=50, help="steps per snapshot")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--keep", help="keep the data directory here (default: a temp)")
    args = p.parse_args()
    n = int(args.mib * (1 << 20) / 4 / 3)  # float32 X, V, H
    interval = args.interval
    if args.rounds >= interval - 1:
        p.error("--rounds must be below --interval - 1")
    root = Path(args.keep or tempfile.mkdtemp(prefix="onnxps-rewind-"))
    data = root / "data"
    proc, address = start_server_process(
        "--durability", "wal", "--data-dir", str(data), "--snapshot-interval", "0",
        "--keep-snapshots", "3",
        log=root / "server.log",
    )  # fmt: skip
    print(
        f"group: Adam, {n:,} float32 per tensor (X {_size(4 * n)}, X+V+H "
        f"{_size(12 * n)}); a snapshot every {interval} steps; {args.rounds} rounds"
        + (" (scaled down from 256 MiB, 1,000 steps)" if args.mib < 256 else "")
    )
    try:
        with Client(address, timeout=600) as c:
            x0 = np.ones(n, np.float32)
            c.create_group("g", Adam(), learning_rate=0.001, tensors={"w": x0})
            c.save()
            rng = np.random.default_rng(40)
            grads = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
            started = time.perf_counter()
            for k in range(2 * interval):
                c.push("g", grads[k % 4])
                if k + 1 == interval:
                    c.save()
            push_seconds = time.perf_counter() - started
            rate = 2 * interval / push_seconds
            wal_bytes = sum(f.stat().st_size for f in (data / "wal").iterdir())
            per_push = wal_bytes / (2 * interval)
            # the kernels of this process load on its first replay: not timed
            restore_and_replay(data, 1, 1)
            rewinds, restores = [], []
            for r in range(args.rounds):
                target = interval - 1 - r
                t0 = time.perf_counter()
                done = c.rewind("g", to_step=target)
                rewinds.append(time.perf_counter() - t0)
                restores.append(restore_and_replay(data, 1, interval))
                said = [
                    line
                    for line in (root / "server.log").read_text().splitlines()
                    if "rewound group g" in line
                ][-1]
                print(
                    f"round {r + 1}: rewind to T={target} {rewinds[-1]:.3f} s "
                    f"(server {done.seconds:.3f} s; from the {done.base} at "
                    f"T={done.base_step}, {done.replayed} records replayed); "
                    f"restore + replay of {interval} records {restores[-1]:.3f} s\n"
                    f"  server: {said.split(': ', 1)[-1]}"
                )
        for name, xs in (("rewind", rewinds), ("restore + replay", restores)):
            print(
                f"{name}: median {statistics.median(xs):.3f} s "
                f"(min {min(xs):.3f}, max {max(xs):.3f})"
            )
        print(
            f"rewind / (restore + replay): "
            f"{statistics.median(rewinds) / statistics.median(restores):.2f}"
        )
        per_hour = rate * 3600 * per_push
        snapshot_bytes = 12 * n
        held = 3 * snapshot_bytes + 2 * interval * per_push  # keep 3: 2 intervals
        print(
            f"pushes: {rate:.1f}/s ({push_seconds:.1f} s for {2 * interval}); log "
            f"{_size(per_push)} per push: {_size(per_hour)} of log per hour of "
            f"pushes; with --keep-snapshots 3 and a snapshot every {interval} steps "
            f"retention holds {_size(held)} ({_size(3 * snapshot_bytes)} of "
            f"snapshots, {_size(2 * interval * per_push)} of log: "
            f"{2 * interval / rate / 60:.1f} min of pushes at this rate)"
        )
    finally:
        proc.kill()
        proc.wait()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
