"""The standing chaos test (issue 36): a replicated cluster under a seeded schedule
of faults, its workers' every push recorded, then a heal and a checker.

``python tests/chaos.py --seed S --duration SECONDS [--out DIR]`` (as root: it
creates a network namespace, tmpfs mounts and iptables rules, and removes them).

What runs, every process a real one, inside a network namespace the run creates
(``ip netns add``; its own loopback, its own iptables, so nothing touches the
host's network or rules; without ``ip netns`` it runs on the host's loopback with
its rules in a chain of its own, removed at the end):

- etcd, 3 members;
- 2 shards x 3 replicas of ``onnxps serve --durability wal --coordinator
  etcd://.../chaos --shard I/2 --sync-replicas 1``, each on a fixed port, with its
  data dir on a tmpfs of its own (so a disk can be filled), running with a group id
  of its own (so an iptables rule can match its packets);
- a supervisor that restarts a replica whose process exited, after 1 s (a kubelet);
- N workers (``python tests/chaos.py worker``), each pushing to one group on each
  shard through ``Client("etcd://...")``, one thread per group, writing every push
  to a JSONL file (tests/chaos_check.py says how the gradients are chosen);
- a monitor sampling etcd's ``primary``, ``sync`` and ``members/`` keys of each
  shard every 0.25 s.

The faults (``random.Random(seed)``): kill -9 and SIGSTOP/SIGCONT of a primary and
of a standby, a partition of a primary from etcd, from its standbys, or from both,
kill -9 of one etcd member and of all three (restarted after), and a full disk on
a primary and on a standby. Then every fault is healed, the workers push for a few
more seconds and stop, and the checker says whether every acknowledged push is in
the final state exactly once at its T, the state is a serial replay of the applied
pushes, there was one primary per term, no call outlived its deadline, and every
replica equals its primary within 30 s of the heal. ``--json FILE`` writes the
verdicts and figures.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_check import (  # noqa: E402
    ACK,
    CONVERGE_WATCH,
    EPSILON,
    LEARNING_RATE,
    REFUSED,
    REPLICAS,
    RESTART_DELAY,
    SHARDS,
    SHARED,
    TAIL,
    UNKNOWN,
    Run,
    gradient,
    load,
    report,
    save,
)

HERE = Path(__file__).resolve()
PREFIX = "chaos"
TTL = 3
DEADLINE = 4.0  # each push's
GID = 61000  # replica (shard s, replica r) runs with group GID + 10 s + r
KINDS = (
    "kill9-primary",
    "kill9-standby",
    "stop-primary",
    "stop-standby",
    "partition-primary-etcd",
    "partition-primary-standbys",
    "partition-primary-all",
    "kill9-etcd-member",
    "kill9-etcd-all",
    "disk-full-primary",
    "disk-full-standby",
)


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(cmd, check=check, capture_output=True, timeout=30)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONNXPS_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kill_group(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def reap(procs: Sequence[subprocess.Popen[bytes] | None]) -> None:
    """SIGCONT and SIGKILL each process group, then wait for them."""
    for p in procs:
        kill_group(p, signal.SIGCONT)
        kill_group(p, signal.SIGKILL)
    for p in procs:
        if p is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


# -- etcd --------------------------------------------------------------------------
@dataclass
class EtcdMember:
    index: int
    dir: Path
    client_port: int
    peer_port: int
    cluster: str = ""
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.client_port}"
        args = [
            "etcd", f"--name=e{self.index}", f"--data-dir={self.dir / 'data'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.cluster}", "--initial-cluster-state=new",
            "--initial-cluster-token=onnxps-chaos", "--logger=zap",
            "--log-outputs=stderr",
        ]  # fmt: skip
        with open(self.dir / "etcd.log", "ab") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def healthy(self) -> bool:
        import urllib.request

        try:
            url = f"http://127.0.0.1:{self.client_port}/health"
            with urllib.request.urlopen(url, timeout=1) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def kill(self) -> None:
        reap([self.proc])
        self.proc = None


# -- replicas ----------------------------------------------------------------------
@dataclass
class Replica:
    shard: int
    index: int
    port: int
    mount: Path
    url: str
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    restart_at: float | None = None
    lease_ttl: ClassVar[int] = TTL  # --lease-ttl of every replica (the run's flag)
    exits: list[tuple[float, int]] = field(default_factory=list)

    @property
    def member(self) -> str:
        return f"s{self.shard}r{self.index}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def gid(self) -> int:
        return GID + 10 * self.shard + self.index

    def start(self) -> None:
        self.starts += 1
        cmd = [
            sys.executable, "-m", "onnxps.cli", "serve",
            "--address", self.address,
            "--durability", "wal",
            "--data-dir", str(self.mount / "data"),
            "--coordinator", self.url,
            "--shard", f"{self.shard}/{SHARDS}",
            "--member-id", self.member,
            "--sync-replicas", "1",
            "--lease-ttl", str(self.lease_ttl),
            "--snapshot-interval", "20",
        ]  # fmt: skip
        logfile = self.mount.parent / f"{self.member}.log"
        with open(logfile, "ab") as out:
            out.write(f"=== start {self.starts} at {time.monotonic():.3f}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=clean_env(),
                group=self.gid,
                start_new_session=True,
            )


class Cluster:
    """The processes of one run, the faults' effects on them, and their cleanup."""

    def __init__(self, work: Path, netns: bool, mounts: bool) -> None:
        self.work, self.netns, self.mounts = work, netns, mounts
        self.lock = threading.RLock()
        self.chain = "ONNXPS-CHAOS" if netns else f"ONNXPS-CHAOS-{os.getpid()}"
        ports = [free_port(netns, 2379 + 10 * i) for i in range(6)]
        cluster = ",".join(
            f"e{i}=http://127.0.0.1:{ports[2 * i + 1]}" for i in range(3)
        )
        self.etcd = [
            EtcdMember(i, work / f"etcd{i}", ports[2 * i], ports[2 * i + 1], cluster)
            for i in range(3)
        ]
        hosts = ",".join(f"127.0.0.1:{e.client_port}" for e in self.etcd)
        self.url = f"etcd://{hosts}/{PREFIX}"
        self.replicas = [
            Replica(s, r, free_port(netns, 50100 + 10 * s + r), work / f"s{s}r{r}" /
                    "disk", self.url)
            for s in range(SHARDS) for r in range(REPLICAS)
        ]  # fmt: skip
        self.supervising = False
        self.filled: list[Path] = []
        self._gateways: list[Any] = []

    # setup and teardown
    def start(self) -> None:
        for e in self.etcd:
            e.dir.mkdir(parents=True)
        for rep in self.replicas:
            rep.mount.mkdir(parents=True)
            if self.mounts:
                run("mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(rep.mount))
        run("iptables", "-w", "5", "-N", self.chain)
        run("iptables", "-w", "5", "-I", "OUTPUT", "-j", self.chain)
        for e in self.etcd:
            e.start()
        wait_for(lambda: all(e.healthy() for e in self.etcd), 60, "etcd healthy")
        from onnxps.wire.coordinator import gateway_clients, parse_coordinator

        self._gateways = gateway_clients(parse_coordinator(self.url), 1.0)
        for rep in self.replicas:
            rep.start()
        wait_for(self.full, 90, "a primary and a synchronous standby on each shard")

    def close(self) -> None:
        self.supervising = False
        with self.lock:
            reap([r.proc for r in self.replicas] + [e.proc for e in self.etcd])
        run("iptables", "-w", "5", "-D", "OUTPUT", "-j", self.chain, check=False)
        run("iptables", "-w", "5", "-F", self.chain, check=False)
        run("iptables", "-w", "5", "-X", self.chain, check=False)
        for path in self.filled:
            path.unlink(missing_ok=True)
        if self.mounts:
            for rep in self.replicas:
                run("umount", "-l", str(rep.mount), check=False)

    # etcd reads
    def etcd_get(self, key: str, prefix: bool = False) -> Any:
        for gw in self._gateways:
            try:
                if prefix:  # with each key's revision: it moves at every write
                    return {m["key"].decode(): {**json.loads(v),
                            "_rev": int(m["mod_revision"])}
                            for v, m in gw.get_prefix(key)}  # fmt: skip
                got = gw.get(key)
                return json.loads(got[0]) if got else None
            except Exception:  # noqa: BLE001 - try the next member
                continue
        raise OSError("no etcd member answered")

    def shard_keys(self, shard: int) -> dict[str, Any]:
        base = f"/{PREFIX}/shards/{shard}"
        members = self.etcd_get(f"{base}/members/", prefix=True)
        return {
            "primary": self.etcd_get(f"{base}/primary"),
            "sync": self.etcd_get(f"{base}/sync"),
            "members": {k.rsplit("/", 1)[1]: v for k, v in members.items()},
        }

    def full(self) -> bool:
        try:
            for s in range(SHARDS):
                keys = self.shard_keys(s)
                p, sync = keys["primary"], keys["sync"]
                if not (isinstance(p, dict) and isinstance(sync, dict)):
                    return False
                if sync.get("term") != p["term"] or not sync.get("standbys"):
                    return False
        except OSError:
            return False
        return True

    def primary(self, shard: int) -> Replica | None:
        try:
            p = self.etcd_get(f"/{PREFIX}/shards/{shard}/primary")
        except OSError:
            return None
        if not isinstance(p, dict):
            return None
        return next((r for r in self.replicas if r.member == p["member"]), None)

    def shard_replicas(self, shard: int) -> list[Replica]:
        return [r for r in self.replicas if r.shard == shard]

    # the supervisor
    def supervise(self, events: list[dict[str, Any]]) -> None:
        self.supervising = True
        while self.supervising:
            now = time.monotonic()
            with self.lock:
                for rep in self.replicas:
                    if rep.proc is not None and rep.proc.poll() is not None:
                        code = int(rep.proc.returncode)
                        rep.exits.append((now, code))
                        events.append({"t": now, "member": rep.member, "exit": code})
                        rep.proc, rep.restart_at = None, now + RESTART_DELAY
                    if rep.proc is None and rep.restart_at and now >= rep.restart_at:
                        rep.restart_at = None
                        rep.start()
                        events.append({"t": now, "member": rep.member, "start": True})
            time.sleep(0.1)

    # faults
    def drop(self, gid: int, ports: Sequence[int]) -> None:
        for port in ports:
            run("iptables", "-w", "5", "-A", self.chain, "-m", "owner",
                "--gid-owner", str(gid), "-p", "tcp", "-d", "127.0.0.1",
                "--dport", str(port), "-j", "DROP")  # fmt: skip

    def heal_partitions(self) -> None:
        run("iptables", "-w", "5", "-F", self.chain)

    def fill(self, rep: Replica) -> Path:
        """Fill the replica's tmpfs (bounded: its size in MiB plus a few writes)."""
        path = rep.mount / "chaos-filler"
        self.filled.append(path)
        chunk = b"\0" * (1 << 20)
        with open(path, "wb") as f:
            for _ in range(300):
                try:
                    f.write(chunk)
                    f.flush()
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        return path


def free_port(netns: bool, fixed: int) -> int:
    """``fixed`` in the run's own namespace (nothing else listens there), else a
    free port of the host's loopback."""
    if netns:
        return fixed
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


# -- the schedule ------------------------------------------------------------------
@dataclass
class Fault:
    kind: str
    at: float  # seconds after the workers started
    hold: float  # seconds until it is healed (0: a kill, healed by the restart)
    shard: int
    pick: float  # which replica or etcd member, as a fraction


def schedule(
    seed: int, duration: float, gap: tuple[float, float] = (4.0, 7.0)
) -> list[Fault]:
    """Faults one after the other: each kind once in a shuffled round, then again."""
    rng = random.Random(seed)
    out: list[Fault] = []
    t, kinds = 8.0, list[str]()  # 8 s of pushes before the first fault
    while True:
        if not kinds:
            kinds = list(KINDS)
            rng.shuffle(kinds)
        kind = kinds.pop()
        hold = round(rng.uniform(2.0, 6.0), 2)  # kill -9 of a replica: none
        if kind in ("kill9-primary", "kill9-standby"):
            hold = 0.0
        if t + hold + TAIL > duration:
            return out
        out.append(Fault(kind, t, hold, rng.randrange(SHARDS), rng.random()))
        t += hold + round(rng.uniform(*gap), 2)


def inject(c: Cluster, f: Fault) -> tuple[dict[str, Any], Any]:
    """Start fault ``f``; returns what it did and how to heal it."""
    prim = c.primary(f.shard)
    if prim is None:  # no primary known now: the first replica of the shard
        prim = c.shard_replicas(f.shard)[0]
    standbys = [r for r in c.shard_replicas(f.shard) if r is not prim]
    stby = standbys[int(f.pick * len(standbys))]
    target = stby if f.kind.endswith("standby") else prim
    info: dict[str, Any] = {"kind": f.kind, "shard": f.shard, "member": target.member}
    heal: Any = None
    with c.lock:
        if f.kind in ("kill9-primary", "kill9-standby"):
            kill_group(target.proc, signal.SIGKILL)
        elif f.kind.startswith("stop-"):
            proc = target.proc
            kill_group(proc, signal.SIGSTOP)

            def heal() -> None:
                kill_group(proc, signal.SIGCONT)

        elif f.kind.startswith("partition-"):
            etcd = [e.client_port for e in c.etcd]
            others = [r.port for r in standbys]
            if f.kind != "partition-primary-standbys":
                c.drop(prim.gid, etcd)
            if f.kind != "partition-primary-etcd":
                c.drop(prim.gid, others)
                for r in standbys:
                    c.drop(r.gid, [prim.port])
            heal = c.heal_partitions
        elif f.kind == "kill9-etcd-member":
            e = c.etcd[int(f.pick * len(c.etcd))]
            info = {"kind": f.kind, "shard": None, "member": f"e{e.index}"}
            e.kill()
            heal = e.start
        elif f.kind == "kill9-etcd-all":
            info = {"kind": f.kind, "shard": None, "member": "e*"}
            for e in c.etcd:
                e.kill()

            def heal() -> None:
                for e in c.etcd:
                    e.start()

        elif f.kind.startswith("disk-full-"):
            path = c.fill(target)

            def heal() -> None:
                path.unlink(missing_ok=True)

    return info, heal


# -- the run -----------------------------------------------------------------------
def group_names(workers: int) -> dict[str, dict[str, int]]:
    from onnxps.client._cluster import placement

    names: dict[str, dict[str, int]] = {}
    for w in range(workers):
        for s in range(SHARDS):
            n = 0
            while placement(f"w{w}-s{s}-{n}", SHARDS) != s:
                n += 1
            names[f"w{w}-s{s}-{n}"] = {"worker": w, "shard": s, "gi": len(names)}
    return names


def monitor(c: Cluster, r: Run) -> None:
    with open(r.out / "monitor.jsonl", "a") as f:
        while r.sampling:
            for s in range(SHARDS):
                try:
                    keys = c.shard_keys(s)
                except OSError:
                    continue
                sample = {"t": time.monotonic(), "shard": s, **keys}
                r.samples.append(sample)
                f.write(json.dumps(sample) + "\n")
            time.sleep(0.25)


def replica_state(rep: Replica, groups: Sequence[str]) -> dict[str, Any] | None:
    from onnxps.client import Client

    try:
        with Client(rep.address, timeout=3) as client:
            out = {}
            for g in groups:
                t = client.describe_group(g).update_count
                x, h = client.pull(g, state=True)[:2]
                out[g] = (t, np.asarray(x).copy(), np.asarray(h).copy())
            return out
    except Exception:  # noqa: BLE001 - not answering (yet) is not converged
        return None


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        a[g][0] == b[g][0]
        and np.array_equal(a[g][1], b[g][1])
        and np.array_equal(a[g][2], b[g][2])
        for g in a
    )


def converge(
    c: Cluster, r: Run, healed: float
) -> tuple[dict[str, float | None], dict[str, Any]]:
    """Seconds from the heal until each replica equals its shard's primary (read
    once the workers stopped; None: not within CONVERGE_WATCH of their stop); and
    the primaries' final states."""
    start = time.monotonic()
    done: dict[str, float | None] = {rep.member: None for rep in c.replicas}
    final: dict[str, Any] = {}
    while time.monotonic() - start < CONVERGE_WATCH:
        for s in range(SHARDS):
            groups = [g for g, meta in r.groups.items() if meta["shard"] == s]
            prim = c.primary(s)
            ref = None if prim is None else replica_state(prim, groups)
            if prim is None or ref is None:
                continue
            final.update(ref)
            done[prim.member] = done[prim.member] or time.monotonic() - healed
            for rep in c.shard_replicas(s):
                if rep is prim or done[rep.member] is not None:
                    continue
                got = replica_state(rep, groups)
                if got is not None and same(got, ref):
                    done[rep.member] = time.monotonic() - healed
                r.behind[rep.member] = (
                    "not answering reads"
                    if got is None
                    else ", ".join(f"{g} T={got[g][0]} (primary {ref[g][0]})"
                                   for g in groups)
                )  # fmt: skip
        if all(v is not None for v in done.values()):
            break
        time.sleep(0.5)
    return done, final


def start_workers(c: Cluster, r: Run, stop: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for w in range(r.workers):
        mine = [g for g, meta in r.groups.items() if meta["worker"] == w]
        cmd = [
            sys.executable, str(HERE), "worker", "--url", c.url, "--worker", str(w),
            "--groups", json.dumps({g: r.groups[g] for g in mine}),
            "--out", str(r.out / f"worker{w}.jsonl"), "--stop", str(stop),
            "--seed", str(r.seed), "--m", str(r.m), "--interval", str(r.interval),
        ]  # fmt: skip
        with open(r.out / f"worker{w}.log", "ab") as out:
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=clean_env(),
                    start_new_session=True,
                )
            )
    return procs


def create_groups(c: Cluster, r: Run) -> None:
    from onnxps.client import Adagrad, Client

    with Client(c.url, timeout=60) as client:
        for g in r.groups:
            client.create_group(
                g,
                Adagrad(epsilon=EPSILON),
                learning_rate=LEARNING_RATE,
                tensors={"x": np.zeros(SHARED + r.m, np.float64)},
            )


def execute(r: Run, netns: bool) -> dict[str, Any]:
    """One run inside the namespace (or on the host): returns the report."""
    mounts = os.geteuid() == 0
    c = Cluster(r.out / "cluster", netns, mounts)
    workers: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    try:
        log(f"starting etcd x3 and {SHARDS} shards x {REPLICAS} replicas in {r.out}")
        c.start()
        r.groups = group_names(r.workers)
        create_groups(c, r)
        r.sampling = True
        threads = [
            threading.Thread(target=c.supervise, args=(r.events,), daemon=True),
            threading.Thread(target=monitor, args=(c, r), daemon=True),
        ]
        for t in threads:
            t.start()
        stop = r.out / "stop"
        workers = start_workers(c, r, stop)
        t0 = time.monotonic()
        plan = schedule(r.seed, r.duration, r.gap)
        log(f"{len(plan)} faults planned over {r.duration:.0f} s (seed {r.seed})")
        for f in plan:
            time.sleep(max(0.0, t0 + f.at - time.monotonic()))
            info, heal = inject(c, f)
            info["start"] = time.monotonic()
            log(f"fault {info['kind']} on {info['member']} for {f.hold:.1f} s")
            time.sleep(f.hold)
            if heal is not None:
                with c.lock:
                    heal()
            info["end"] = time.monotonic()
            r.faults.append(info)
        time.sleep(max(0.0, t0 + r.duration - TAIL - time.monotonic()))
        healed = time.monotonic()
        log("healed; pushing on for the tail")
        time.sleep(TAIL)
        stop.touch()
        for w in workers:
            try:
                w.wait(DEADLINE + 30)
            except subprocess.TimeoutExpired:
                kill_group(w, signal.SIGKILL)
        log("workers stopped; watching the replicas converge")
        converged, final = converge(c, r, healed)
        r.sampling = False
        save(r, converged, final, healed)
        return report(r, converged, final, healed)
    finally:
        r.sampling = False
        reap(list(workers))
        c.close()
        for t in threads:
            t.join(5)
        (r.out / "events.json").write_text(json.dumps(r.events + r.faults))


# -- a worker ----------------------------------------------------------------------
def worker(a: argparse.Namespace) -> int:
    """Push to each of this worker's groups on a thread of its own until ``stop``
    exists; one JSON line before each push and one with its outcome."""
    from onnxps.client import Client, DeadlineExceededError, RpcError

    groups: dict[str, dict[str, int]] = json.loads(a.groups)
    lock = threading.Lock()
    stop = Path(a.stop)
    f = open(a.out, "a")  # noqa: SIM115 - closed below

    def write(rec: dict[str, Any]) -> None:
        with lock:
            f.write(json.dumps(rec) + "\n")
            f.flush()

    def connect(client_id: str) -> Client:
        for _ in range(600):
            try:
                return Client(a.url, timeout=DEADLINE, client_id=client_id)
            except Exception:  # noqa: BLE001 - etcd down: try again
                if stop.exists():
                    break
                time.sleep(0.5)
        raise RuntimeError("no client")

    def loop(group: str, meta: dict[str, int]) -> None:
        client_id = f"w{a.worker}-{group}-{os.getpid()}"
        with connect(client_id) as client:
            for k in range(1_000_000):
                if stop.exists():
                    return
                g = gradient(a.seed, meta["gi"], k, a.m)
                base = {"client": client_id, "group": group, "shard": meta["shard"],
                        "seq": k, "deadline": DEADLINE}  # fmt: skip
                write({**base, "outcome": None})
                rec: dict[str, Any] = {"outcome": UNKNOWN}
                start = time.monotonic()
                try:
                    rec = {"outcome": ACK, "t": int(client.push(group, g))}
                except DeadlineExceededError as exc:
                    rec["code"] = exc.code.name
                except RpcError as exc:
                    rec = {"outcome": REFUSED, "code": exc.code.name,
                           "reason": exc.reason}  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - recorded as unknown
                    rec["code"] = type(exc).__name__
                end = time.monotonic()
                write({**base, **rec, "start": start, "end": end})
                time.sleep(a.interval)

    threads = [threading.Thread(target=loop, args=item) for item in groups.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f.close()
    return 0


# -- the command -------------------------------------------------------------------
def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tests/chaos.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=float, default=150.0, help="seconds of "
                   "faults and pushes (setup and convergence come on top)")  # fmt: skip
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--gap", default="4,7", help="seconds between a heal and the "
                   "next fault: MIN,MAX (default 4,7)")  # fmt: skip
    p.add_argument("--out", help="directory of the run's files (default: a new "
                   "one under the temp dir, kept)")  # fmt: skip
    p.add_argument("--json", help="write the verdicts and figures to this file")
    p.add_argument("--lease-ttl", type=int, default=TTL, help="every replica's "
                   f"--lease-ttl in seconds (default {TTL}; 2 is the least etcd "
                   "grants, docs/cluster.md 'The lease TTL')")  # fmt: skip
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-netns", action="store_true",
                   help="run on the host's loopback (iptables rules in a chain "
                   "of the run's own, removed at the end)")  # fmt: skip
    sub = p.add_subparsers(dest="command")
    check = sub.add_parser("check", help="the report of a finished run again")
    check.add_argument("dir", help="the run's --out directory")
    w = sub.add_parser("worker")
    for name in ("url", "worker", "groups", "out", "stop", "seed", "m", "interval"):
        w.add_argument(f"--{name}", required=True,
                       type=float if name == "interval" else
                       int if name in ("worker", "seed", "m") else str)  # fmt: skip
    return p.parse_args(argv)


@contextlib.contextmanager
def namespace() -> Iterator[str | None]:
    """A network namespace of this run, with its loopback up (None: none can be
    made here); on leaving, every process left in it is killed and it is deleted."""
    name = f"onnxps-chaos-{os.getpid()}"
    made = run("ip", "netns", "add", name, check=False) if shutil.which("ip") else None
    if made is None or made.returncode != 0:
        yield None
        return
    try:
        run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name
    finally:
        pids = run("ip", "netns", "pids", name, check=False).stdout.split()
        for pid in pids:  # only this run's processes live in its namespace
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), sig)
        run("ip", "netns", "del", name, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.command == "worker":
        return worker(a)
    if a.command == "check":
        got = load(Path(a.dir))
        print(got["text"])
        return 0 if all(v["ok"] for v in got["verdicts"].values()) else 1
    if os.geteuid() != 0:
        print("tests/chaos.py needs root (netns, iptables, tmpfs)", file=sys.stderr)
        return 2
    out = Path(a.out or tempfile.mkdtemp(prefix="onnxps-chaos-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not a.inside and not a.no_netns:
        with namespace() as ns:
            if ns is not None:
                args = [*(sys.argv[1:] if argv is None else argv), "--inside",
                        "--out", str(out)]  # fmt: skip
                cmd = ["ip", "netns", "exec", ns, sys.executable, str(HERE), *args]
                proc = subprocess.Popen(cmd, start_new_session=True)
                try:
                    return proc.wait(a.duration + 900)
                finally:
                    reap([proc])
            log(
                "no network namespace can be made here: running on the host's "
                "loopback, partitions as iptables rules in a chain of the run's own"
            )
    lo, hi = (float(v) for v in a.gap.split(","))
    Replica.lease_ttl = a.lease_ttl
    log(f"replicas run --lease-ttl {a.lease_ttl}")
    r = Run(a.seed, a.duration, a.workers, out, gap=(lo, hi))
    got = execute(r, netns=a.inside)
    print(got["text"], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(got, indent=1, default=str))
    return 0 if all(v["ok"] for v in got["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
