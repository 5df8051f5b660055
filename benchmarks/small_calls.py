"""Small calls, many tensors and memory: what issue 24 measures, in one run.

    python benchmarks/small_calls.py [--rounds 5] [--seconds 3] [--workers 4]
                                     [--sections cpu,tensors,memory,rows,cluster,
                                      samehost,engines] [--mib 256]
                                     [--baseline REV]

- ``cpu``: ``--workers`` client processes push a 1,000-element float32 Adam gradient
  as fast as they can for ``--seconds``, first with no flags (``onnxps serve``,
  ``Client(address)``: frame calls on the data port), then to ``onnxps serve
  --durability none`` with a gRPC-only client, then to the floor: a raw grpcio
  unary server (bytes in, 8 bytes out, no protobuf) taking the same NumPy Adam step
  under a lock. The figure is the server
  process's CPU time (user + system, from /proc) per call, and calls per second.
  Rounds alternate which server goes first. ``--baseline REV`` adds the server of
  an older commit (``benchmarks/_baseline.py``: its own checkout and process),
  measured in the same rounds: an A/B of a change.
- ``tensors``: one client pushes and pulls a group of 200 tensors of 1,000 elements
  and a group of one 200,000-element tensor (float32 Adam), alternating; the figure
  is the median push+pull time of each and their ratio.
- ``memory``: a ``--mib`` MiB float32 Adam group (X, V and H: 3x that much state) is
  created, pushed, pulled and pushed returning X, twice over (with no flags
  through shared memory; the tuned rows over gRPC streams); the server's RSS after
  each call and its peak during that call (VmHWM, reset before each call through
  /proc/PID/clear_refs), above its idle RSS (read once it holds still: a server
  loads its fused kernels on a thread at start), as multiples of the state; the
  highest peak against the aim (1.3x the state + 150 MiB), and the steady figure
  (3 s after the last call: the server drops the pages of client segments no call
  used for a second, and trims malloc every 2 s) against 1.1x the state. The
  growth of the server's file-backed pages (RssFile: libraries loaded on first use)
  is printed apart: it is code, not state.
- ``rows``: one client pushes ``push_rows`` of 512 random rows of a 100,000 x 64
  float32 Adam table, then ``pull_rows`` of 512 rows, 200 calls each a round: rows/s
  and the server's CPU per call.
- ``cluster``: a 1,000-element group split in 2 parts over 2 shard processes
  (``split_bytes``), so every push and pull fans out to both, beside the same group
  whole on one shard: the shards' CPU and the client's CPU per call, and the p50.
- ``samehost``: the p50 of a 1,000-element push returning X over shared memory
  (``shared_memory="on"``, a Unix socket), inline over TCP and, for this tree, as a
  frame on a call channel (``frames="on"``, TCP), against torch RPC's
  shm transport (``benchmarks/samehost.py``'s server: a fused torch Adam) when torch
  is installed, and against the floor: the raw grpcio server of ``cpu`` taking the
  same step and answering X's bytes (no protobuf), over TCP.
- ``engines``: the ``cpu`` load against server engines, in alternating rounds: the
  raw server with 16 and with 128 worker threads, the raw step inline in a grpc.aio
  server's async handler (one event loop), and onnxps with its default ``--threads``
  and with ``--threads 4``: CPU per call, calls/s, the server's context switches
  per call (its live threads', from /proc/PID/task/*/status) and the ratio of CPU
  per call to the 16-thread raw server's.

``--baseline REV`` runs an older commit's server beside this tree's in the
``cpu``, ``rows``, ``cluster`` and ``samehost`` sections (rounds alternate), and
in ``memory`` (one server after the other).

Prints medians and min-max spreads; the machine may be shared: read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _proc import cpu_seconds, status_mibs
from onnxps.cli.process import start_server_process, stop_processes
from onnxps.client import Adam, Client

SMALL = 1000
MIB = 1 << 20
_RAW_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


# -- the raw gRPC floor ------------------------------------------------------------
def raw_server(port_file: str, threads: int = 16) -> None:
    from concurrent import futures

    import grpc
    from onnxps.server.kernels import Stepper, make_attrs

    x = np.linspace(-1, 1, SMALL, dtype=np.float32)
    v, h = np.zeros(SMALL, np.float32), np.zeros(SMALL, np.float32)
    stepper = Stepper(make_attrs("Adam", {}), np.float32, [SMALL])
    lock = threading.Lock()
    t = [0]

    def push(req: bytes, ctx: Any) -> bytes:
        g = np.frombuffer(req, np.float32)
        with lock:
            stepper.step(1e-3, t[0], [x], [g], [v], [h])
            t[0] += 1
            return t[0].to_bytes(8, "little")

    def push_x(req: bytes, ctx: Any) -> bytes:  # the same step, X back
        g = np.frombuffer(req, np.float32)
        with lock:
            stepper.step(1e-3, t[0], [x], [g], [v], [h])
            t[0] += 1
            return x.tobytes()

    handler = grpc.method_handlers_generic_handler(
        "raw.Raw",
        {
            "Push": grpc.unary_unary_rpc_method_handler(push),
            "PushX": grpc.unary_unary_rpc_method_handler(push_x),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(threads), handlers=[handler], options=_RAW_OPTIONS
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def raw_aio_server(port_file: str) -> None:
    """The raw floor on grpc.aio: one event loop thread takes the same Adam step
    inline in an async handler (no lock: the loop runs one handler at a time)."""
    import asyncio

    import grpc
    from onnxps.server.kernels import Stepper, make_attrs

    x = np.linspace(-1, 1, SMALL, dtype=np.float32)
    v, h = np.zeros(SMALL, np.float32), np.zeros(SMALL, np.float32)
    stepper = Stepper(make_attrs("Adam", {}), np.float32, [SMALL])
    t = [0]

    async def push(req: bytes, ctx: Any) -> bytes:
        g = np.frombuffer(req, np.float32)
        stepper.step(1e-3, t[0], [x], [g], [v], [h])
        t[0] += 1
        return t[0].to_bytes(8, "little")

    async def serve() -> None:
        handler = grpc.method_handlers_generic_handler(
            "raw.Raw", {"Push": grpc.unary_unary_rpc_method_handler(push)}
        )
        server = grpc.aio.server(handlers=[handler], options=_RAW_OPTIONS)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        Path(port_file).write_text(str(port))
        await server.wait_for_termination()

    asyncio.run(serve())


def _raw_worker(port: int, seconds: float, out: Any) -> None:
    import grpc

    g = np.full(SMALL, 1e-3, np.float32).tobytes()
    with grpc.insecure_channel(f"127.0.0.1:{port}", _RAW_OPTIONS) as channel:
        push = channel.unary_unary("/raw.Raw/Push")
        push(g)  # connected
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            push(g)
            n += 1
    out.put(n)


def _onnxps_worker(
    target: tuple[str, dict[str, str]], seconds: float, out: Any
) -> None:
    address, flags = target
    g = np.full(SMALL, 1e-3, np.float32)
    with Client(address, **flags) as c:  # type: ignore[arg-type]
        c.push("small", g)
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            c.push("small", g)
            n += 1
    out.put(n)


def _load(
    worker: Callable[..., None], target: Any, pid: int, workers: int, seconds: float
) -> tuple[float, float]:
    """(server CPU microseconds per call, calls per second) under ``workers``."""
    us, rate, _ = _load_calls(worker, target, pid, workers, seconds)
    return us, rate


def _load_calls(
    worker: Callable[..., None], target: Any, pid: int, workers: int, seconds: float
) -> tuple[float, float, int]:
    """``_load``'s figures and the number of calls."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(target, seconds, q)) for _ in range(workers)
    ]
    cpu0 = cpu_seconds(pid)
    t0 = time.monotonic()
    for p in procs:
        p.start()
    calls = sum(q.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join()
    wall = time.monotonic() - t0
    cpu = cpu_seconds(pid) - cpu0
    return cpu / max(calls, 1) * 1e6, calls / wall, calls


def _start_raw(
    tmp: Path, tag: str, target: Callable[..., None] = raw_server, *args: Any
) -> tuple[Any, int]:
    """The raw grpcio server process (``raw_server``) and its port."""
    ctx = mp.get_context("spawn")
    port_file = tmp / f"raw-{tag}.port"
    raw = ctx.Process(target=target, args=(str(port_file), *args), daemon=True)
    raw.start()
    while not port_file.exists() or not port_file.read_text():
        time.sleep(0.05)
    return raw, int(port_file.read_text())


# What a user gets: ``onnxps serve`` with no flags (its default durability,
# snapshots, in a data directory of its own; a free port) and ``Client(address)``.
# Tuned rows come after it and say what they set.
def _default_server(
    tmp: Path, tag: str, env: dict[str, str] | None = None
) -> tuple[Any, str]:
    data = tmp / f"{tag}-data"
    return start_server_process(
        "--durability",
        "snapshot",
        "--data-dir",
        str(data),
        log=tmp / f"{tag}.log",
        env=env,
    )


GRPC_ONLY = {"shared_memory": "off", "data_channel": "off", "frames": "off"}
_GRPC_ONLY_NAME = "shared_memory='off', data_channel='off', frames='off'"


def cpu_section(args: argparse.Namespace, tmp: Path) -> None:
    raw, port = _start_raw(tmp, "cpu")
    default = _default_server(tmp, "cpu-default")
    tuned = start_server_process(log=tmp / "cpu.log")  # --durability none
    servers: list[tuple[str, Any, str, dict[str, str]]] = [
        ("no flags", *default, {}),
        ("serve --durability none; client gRPC only", *tuned, GRPC_ONLY),
    ]
    with contextlib.ExitStack() as stack:
        try:
            if args.baseline:
                from _baseline import checkout, tree_env

                old = stack.enter_context(checkout(args.baseline))
                env = tree_env(old.tree)
                started = start_server_process(log=tmp / "old.log", env=env)
                servers.append(
                    (f"baseline {old.label}, gRPC only", *started, GRPC_ONLY)
                )
            _cpu_rounds(args, servers, raw.pid or 0, port)
        finally:
            stop_processes([p for _, p, _, _ in servers])
            raw.kill()


def _cpu_rounds(
    args: argparse.Namespace,
    servers: list[tuple[str, Any, str, dict[str, str]]],
    raw_pid: int,
    port: int,
) -> None:
    for _, _, address, _ in servers:
        with Client(address) as c:
            x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
            c.create_group("small", Adam(), learning_rate=1e-3, tensors={"w": x0})
    figures: dict[str, list[tuple[float, float]]] = {n: [] for n, *_ in servers}
    figures["raw gRPC"] = []
    for r in range(args.rounds + 1):  # round 0 warms up
        order: list[tuple[str, Callable[..., None], Any, int]] = [
            (name, _onnxps_worker, (address, flags), proc.pid)
            for name, proc, address, flags in servers
        ]
        order.append(("raw gRPC", _raw_worker, port, raw_pid))
        if r % 2:
            order.reverse()
        for name, worker, target, pid in order:
            got = _load(worker, target, pid, args.workers, args.seconds)
            if r:
                figures[name].append(got)
    print(f"\nserver CPU per 1,000-element Adam push, {args.workers} clients")
    print(f"  {'server; client':58s} {'us CPU/call':>16s} {'calls/s':>16s}")
    for name, runs in figures.items():
        us = [u for u, _ in runs]
        rate = [c for _, c in runs]
        print(f"  {name:58s} {_cell(us, 0):>16s} {_cell(rate, 0):>16s}")
    for name, *_ in servers:
        ratios = _ratios(figures[name], figures["raw gRPC"])
        print(f"  {name} / floor (CPU per call): {_cell(ratios, 2)}")
    if args.baseline:
        new, old = figures[servers[1][0]], figures[servers[-1][0]]
        wins = sum(a[0] < b[0] for a, b in zip(new, old, strict=True))
        print(
            f"  this tree / {servers[-1][0]} (CPU per call, gRPC only): "
            f"{_cell(_ratios(new, old), 2)}, less CPU in {wins} of {len(new)} rounds"
        )


def _switches(pid: int) -> int:
    """Voluntary + involuntary context switches of the live threads of ``pid``."""
    n = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    n += int(line.split()[1])
    return n


def engines_section(args: argparse.Namespace, tmp: Path) -> None:
    """The ``cpu`` load against server engines: raw sync grpcio with 16 and 128
    worker threads, raw grpc.aio (the step inline on the event loop), and onnxps
    with its default ``--threads`` and with ``--threads 4``."""
    raws = [
        ("raw sync, 16 thr", *_start_raw(tmp, "s16", raw_server, 16)),
        ("raw sync, 128 thr", *_start_raw(tmp, "s128", raw_server, 128)),
        ("raw grpc.aio", *_start_raw(tmp, "aio", raw_aio_server)),
    ]
    onnxps = [
        ("onnxps, 128 thr", *start_server_process(log=tmp / "e128.log")),
        (
            "onnxps, 4 thr",
            *start_server_process("--threads", "4", log=tmp / "e4.log"),
        ),
    ]
    try:
        for _, _, address in onnxps:
            with Client(address) as c:
                x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
                c.create_group("small", Adam(), learning_rate=1e-3, tensors={"w": x0})
        items = [(n, _raw_worker, port, p.pid) for n, p, port in raws] + [
            (n, _onnxps_worker, (a, GRPC_ONLY), p.pid) for n, p, a in onnxps
        ]
        figures: dict[str, list[tuple[float, float, float]]] = {}
        for r, (name, worker, target, pid) in _alternating(args.rounds, items):
            sw0 = _switches(pid)
            us, rate, calls = _load_calls(
                worker, target, pid, args.workers, args.seconds
            )
            if r:
                figures.setdefault(name, []).append(
                    (us, rate, (_switches(pid) - sw0) / max(calls, 1))
                )
    finally:
        stop_processes([p for _, p, _ in onnxps])
        for _, p, _ in raws:
            p.kill()
    floor = figures["raw sync, 16 thr"]
    print(f"\nserver engines, 1,000-element Adam push, {args.workers} clients")
    print(
        f"  {'server':18s} {'us CPU/call':>18s} {'calls/s':>18s} "
        f"{'ctx switches/call':>18s} {'/ raw sync 16':>18s}"
    )
    for name, *_ in items:
        runs = figures[name]
        cols = [_cell([run[k] for run in runs], 0) for k in range(2)]
        cols.append(_cell([run[2] for run in runs], 1))
        cols.append(_cell([a[0] / b[0] for a, b in zip(runs, floor, strict=True)], 2))
        print(f"  {name:18s} " + " ".join(f"{c:>18s}" for c in cols))


def _ratios(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[float]:
    return [x[0] / y[0] for x, y in zip(a, b, strict=True)]


def tensors_section(args: argparse.Namespace, tmp: Path) -> None:
    """The default pair first (``onnxps serve``, ``Client(address)``), then the
    tuned one (``--durability none``, gRPC only), in the same alternating rounds."""
    default = _default_server(tmp, "tensors-default")
    tuned = start_server_process(log=tmp / "tensors.log")
    pairs = [("no flags", default, {}), (f"{_GRPC_ONLY_NAME}", tuned, GRPC_ONLY)]
    rng = np.random.default_rng(0)
    many = {f"t{i}": rng.standard_normal(1000, np.float32) for i in range(200)}
    one = {"t": rng.standard_normal(200_000, np.float32)}
    g_many = [np.full(1000, 1e-3, np.float32)] * 200
    g_one = [np.full(200_000, 1e-3, np.float32)]
    shapes = [("200 x 1,000", "many", g_many), ("1 x 200,000", "one", g_one)]
    clients = []
    try:
        for _, (_, address), flags in pairs:
            c = Client(address, **flags)  # type: ignore[arg-type]
            clients.append(c)
            c.create_group("many", Adam(), learning_rate=1e-3, tensors=many)
            c.create_group("one", Adam(), learning_rate=1e-3, tensors=one)
        times: dict[tuple[str, str], list[float]] = {}
        items = [(k, s) for k in range(len(pairs)) for s in shapes]
        for r, (k, (shape, group, grads)) in _alternating(args.rounds, items):
            c, runs = clients[k], []
            for _ in range(20):
                t0 = time.perf_counter()
                c.push(group, *grads)
                c.pull(group)
                runs.append(time.perf_counter() - t0)
            if r:
                times.setdefault((pairs[k][0], shape), []).append(
                    statistics.median(runs) * 1e3
                )
        print("\npush + pull of 200,000 float32 Adam elements (ms, median of 20)")
        for name, _, _ in pairs:
            many_t, one_t = times[(name, shapes[0][0])], times[(name, shapes[1][0])]
            print(f"  {name}:")
            print(f"    {shapes[0][0]:14s} {_cell(many_t, 2)}")
            print(f"    {shapes[1][0]:14s} {_cell(one_t, 2)}")
            ratios = [a / b for a, b in zip(many_t, one_t, strict=True)]
            print(f"    200 tensors / one tensor: {_cell(ratios, 2)} (aim <= 1.3)")
    finally:
        for c in clients:
            c.close()
        stop_processes([default[0], tuned[0]])


def _settled(pid: int, seconds: float = 60.0) -> None:
    """Wait until the server's RSS holds still (within 1 MiB for 2 s, at most
    ``seconds``): a server loads its fused kernels (numba, LLVM: some 50 MiB of
    code and compiler) on a thread at start, which is no state of a group."""
    deadline = time.monotonic() + seconds
    last: list[float] = []
    while time.monotonic() < deadline:
        last = [*last[-3:], status_mibs(pid, "VmRSS")[0]]
        if len(last) == 4 and max(last) - min(last) < 1:
            return
        time.sleep(0.5)


def memory_section(args: argparse.Namespace, tmp: Path) -> None:
    """The default pair first, then ``--durability none`` with a client that
    keeps off shared memory (and, with ``--baseline``, the old tree's)."""
    proc, address = _default_server(tmp, "memory-default")
    try:
        print("\nserver memory (no flags: onnxps serve, Client(address))", end="")
        _memory_calls(args, proc.pid, address, {})
    finally:
        stop_processes([proc])
    if args.baseline:
        from _baseline import checkout, tree_env

        with checkout(args.baseline) as old:
            env = tree_env(old.tree)
            proc, address = _default_server(tmp, "memory-default-old", env)
            try:
                print(f"\nserver memory (no flags, baseline {old.label})", end="")
                _memory_calls(args, proc.pid, address, {})
            finally:
                stop_processes([proc])
    with _servers(args, tmp, "memory") as servers:
        for name, (proc,), (address,), _ in servers:
            print(
                f"\nserver memory ({name}: --durability none; "
                "client shared_memory='off')",
                end="",
            )
            _memory_calls(args, proc.pid, address, {"shared_memory": "off"})


def _memory_calls(
    args: argparse.Namespace, pid: int, address: str, flags: dict[str, str]
) -> None:
    n = args.mib * MIB // 4
    state = 3 * args.mib
    with Client(address, timeout=600, **flags) as c:  # type: ignore[arg-type]
        _settled(pid)
        base, base_file = status_mibs(pid, "VmRSS", "RssFile")
        print(f", {args.mib} MiB float32 Adam group ({state} MiB)")
        print(f"  idle RSS {base:.0f} MiB; figures below are RSS - idle")
        peaks: list[float] = []
        steady: list[float] = []

        def call(step: str, fn: Callable[[], Any]) -> None:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM = VmRSS
            fn()
            rss, peak, shm = status_mibs(pid, "VmRSS", "VmHWM", "RssShmem")
            peaks.append(peak - base)
            steady.append(rss - base)
            print(
                f"  {step:24s} RSS {rss - base:6.0f} MiB "
                f"({(rss - base) / state:.2f}x)  peak {peak - base:6.0f} MiB "
                f"({(peak - base) / state:.2f}x)  of RSS shared memory {shm:.0f} MiB"
            )

        x0 = np.zeros(n, np.float32)
        call(
            "create",
            lambda x0=x0: c.create_group(
                "big", Adam(), learning_rate=1e-3, tensors={"w": x0}
            ),
        )
        del x0
        g = np.full(n, 1e-3, np.float32)
        for _ in range(2):
            call("push", lambda: c.push("big", g))
            call("pull", lambda: c.pull("big"))
            call("push returning X", lambda: c.push("big", g, return_values=True))
        for _ in range(3):
            c.push("big", g)
            c.pull("big")
        call("after 3 more push + pull", lambda: None)
        # the server gives back what its last calls held (client segments it
        # mapped: after IDLE_SECONDS; malloc's free memory: every TRIM_SECONDS)
        call("3 s later (steady)", lambda: time.sleep(3))
        files = status_mibs(pid, "RssFile")[0] - base_file
        aim = 1.3 * state + 150
        top = max(peaks)
        print(
            f"  highest peak {top:.0f} MiB ({top / state:.2f}x), aim <= 1.3x + "
            f"150 MiB = {aim:.0f} MiB ({aim / state:.2f}x): "
            f"{'met' if top <= aim else 'NOT met'}; of it {files:.0f} MiB of "
            "libraries loaded since idle (RssFile)"
        )
        last = steady[-1]
        print(
            f"  steady (after the last calls) {last:.0f} MiB ({last / state:.2f}x), "
            f"aim <= 1.1x: {'met' if last <= 1.1 * state else 'NOT met'}"
        )


# -- rows, cluster fan-out, same host -------------------------------------------------
ROWS, DIM, BATCH, ROW_CALLS = 100_000, 64, 512, 200
FANOUT_CALLS = 300


@contextlib.contextmanager
def _servers(
    args: argparse.Namespace, tmp: Path, tag: str, *extra: str
) -> Iterator[list[tuple[str, list[Any], list[str], dict[str, str] | None]]]:
    """(name, processes, addresses, environment) of this tree's servers and, with
    ``--baseline``, of the baseline's: ``extra`` per server, one server per
    entry of ``extra`` that is a list (shards)."""
    shard_args: list[tuple[str, ...]] = [t for t in extra if isinstance(t, tuple)]
    plain = tuple(a for a in extra if isinstance(a, str))
    sets = shard_args or [plain]
    trees: list[tuple[str, dict[str, str] | None]] = [("this tree", None)]
    with contextlib.ExitStack() as stack:
        if args.baseline:
            from _baseline import checkout, tree_env

            old = stack.enter_context(checkout(args.baseline))
            trees.append((f"baseline {old.label}", dict(tree_env(old.tree))))
        out: list[tuple[str, list[Any], list[str], dict[str, str] | None]] = []
        try:
            for k, (name, env) in enumerate(trees):
                procs, addresses = [], []
                for i, a in enumerate(sets):
                    log = tmp / f"{tag}-{k}-{i}.log"
                    proc, address = start_server_process(*a, log=log, env=env)
                    procs.append(proc)
                    addresses.append(address)
                out.append((name, procs, addresses, env))
            yield out
        finally:
            stop_processes([p for _, procs, _, _ in out for p in procs])


def _alternating(rounds: int, items: list[Any]) -> Iterator[tuple[int, Any]]:
    """(round, item) for ``rounds`` rounds after a warm-up round 0, the items'
    order reversed every other round."""
    for r in range(rounds + 1):
        for item in items if r % 2 == 0 else items[::-1]:
            yield r, item


def _measured(pids: list[int], fn: Callable[[], None]) -> tuple[float, float, float]:
    """(wall seconds, the servers' CPU seconds, this process's CPU seconds) of fn."""
    cpu0 = sum(cpu_seconds(p) for p in pids)
    own0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    own = time.process_time() - own0
    return wall, sum(cpu_seconds(p) for p in pids) - cpu0, own


def rows_section(args: argparse.Namespace, tmp: Path) -> None:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    idx = [rng.integers(0, ROWS, BATCH) for _ in range(ROW_CALLS)]
    g = (rng.standard_normal((BATCH, DIM)) * 1e-3).astype(np.float32)
    with _servers(args, tmp, "rows") as servers:
        clients = {}
        for name, _, (address,), _ in servers:
            c = clients[name] = Client(address, timeout=120)
            c.create_group("emb", Adam(), learning_rate=1e-3, tensors={"emb": table})
        figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
        calls = {
            "push_rows": lambda c: [c.push_rows("emb", {"emb": (i, g)}) for i in idx],
            "pull_rows": lambda c: [c.pull_rows("emb", {"emb": i}) for i in idx],
        }
        for r, (name, procs, _, _) in _alternating(args.rounds, servers):
            for kind, run in calls.items():
                c = clients[name]
                pids = [p.pid for p in procs]
                wall, cpu, _ = _measured(pids, functools.partial(run, c))
                if r:
                    n = len(idx)
                    figures.setdefault((name, kind), []).append(
                        (n * BATCH / wall, cpu / n * 1e6)
                    )
        for c in clients.values():
            c.close()
    print(f"\nrows: {BATCH} random rows of a {ROWS:,} x {DIM} float32 Adam table")
    print(f"  {'server, call':30s} {'rows/s':>22s} {'server us CPU/call':>22s}")
    for (name, kind), runs in sorted(figures.items(), key=_this_tree_first):
        rate = [a for a, _ in runs]
        us = [b for _, b in runs]
        print(f"  {name + ', ' + kind:30s} {_cell(rate, 0):>22s} {_cell(us, 0):>22s}")


def cluster_section(args: argparse.Namespace, tmp: Path) -> None:
    shards = (("--shard", "0/2"), ("--shard", "1/2"))
    g = np.full(SMALL, 1e-3, np.float32)
    w = {"w": np.linspace(-1, 1, SMALL, dtype=np.float32)}
    with _servers(args, tmp, "cluster", *shards) as servers:
        clients = {}
        for name, _, addresses, _ in servers:
            # a 1,000-element float32 group (4,000 bytes) splits in 2 parts
            c = clients[name] = Client(addresses, timeout=120, split_bytes=2048)
            info = c.create_group("split", Adam(), learning_rate=1e-3, tensors=w)
            assert len(info.parts) == 2, info
            whole = Client(addresses, timeout=120)
            whole.create_group("whole", Adam(), learning_rate=1e-3, tensors=w)
            whole.close()
        calls = {
            "push, 2 parts": lambda c: c.push("split", g),
            "pull, 2 parts": lambda c: c.pull("split"),
            "push, whole": lambda c: c.push("whole", g),
        }
        figures: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for r, (name, procs, _, _) in _alternating(args.rounds, servers):
            pids = [p.pid for p in procs]
            for kind, call in calls.items():
                c = clients[name]
                times: list[float] = []

                def run(
                    c: Any = c, call: Any = call, times: list[float] = times
                ) -> None:
                    for _ in range(FANOUT_CALLS):
                        t0 = time.perf_counter()
                        call(c)
                        times.append(time.perf_counter() - t0)

                _, cpu, own = _measured(pids, run)
                if r:
                    figures.setdefault((name, kind), []).append(
                        (
                            cpu / FANOUT_CALLS * 1e6,
                            own / FANOUT_CALLS * 1e6,
                            statistics.median(times) * 1e6,
                        )
                    )
        for c in clients.values():
            c.close()
    print(f"\ncluster fan-out: a {SMALL:,}-element group in 2 parts on 2 shards")
    print(
        f"  {'server, call':30s} {'shards us CPU/call':>20s} "
        f"{'client us CPU/call':>20s} {'p50 us':>20s}"
    )
    for (name, kind), runs in sorted(figures.items(), key=_this_tree_first):
        cols = [_cell([run[k] for run in runs], 0) for k in range(3)]
        print(
            f"  {name + ', ' + kind:30s} {cols[0]:>20s} {cols[1]:>20s} {cols[2]:>20s}"
        )


def _this_tree_first(item: tuple[tuple[str, str], Any]) -> tuple[bool, str]:
    (name, kind), _ = item
    return name != "this tree", name


def _timed_calls(call: Callable[[Any], Any], c: Any, times: list[float]) -> None:
    """``FANOUT_CALLS`` calls of ``call(c)``, each one's seconds into ``times``."""
    for _ in range(FANOUT_CALLS):
        t0 = time.perf_counter()
        call(c)
        times.append(time.perf_counter() - t0)


def _p50_us(call: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def samehost_section(args: argparse.Namespace, tmp: Path) -> None:
    g = np.full(SMALL, 1e-3, np.float32)
    x0 = np.linspace(-1, 1, SMALL, dtype=np.float32)
    sock = tmp / "small.sock"
    with _servers(args, tmp, "samehost") as tcp_servers:
        ways: list[tuple[str, Callable[[], Any]]] = []
        clients: list[Client] = []
        for k, (name, procs, (address,), env) in enumerate(tcp_servers):
            unix_proc, unix = start_server_process(
                "--address", f"unix://{sock}.{k}", log=tmp / f"unix{k}.log", env=env
            )
            procs.append(unix_proc)  # stopped with the others
            for way, addr, kw in (
                ("shm", unix, {"shared_memory": "on"}),
                ("unix socket inline", unix, {"shared_memory": "off"}),
                ("tcp inline", address, {"shared_memory": "off"}),
            ):
                c = Client(addr, timeout=60, **kw)
                clients.append(c)
                group = f"small-{way}"
                c.create_group(group, Adam(), learning_rate=1e-3, tensors={"w": x0})
                ways.append(
                    (
                        f"{name}, {way}",
                        lambda c=c, group=group: c.push(group, g, return_values=True),
                    )
                )
        # this tree's frame calls (Client(frames="on")) to a server with a data port
        name, procs, _, env = tcp_servers[0]
        frames_proc, framed = start_server_process(
            "--data-port", "0", log=tmp / "frames.log", env=env
        )
        procs.append(frames_proc)  # stopped with the others
        c = Client(framed, timeout=60, shared_memory="off", frames="on")
        clients.append(c)
        c.create_group("small-frames", Adam(), learning_rate=1e-3, tensors={"w": x0})
        ways.append(
            (
                f"{name}, tcp frames",
                lambda c=c: c.push("small-frames", g, return_values=True),
            )
        )
        import grpc

        raw, port = _start_raw(tmp, "samehost")
        raw_channel = grpc.insecure_channel(f"127.0.0.1:{port}", _RAW_OPTIONS)
        push_x, g_bytes = raw_channel.unary_unary("/raw.Raw/PushX"), g.tobytes()
        # the floor: the same step, gradient bytes in and X's bytes out, no protobuf
        ways.append(("raw grpcio floor, tcp", lambda: push_x(g_bytes, timeout=60)))
        rpc = _torch_rpc()
        if rpc is not None:
            import torch
            from samehost import _torch_create, _torch_push_pull

            rpc.call(_torch_create, "small", SMALL)
            gt = torch.from_numpy(g)
            ways.append(
                ("torch RPC shm", lambda: rpc.call(_torch_push_pull, "small", gt))
            )
        p50s: dict[str, list[float]] = {}
        try:
            for r, (name, call) in _alternating(args.rounds, ways):
                p50 = _p50_us(call, 300)
                if r:
                    p50s.setdefault(name, []).append(p50)
        finally:
            for c in clients:
                c.close()
            raw_channel.close()
            raw.kill()
            if rpc is not None:
                rpc.stop()
    print(f"\nsame host: {SMALL:,}-element float32 Adam push returning X, p50 us")
    for name, runs in sorted(p50s.items(), key=lambda kv: kv[0].startswith("b")):
        print(f"  {name:34s} {_cell(runs, 0):>20s}")
    if "torch RPC shm" in p50s:
        torch_p50 = p50s["torch RPC shm"]
        for name, runs in p50s.items():
            if name.endswith((", shm", ", unix socket inline", ", tcp frames")):
                ratios = [a / b for a, b in zip(runs, torch_p50, strict=True)]
                print(f"  {name} / torch RPC shm: {_cell(ratios, 2)}")


def _torch_rpc() -> Any:
    """benchmarks/samehost.py's torch RPC shm server, or None without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed: no torch RPC shm row")
        return None
    from samehost import TorchRpc

    return TorchRpc()


def _cell(values: list[float], digits: int) -> str:
    med = statistics.median(values)
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--sections", default="cpu,tensors,memory,rows,cluster,samehost")
    p.add_argument("--baseline", help="also measure this commit's server")
    args = p.parse_args()
    sections = {
        "cpu": cpu_section,
        "tensors": tensors_section,
        "memory": memory_section,
        "rows": rows_section,
        "cluster": cluster_section,
        "samehost": samehost_section,
        "engines": engines_section,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sections.split(","):
            sections[name](args, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
