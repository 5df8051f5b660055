"""What replication costs, how long a failover takes and how fast a standby
catches up (issue 23).

    python benchmarks/replication.py [--kills 5] [--lease-ttl 2] [--rounds 5]
        [--pushes 200] [--sizes ...] [--baseline REV [--new REV]]
        [--catch-up-mib 256] [--catch-up-records 5000] [--skip-...] [--keep DIR]

Needs etcd (Debian's etcd-server; tests/_etcd.py starts one on free loopback ports).

Part 1, failover: a 3-replica shard (lease TTL 2 s), one client of
``Client("etcd://...")`` pushing a 1,000-element group in a loop; the primary is
killed with SIGKILL ``--kills`` times (restarted each time as a standby). Printed: the
time from the kill to the first push acknowledged by the new primary (median, max),
and per kill its phases as polled in etcd: the lease expired (the primary key went),
another member took it, it named a synchronous standby, the first ack.

Part 2, push cost: a 1-replica shard with ``--sync-replicas 0`` and a 2-replica
shard with ``--sync-replicas 1`` (both ``--durability wal``, lease TTL 3 s), one
client pushing serially, 1,000 elements, 16 MiB and 64 MiB float32 Adagrad, in
rounds that take the shards in turn. Printed: median push latency per case, the ratio
(1 sync standby / 0) and its spread over rounds, and the CPU time per push of the
primary and of the standby during their shard's turns (from /proc, once the warm-up's
records are applied: the replicas share this host's cores). With ``--baseline REV``
the servers of that commit (its own checkout, benchmarks/_baseline.py) run in the
same rounds beside this tree's (or ``--new REV``'s): compare the ratios side by side.

Part 3, catch-up: a standby joins a primary holding a ``--catch-up-mib`` group in its
newest snapshot and ``--catch-up-records`` 1,000-element pushes in its log after it:
the snapshot's MiB/s (to its adoption), then records/s, in ``--rounds`` rounds (with
``--baseline REV``, that commit's servers in the same rounds, in turn); medians and
min-max spread.

Part 4, a standby behind on its stream (issue 36): a 3-replica shard
(``--sync-replicas 1``); the standby not named synchronous is frozen (SIGSTOP, its
stream stays open) while one client pushes ``--behind-records`` 1,000-element
pushes, then thawed. Timed: its catch-up over that gap while the client goes on
pushing (under load, beside the primary's push rate meanwhile) and, after a second
freeze, with the primary idle; records/s and MiB/s, and the ratio to the push
rate. A catch-up that does not end within ``--behind-timeout`` seconds is printed
as the rate it reached (``>``: a lower bound on the time). With ``--baseline REV``,
that commit's servers in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, suppress
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _baseline import checkout, describe, tree_env  # noqa: E402
from _etcd import EtcdProcess, etcd_binary, start_etcd  # noqa: E402
from _procs import clean_env, start_server, stop  # noqa: E402
from onnxps.client import (  # noqa: E402
    Adagrad,
    AlreadyExistsError,
    Client,
    NotFoundError,
)

TTL = 2
DATA_ROOT: Path | None = None  # --data: where the servers' data directories go
PIN = False  # --pin: part 2's primaries and this process on CPU 0, standbys on CPU 1


def _pin(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` on CPU ``cpu`` only (``taskset -a``)."""
    subprocess.run(
        ["taskset", "-a", "-p", "-c", str(cpu), str(pid)],
        check=True,
        stdout=subprocess.DEVNULL,
    )


class Shard:
    def __init__(
        self,
        tmp: Path,
        etcd: EtcdProcess,
        prefix: str,
        n: int,
        k: int,
        tree: Path | None = None,
        ttl: int = TTL,
    ):
        self.tmp, self.etcd, self.prefix, self.k, self.ttl = tmp, etcd, prefix, k, ttl
        self.env = clean_env()
        if tree is not None:  # servers of another checkout (benchmarks/_baseline.py)
            self.env["PYTHONPATH"] = tree_env(tree)["PYTHONPATH"]
        self.procs: dict[int, object] = {}
        self.addresses: dict[int, str] = {}
        self.starts = 0
        for i in range(n):
            self.start(i)

    @property
    def url(self) -> str:
        return self.etcd.url(self.prefix)

    def start(self, i: int) -> None:
        self.starts += 1
        proc, address = start_server(
            self.tmp / f"{self.prefix}-{i}-{self.starts}.log",
            "--durability", "wal",
            "--data-dir", str((DATA_ROOT or self.tmp) / f"{self.prefix}-data{i}"),
            "--coordinator", self.url,
            "--shard", "0/1",
            "--member-id", f"m{i}",
            "--lease-ttl", str(self.ttl),
            "--sync-replicas", str(self.k),
            "--snapshot-interval", "0",
            env=self.env,
        )  # fmt: skip
        self.procs[i], self.addresses[i] = proc, address

    def primary(self, not_: int | None = None, timeout: float = 60) -> int:
        import etcd3gw

        c = etcd3gw.Etcd3Client(
            host="127.0.0.1", port=self.etcd.client_port, api_path="/v3/"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = c.get(f"/{self.prefix}/shards/0/primary")
            if got:
                i = int(json.loads(got[0])["member"][1:])
                if i != not_:
                    return i
            time.sleep(0.02)
        raise RuntimeError("no primary")

    def close(self) -> None:
        for p in self.procs.values():
            stop(p)  # type: ignore[arg-type]


def _create(url: str, n: int) -> None:
    with Client(url, timeout=120) as c:
        c.create_group(
            "g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(n, np.float32)}
        )


def _acked_after(acks: list[tuple[float, str]], t0: float, old: str) -> list[float]:
    """When pushes were acknowledged after ``t0`` by another server than ``old``."""
    return [t for t, address in acks if t > t0 and address != old]


class Timeline(threading.Thread):
    """Polls the shard's keys in etcd every 10 ms and notes when, after ``watch``:
    the primary key went (its lease expired), another member took it, and that
    primary named a synchronous standby."""

    def __init__(self, shard: Shard) -> None:
        super().__init__(daemon=True)
        import etcd3gw

        self.etcd = etcd3gw.Etcd3Client(
            host="127.0.0.1", port=shard.etcd.client_port, api_path="/v3/"
        )
        self.base = f"/{shard.prefix}/shards/0"
        # the member killed last, and the marks since (replaced together)
        self.watching: tuple[str, dict[str, float]] | None = None
        self.done = threading.Event()
        self.start()

    def watch(self, old_member: str) -> dict[str, float]:
        """Note the marks after ``old_member`` was killed, from now on."""
        marks: dict[str, float] = {}
        self.watching = (old_member, marks)
        return marks

    def _get(self, key: str) -> dict[str, object] | None:
        got = self.etcd.get(f"{self.base}/{key}")
        return json.loads(got[0]) if got else None

    def run(self) -> None:
        while not self.done.wait(0.01):
            if self.watching is None:
                continue
            old, marks = self.watching
            primary = self._get("primary")
            now = time.monotonic()  # (when the answer came)
            if primary is None or primary["member"] != old:
                marks.setdefault("expired", now)
            if primary is not None and primary["member"] != old:
                marks.setdefault("elected", now)
                sync = self._get("sync")
                if sync and sync["term"] == primary["term"] and sync["standbys"]:
                    marks.setdefault("sync", time.monotonic())


def _phases(killed: float, marks: dict[str, float], first: float) -> str:
    """The kill-to-first-ack time cut at the timeline's marks (each polled: up
    to one poll late, so a push may be acknowledged before the last mark)."""
    out, before = [], killed
    for name in ("expired", "elected", "sync"):
        if name in marks:
            out.append(f"{name} +{marks[name] - before:.2f}")
            before = marks[name]
    out.append(f"first ack +{first - before:.2f}")
    return ", ".join(out)


def failover(
    tmp: Path, etcd: EtcdProcess, kills: int, ttl: int, fault: str = "kill"
) -> list[float]:
    """``fault`` "kill": SIGKILL of the primary, restarted once another is
    elected; "stop": SIGSTOP, thawed once another acknowledged a push (it then
    finds itself deposed and exits, status 75), then restarted."""
    shard = Shard(tmp, etcd, f"failover-{fault}", 3, 1, ttl=ttl)
    acks: list[tuple[float, str]] = []  # (when, the server that acknowledged)
    stop_ = threading.Event()
    try:
        shard.primary()
        _create(shard.url, 1000)
        g = np.full(1000, 0.01, np.float32)

        def pusher() -> None:
            with Client(shard.url, timeout=120) as c:
                while not stop_.is_set():
                    c.push("g", g)
                    acks.append((time.monotonic(), c.address))

        t = threading.Thread(target=pusher, daemon=True)
        t.start()
        timeline = Timeline(shard)
        times = []
        for _ in range(kills):
            time.sleep(1.0)
            p = shard.primary()
            old = shard.addresses[p]
            n0 = len(acks)
            marks = timeline.watch(f"m{p}")
            proc: Any = shard.procs[p]
            proc.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            killed = time.monotonic()
            if fault == "kill":
                proc.wait()
                shard.primary(not_=p)
                shard.start(p)
            deadline = time.monotonic() + 120

            while not (new := _acked_after(acks[n0:], killed, old)):
                if time.monotonic() > deadline:
                    raise RuntimeError("no push acknowledged after the kill")
                time.sleep(0.01)
            first = min(new)
            if fault == "stop":
                proc.send_signal(signal.SIGCONT)
                try:
                    proc.wait(timeout=30)  # deposed: it exits by itself
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                shard.start(p)
            times.append(first - killed)
            print(
                f"  {fault} {len(times)}: {first - killed:.2f} s "
                f"({_phases(killed, marks, first)})",
                flush=True,
            )
        timeline.done.set()
        stop_.set()
        t.join(timeout=60)
        return times
    finally:
        stop_.set()
        shard.close()


def _cpu_seconds(pid: int) -> float:
    """The user + system CPU time of process ``pid`` so far (0 without /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(shard: Shard, primary: int) -> dict[str, float]:
    """Per role (the primary, its standbys together): CPU seconds so far."""
    got = {"primary": 0.0, "standby": 0.0}
    for i, proc in shard.procs.items():
        got["primary" if i == primary else "standby"] += _cpu_seconds(proc.pid)  # type: ignore[attr-defined]
    return got


def _settle(shards: list[Shard], timeout: float = 30) -> None:
    """Until no server process used more than 2 clock ticks of CPU in 0.2 s (a
    standby applies its first records, the warm-up's, after acknowledging them:
    not in the timed pushes' CPU)."""
    tick = 2 / os.sysconf("SC_CLK_TCK")
    pids = [p.pid for s in shards for p in s.procs.values()]  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = [_cpu_seconds(pid) for pid in pids]
        time.sleep(0.2)
        if all(_cpu_seconds(p) - b <= tick for p, b in zip(pids, before, strict=True)):
            return


SIZES = {"1,000 elements": 1000, "16 MiB": 4 << 20, "64 MiB": 16 << 20}


def push_cost(
    tmp: Path,
    etcd: EtcdProcess,
    rounds: int,
    pushes: int,
    trees: dict[str, Path | None],
    sizes: dict[str, int],
) -> None:
    """Per tree (this one, and a baseline's when given): a shard with 0 and one
    with 1 synchronous standby; every (tree, k) pushes ``count`` times a round,
    in turn, the order rotating each round. Also printed: the CPU time each
    server process spent per push during its shard's turns (the replicas share
    this host's cores: a standby's CPU is taken from the primary and the client)."""
    shards = {
        # the default lease: a 2 s one may lapse on a loaded host, failing the run
        (label, k): Shard(tmp, etcd, f"k{k}-{i}", 1 + k, k, tree, ttl=3)
        for i, (label, tree) in enumerate(trees.items())
        for k in (0, 1)
    }
    try:
        primaries = {key: s.primary() for key, s in shards.items()}
        if PIN:  # a standby on a core of its own, as on another host
            _pin(os.getpid(), 0)
            for key, s in shards.items():
                for i, proc in s.procs.items():
                    _pin(proc.pid, 0 if i == primaries[key] else 1)  # type: ignore[attr-defined]
        for name, n in sizes.items():
            group = f"g{n}"
            grads = np.full(n, 0.01, np.float32)
            for s in shards.values():
                with Client(s.url, timeout=300) as c, suppress(AlreadyExistsError):
                    # (a create resent after a lost answer finds its group)
                    c.create_group(
                        group, Adagrad(), learning_rate=0.1,
                        tensors={"x": np.zeros(n, np.float32)},
                    )  # fmt: skip
            count = pushes if n <= 1000 else max(3, pushes // (20 * n // (4 << 20)))
            lat: dict[tuple[str, int], list[float]] = {key: [] for key in shards}
            per_round: dict[tuple[str, int], list[float]] = {key: [] for key in shards}
            cpu = {key: {"primary": 0.0, "standby": 0.0} for key in shards}
            clients = {key: Client(s.url, timeout=300) for key, s in shards.items()}
            try:
                for c in clients.values():
                    c.push(group, grads)  # warm up
                _settle(list(shards.values()))
                keys = list(clients)
                for r in range(rounds):
                    for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                        got = []
                        before = _cpu(shards[key], primaries[key])
                        for _ in range(count):
                            t0 = time.perf_counter()
                            clients[key].push(group, grads)
                            got.append(time.perf_counter() - t0)
                        after = _cpu(shards[key], primaries[key])
                        for role in before:
                            cpu[key][role] += after[role] - before[role]
                        lat[key] += got
                        per_round[key].append(statistics.median(got))
            finally:
                for c in clients.values():
                    c.close()
            for label in trees:
                m0 = statistics.median(lat[label, 0])
                m1 = statistics.median(lat[label, 1])
                one, none = per_round[label, 1], per_round[label, 0]
                ratios = [a / b for a, b in zip(one, none, strict=True)]
                print(
                    f"  {name} [{label}]: 0 sync standbys {m0 * 1e3:.2f} ms, 1 sync "
                    f"standby {m1 * 1e3:.2f} ms per push (median of "
                    f"{len(lat[label, 0])}): {m1 / m0:.2f}x (per round "
                    f"{min(ratios):.2f}-{max(ratios):.2f})",
                    flush=True,
                )
                n0, n1 = len(lat[label, 0]), len(lat[label, 1])
                print(
                    f"    CPU per push: 0 sync standbys "
                    f"{cpu[label, 0]['primary'] / n0 * 1e6:,.0f} us (primary); "
                    f"1 sync standby {cpu[label, 1]['primary'] / n1 * 1e6:,.0f} us "
                    f"(primary) + {cpu[label, 1]['standby'] / n1 * 1e6:,.0f} us "
                    "(standby)",
                    flush=True,
                )
    finally:
        for s in shards.values():
            s.close()


def _logged_at(log: Path, text: str, timeout: float = 600) -> float:
    """The wall-clock time of the first line of ``log`` holding ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if text in line:
                stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                return stamp.timestamp()
        time.sleep(0.05)
    raise RuntimeError(f"{log}: no line holds {text!r}")


def catch_up(
    tmp: Path,
    etcd: EtcdProcess,
    mib: int,
    records: int,
    prefix: str = "catchup",
    tree: Path | None = None,
) -> tuple[float, float, float]:
    """A standby joins a primary (``--sync-replicas 0``) holding a ``mib`` MiB group
    in its newest snapshot and ``records`` 1,000-element pushes in its log after
    it. Timed from the standby listening: to the snapshot adopted (its log line),
    then to its T equal to the primary's. Returns the snapshot's MiB/s, then the
    log's records/s and MiB/s (servers of ``tree``'s checkout when given)."""
    shard = Shard(tmp, etcd, prefix, 1, 0, tree=tree)
    try:
        shard.primary()
        with Client(shard.url, timeout=600) as c:
            c.create_group(
                "big", Adagrad(), learning_rate=0.1,
                tensors={"x": np.zeros(mib << 18, np.float32)},
            )  # fmt: skip
            _create(shard.url, 1000)
            c.save()
            g = np.full(1000, 0.01, np.float32)
            for _ in range(records):
                c.push("g", g)
        snaps = (DATA_ROOT or tmp) / f"{prefix}-data0" / "snapshots"
        size = sum(f.stat().st_size for f in snaps.rglob("*") if f.is_file())
        log_bytes = records * (4000 + 200)  # a frame: 4,000 body bytes, ~200 header
        shard.start(1)
        started = time.time()
        adopted = _logged_at(shard.tmp / f"{prefix}-1-{shard.starts}.log", "caught up")
        with Client(shard.addresses[1], timeout=60) as c:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if c.describe_group("g").update_count == records:
                        break
                except NotFoundError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the standby did not catch up")
                time.sleep(0.01)
        done = time.time()
        snap_s, log_s = adopted - started, done - adopted
        return size / 2**20 / snap_s, records / log_s, log_bytes / 2**20 / log_s
    finally:
        shard.close()


def catch_up_rounds(
    tmp: Path,
    etcd: EtcdProcess,
    mib: int,
    records: int,
    rounds: int,
    trees: dict[str, Path | None],
) -> None:
    """``catch_up`` of each checkout in ``trees``, in alternating rounds; prints
    per checkout the medians and the min-max spread."""
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in trees}
    keys = list(trees)
    for r in range(rounds):
        for label in keys[r % len(keys) :] + keys[: r % len(keys)]:
            prefix = f"catchup{r}{keys.index(label)}"
            got[label].append(catch_up(tmp, etcd, mib, records, prefix, trees[label]))
            snap, rps, mbs = got[label][-1]
            print(
                f"  round {r + 1} {label}: snapshot {snap:.0f} MiB/s, then "
                f"{rps:.0f} records/s ({mbs:.1f} MiB/s)",
                flush=True,
            )
    for label, runs in got.items():
        cols = list(zip(*runs, strict=True))
        text = ", ".join(
            f"{name} median {statistics.median(v):.{d}f} "
            f"({min(v):.{d}f}-{max(v):.{d}f})"
            for name, v, d in zip(
                ("snapshot MiB/s", "records/s", "log MiB/s"), cols, (0, 0, 1),
                strict=True,
            )
        )  # fmt: skip
        print(f"  {label}: {text}", flush=True)


def _t_of(address: str) -> int:
    with Client(address, timeout=10) as c:
        try:
            return c.describe_group("g").update_count
        except NotFoundError:
            return -1


def _follow_gap(address: str, target: int, timeout: float) -> tuple[float, int, bool]:
    """Poll replica ``address`` until its T reaches ``target``: (seconds, T at the
    start, whether it got there within ``timeout``)."""
    start, t0 = time.monotonic(), _t_of(address)
    while time.monotonic() - start < timeout:
        if _t_of(address) >= target:
            return time.monotonic() - start, t0, True
        time.sleep(0.02)
    return time.monotonic() - start, t0, False


def behind(
    tmp: Path,
    etcd: EtcdProcess,
    records: int,
    timeout: float,
    prefix: str,
    tree: Path | None = None,
) -> dict[str, float]:
    """Part 4 (see the module's doc) once: the primary's push rate, the frozen
    standby's catch-up rate under load and idle (records/s), and whether each
    ended in time (1.0) or was cut at ``timeout`` (0.0)."""
    shard = Shard(tmp, etcd, prefix, 3, 1, tree=tree)
    import etcd3gw

    gw = etcd3gw.Etcd3Client(host="127.0.0.1", port=etcd.client_port, api_path="/v3/")
    try:
        p = shard.primary()
        deadline = time.monotonic() + 60
        while True:
            got = gw.get(f"/{prefix}/shards/0/sync")
            named = json.loads(got[0])["standbys"] if got else []
            if named:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("no synchronous standby")
            time.sleep(0.05)
        lag = next(i for i in shard.procs if i != p and f"m{i}" not in named)
        pid = shard.procs[lag].pid  # type: ignore[attr-defined]
        _create(shard.url, 1000)
        g = np.full(1000, 0.01, np.float32)
        out: dict[str, float] = {}
        with Client(shard.url, timeout=120) as c:
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            for _ in range(records):
                t = c.push("g", g)
            out["push/s"] = records / (time.monotonic() - t0)
            stop_load = threading.Event()

            def load() -> None:
                with Client(shard.url, timeout=120) as w:
                    while not stop_load.is_set():
                        w.push("g", g)

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            os.kill(pid, signal.SIGCONT)
            secs, start_t, ok = _follow_gap(shard.addresses[lag], t, timeout)
            stop_load.set()
            loader.join()
            out["load records/s"] = (
                (t - start_t) / secs
                if ok
                else (_t_of(shard.addresses[lag]) - start_t) / secs
            )
            out["load done"] = float(ok)
            t = c.describe_group("g").update_count
            _follow_gap(shard.addresses[lag], t, timeout)  # level again
            os.kill(pid, signal.SIGSTOP)
            for _ in range(records):
                t = c.push("g", g)
        os.kill(pid, signal.SIGCONT)
        secs, start_t, ok = _follow_gap(shard.addresses[lag], t, timeout)
        reached = t if ok else _t_of(shard.addresses[lag])
        out["idle records/s"] = (reached - start_t) / secs
        out["idle done"] = float(ok)
        return out
    finally:
        for proc in shard.procs.values():
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # type: ignore[attr-defined]
        shard.close()


def behind_rounds(
    tmp: Path,
    etcd: EtcdProcess,
    records: int,
    timeout: float,
    rounds: int,
    trees: dict[str, Path | None],
) -> None:
    got: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    keys = list(trees)
    mib = records * 4200 / 2**20  # a record: 4,000 body bytes, ~200 header
    for r in range(rounds):
        for label in keys[r % len(keys) :] + keys[: r % len(keys)]:
            prefix = f"behind{r}{keys.index(label)}"
            res = behind(tmp, etcd, records, timeout, prefix, trees[label])
            got[label].append(res)
            print(
                f"  round {r + 1} {label}: pushes {res['push/s']:.0f}/s; catch-up "
                f"under load {'' if res['load done'] else '> '}"
                f"{res['load records/s']:.0f} records/s, idle "
                f"{'' if res['idle done'] else '> '}{res['idle records/s']:.0f} "
                "records/s",
                flush=True,
            )
    for label, runs in got.items():
        parts = []
        for key in ("push/s", "load records/s", "idle records/s"):
            v = [run[key] for run in runs]
            parts.append(
                f"{key} median {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})"
            )
        load = statistics.median(run["load records/s"] for run in runs)
        idle = statistics.median(run["idle records/s"] for run in runs)
        push = statistics.median(run["push/s"] for run in runs)
        print(
            f"  {label}: {', '.join(parts)}; under load {load / push:.1f}x the push "
            f"rate ({load * mib / records:.1f} MiB/s), idle {idle / push:.1f}x",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pushes", type=int, default=200)
    ap.add_argument("--skip-failover", action="store_true")
    ap.add_argument("--lease-ttl", type=int, default=TTL, help="part 1's (2)")
    ap.add_argument(
        "--fault",
        choices=["kill", "stop"],
        default="kill",
        help="part 1's fault: SIGKILL of the primary (kill), or SIGSTOP until "
        "another acknowledged a push (stop)",
    )
    ap.add_argument("--skip-push-cost", action="store_true")
    ap.add_argument("--skip-catch-up", action="store_true")
    ap.add_argument("--catch-up-mib", type=int, default=256)
    ap.add_argument("--catch-up-records", type=int, default=5000)
    ap.add_argument("--skip-behind", action="store_true")
    ap.add_argument("--behind-records", type=int, default=10000)
    ap.add_argument("--behind-timeout", type=float, default=120.0)
    ap.add_argument(
        "--sizes",
        nargs="+",
        default=list(SIZES),
        choices=list(SIZES),
        help="part 2's push sizes (all three)",
    )
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="parts 2 and 3 also run the servers of this commit (its own "
        "checkout, benchmarks/_baseline.py), in the same rounds",
    )
    ap.add_argument(
        "--new",
        metavar="REV",
        help="with --baseline: this commit instead of the working tree (whose "
        "files a run would import while they are being edited)",
    )
    ap.add_argument(
        "--data",
        metavar="DIR",
        help="the servers' data directories in a new folder in DIR (e.g. /dev/shm: "
        "no disk on either side, so part 2 shows the replication protocol's own "
        "cost apart from two logs sharing one disk)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="part 2 pins every primary and this process (the client) to CPU 0 "
        "and the standbys to CPU 1 (taskset): a standby on cores of its own, as on "
        "another host, apart from the CPU it takes from the primary on a shared one",
    )
    ap.add_argument(
        "--keep",
        metavar="DIR",
        help="keep the servers' data and logs in a new folder in DIR",
    )
    args = ap.parse_args()
    global DATA_ROOT, PIN
    PIN = args.pin
    binary = etcd_binary()
    if binary is None:
        print("etcd is not installed: apt-get install -y etcd-server")
        return 1
    with ExitStack() as outer:
        if args.keep:
            d = tempfile.mkdtemp(dir=args.keep)
            print(f"data and logs in {d}", flush=True)
        else:
            d = outer.enter_context(tempfile.TemporaryDirectory())
        tmp = Path(d)
        if args.data:
            DATA_ROOT = Path(tempfile.mkdtemp(dir=args.data))
            outer.callback(shutil.rmtree, DATA_ROOT, True)
        etcd = start_etcd(binary, tmp)
        try:
            if not args.skip_failover:
                ttl = args.lease_ttl
                sig = "SIGKILL" if args.fault == "kill" else "SIGSTOP"
                print(f"failover (3 replicas, lease TTL {ttl} s, {sig} the primary):")
                times = failover(tmp, etcd, args.kills, ttl, args.fault)
                print(
                    f"  kill -> first acknowledged push on the new primary over "
                    f"{len(times)} kills: median {statistics.median(times):.2f} s, "
                    f"max {max(times):.2f} s"
                )
            trees: dict[str, Path | None] = {describe(None).split()[0]: None}
            if args.baseline:
                new = outer.enter_context(checkout(args.new))
                old = outer.enter_context(checkout(args.baseline))
                trees = {f"new {new.label}": new.tree}
                trees[f"old {old.label}"] = old.tree
            if not args.skip_push_cost:
                print(f"push cost (serial pushes, {args.rounds} alternating rounds):")
                sizes = {k: v for k, v in SIZES.items() if k in args.sizes}
                push_cost(tmp, etcd, args.rounds, args.pushes, trees, sizes)
            if not args.skip_catch_up:
                mib, n = args.catch_up_mib, args.catch_up_records
                print(
                    f"catch-up (a standby joins: {mib} MiB group, {n} records; "
                    f"{args.rounds} alternating rounds):"
                )
                catch_up_rounds(tmp, etcd, mib, n, args.rounds, trees)
            if not args.skip_behind:
                n = args.behind_records
                print(
                    f"a standby behind on its stream (frozen for {n} pushes, then "
                    f"thawed; {args.rounds} alternating rounds):"
                )
                behind_rounds(tmp, etcd, n, args.behind_timeout, args.rounds, trees)
        finally:
            etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
