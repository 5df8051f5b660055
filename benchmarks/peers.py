"""onnxps beside its peers, in one run, alternating rounds.

    python benchmarks/peers.py [--rounds 5] [--steps 3] [--small-calls 300]
                               [--onnxps-address ADDR ...] [--no-torch]

Systems (each a server process and a client process, on this host):

- ``onnxps, no flags``: ``onnxps serve`` with no flag but a free loopback port (its
  defaults) and ``Client(address)`` with no option: what a user gets (on one host,
  shared memory for calls of 64 KiB or more).

- ``onnxps tcp``: ``onnxps serve`` on a loopback port; the client pushes and pulls
  the 64 MiB group through the streams (``transport="stream"``), and the 1,000-element
  group through unary calls (``transport="auto"``). ``--onnxps-address`` adds a
  system per address of a server already running (e.g. ``unix:///tmp/ps.sock``, or a
  same-host shared-memory transport): they are measured the same way.
- ``onnxps data``: ``onnxps serve --data-port 0``; the client moves the 64 MiB
  group's bytes on the data channel (``data_channel="on"``, shared memory off, as
  between hosts); small calls as for ``onnxps tcp``.
- ``torch rpc uv`` / ``torch rpc shm``: a ``torch.distributed.rpc`` parameter server
  (TensorPipe, ``_transports=["uv"]`` (TCP) or ``["shm"]``, channel ``basic``) whose
  functions step a server-side ``torch.optim.Adam(fused=True)`` (foreach when fused is
  not available on CPU): push = ``rpc_sync(step, G)``, pull = ``rpc_sync(values)``,
  push returning X = ``rpc_sync(step_and_values, G)``. Only when torch is installed.
- ``raw gRPC``: the floor: plain gRPC byte streams from Python, 1 MiB chunks, no
  protobuf; the server assembles G into an array and takes the same NumPy step as
  onnxps (its ``Stepper``), and streams X back the same way.

Figures per system: push ms, pull ms and push returning X ms on a 64 MiB float32 Adam
group (median of ``--steps`` per round), and the p50 in microseconds of
``--small-calls`` pushes returning X of a 1,000-element group. Rounds alternate which
system goes first. The table gives the median over rounds and the min-max spread;
then the ratios the issue states as aims.

The machine may be shared: read the ratios beside the spread, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20
SMALL = 1000
CHUNK = 1 << 20
FIGURES = ("push", "pull", "push_values", "small_us")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_rounds(measure: Callable[[int, int], dict[str, float]]) -> None:
    """A client process: one JSON line of figures per round asked on stdin."""
    print("ready", flush=True)
    for line in sys.stdin:
        steps, small_calls = (int(v) for v in line.split())
        print(json.dumps(measure(steps, small_calls)), flush=True)


def _timed(fn: Callable[[], Any], times: int) -> list[float]:
    out = []
    for _ in range(times):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _figures(
    push: Callable[[], Any],
    pull: Callable[[], Any],
    push_values: Callable[[], Any] | None,
    small: Callable[[], Any],
    steps: int,
    small_calls: int,
) -> dict[str, float]:
    out = {
        "push": 1e3 * statistics.median(_timed(push, steps)),
        "pull": 1e3 * statistics.median(_timed(pull, steps)),
        "small_us": 1e6 * statistics.median(_timed(small, small_calls)),
    }
    if push_values is not None:
        out["push_values"] = 1e3 * statistics.median(_timed(push_values, steps))
    return out


# -- onnxps ----------------------------------------------------------------------------
def onnxps_client(
    address: str, mib: int, data_channel: bool = False, defaults: bool = False
) -> None:
    from onnxps.client import Adam, Client

    n = mib * MIB // 4
    x0 = np.linspace(-1, 1, n, dtype=np.float32)
    g = np.full(n, 1e-3, np.float32)
    gs = np.full(SMALL, 1e-3, np.float32)
    tag = f"peers-{os.getpid()}"
    options: dict[str, Any]
    if defaults:
        options = {}  # what Client(address) takes with no option
    elif data_channel:
        options = {"data_channel": "on", "shared_memory": "off"}
    else:
        options = {"transport": "stream"}
    with (
        Client(address, timeout=300, **options) as big,
        Client(address, timeout=60) as small,
    ):
        big.create_group(f"{tag}-big", Adam(), learning_rate=1e-3, tensors={"x": x0})
        small.create_group(
            f"{tag}-small",
            Adam(),
            learning_rate=1e-3,
            tensors={"x": np.zeros(SMALL, np.float32)},
        )
        for _ in range(2):  # warm-up: channels, first steps
            big.push(f"{tag}-big", g)
            big.pull(f"{tag}-big")
            big.push(f"{tag}-big", g, return_values=True)
            small.push(f"{tag}-small", gs, return_values=True)
        try:
            _serve_rounds(
                lambda steps, calls: _figures(
                    lambda: big.push(f"{tag}-big", g),
                    lambda: big.pull(f"{tag}-big"),
                    lambda: big.push(f"{tag}-big", g, return_values=True),
                    lambda: small.push(f"{tag}-small", gs, return_values=True),
                    steps,
                    calls,
                )
            )
        finally:
            big.delete_group(f"{tag}-big")
            small.delete_group(f"{tag}-small")


# -- torch.distributed.rpc -------------------------------------------------------------
_PS: dict[str, Any] = {}


def ps_create(name: str, n: int) -> str:
    import torch

    x = torch.nn.Parameter(torch.linspace(-1, 1, n, dtype=torch.float32))
    try:
        opt = torch.optim.Adam([x], lr=1e-3, fused=True)
        kind = "fused"
    except (RuntimeError, ValueError):
        opt = torch.optim.Adam([x], lr=1e-3, foreach=True)
        kind = "foreach"
    _PS[name] = (x, opt)
    return kind


def ps_step(name: str, g: Any) -> int:
    x, opt = _PS[name]
    x.grad = g
    opt.step()
    return int(opt.state[x]["step"])


def ps_values(name: str) -> Any:
    return _PS[name][0].detach()


def ps_step_and_values(name: str, g: Any) -> Any:
    ps_step(name, g)
    return ps_values(name)


def _torch_options(transport: str) -> Any:
    from torch.distributed import rpc

    return rpc.TensorPipeRpcBackendOptions(
        init_method=os.environ["PEERS_INIT"],
        rpc_timeout=300,
        _transports=[transport],
        _channels=["basic"],
    )


def torch_server(transport: str) -> None:
    from torch.distributed import rpc

    rpc.init_rpc(
        "ps", rank=0, world_size=2, rpc_backend_options=_torch_options(transport)
    )
    rpc.shutdown()  # waits for the worker's shutdown


def torch_client(transport: str, mib: int) -> None:
    import torch
    from torch.distributed import rpc

    rpc.init_rpc(
        "worker", rank=1, world_size=2, rpc_backend_options=_torch_options(transport)
    )
    try:
        n = mib * MIB // 4
        kind = rpc.rpc_sync("ps", ps_create, args=("big", n))
        rpc.rpc_sync("ps", ps_create, args=("small", SMALL))
        print(f"adam {kind}", file=sys.stderr, flush=True)
        g = torch.full((n,), 1e-3)
        gs = torch.full((SMALL,), 1e-3)
        for _ in range(2):
            rpc.rpc_sync("ps", ps_step, args=("big", g))
            rpc.rpc_sync("ps", ps_values, args=("big",))
            rpc.rpc_sync("ps", ps_step_and_values, args=("big", g))
            rpc.rpc_sync("ps", ps_step_and_values, args=("small", gs))
        _serve_rounds(
            lambda steps, calls: _figures(
                lambda: rpc.rpc_sync("ps", ps_step, args=("big", g)),
                lambda: rpc.rpc_sync("ps", ps_values, args=("big",)),
                lambda: rpc.rpc_sync("ps", ps_step_and_values, args=("big", g)),
                lambda: rpc.rpc_sync("ps", ps_step_and_values, args=("small", gs)),
                steps,
                calls,
            )
        )
    finally:
        rpc.shutdown()


# -- raw gRPC floor --------------------------------------------------------------------
_RAW_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
]


def raw_server(mib: int, port_file: str) -> None:
    from concurrent import futures

    import grpc
    from onnxps.server.kernels import Stepper, make_attrs

    groups: dict[int, tuple[Any, list[Any], Any]] = {}

    def group(n: int) -> tuple[Any, list[Any], Any]:
        if n not in groups:
            x = np.linspace(-1, 1, n, dtype=np.float32)
            state = [np.zeros(n, np.float32), np.zeros(n, np.float32)]
            stepper = Stepper(make_attrs("Adam", {}), np.float32, [n])
            groups[n] = (x, state, stepper)
        return groups[n]

    t = [0]

    def up(it: Any, ctx: Any) -> bytes:
        chunks = iter(it)
        n = int.from_bytes(next(chunks), "little")
        x, (v, h), stepper = group(n)
        g = np.empty(n, np.float32)
        view = memoryview(g).cast("B")
        pos = 0
        for b in chunks:
            view[pos : pos + len(b)] = b
            pos += len(b)
        stepper.step(1e-3, t[0], [x], [g], [v], [h])
        t[0] += 1
        return t[0].to_bytes(8, "little")

    def down(req: bytes, ctx: Any) -> Any:
        x, _, _ = group(int.from_bytes(req, "little"))
        view = memoryview(x.copy()).cast("B")
        for s in range(0, len(view), CHUNK):
            yield bytes(view[s : s + CHUNK])

    handler = grpc.method_handlers_generic_handler(
        "raw.Raw",
        {
            "Up": grpc.stream_unary_rpc_method_handler(up),
            "Down": grpc.unary_stream_rpc_method_handler(down),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(8), handlers=[handler], options=_RAW_OPTIONS
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def raw_client(port: int, mib: int) -> None:
    import grpc

    n = mib * MIB // 4
    g = np.full(n, 1e-3, np.float32)
    gs = np.full(SMALL, 1e-3, np.float32)
    with grpc.insecure_channel(f"127.0.0.1:{port}", _RAW_OPTIONS) as channel:
        up = channel.stream_unary("/raw.Raw/Up")
        down = channel.unary_stream("/raw.Raw/Down")

        def push(a: Any) -> None:
            view = memoryview(a).cast("B")
            size = a.size.to_bytes(8, "little")

            def messages() -> Any:
                yield size
                for s in range(0, len(view), CHUNK):
                    yield bytes(view[s : s + CHUNK])

            up(messages())

        def pull(size: int) -> Any:
            x = np.empty(size, np.float32)
            view = memoryview(x).cast("B")
            pos = 0
            for b in down(size.to_bytes(8, "little")):
                view[pos : pos + len(b)] = b
                pos += len(b)
            return x

        def small() -> None:
            push(gs)
            pull(SMALL)

        for _ in range(2):
            push(g)
            pull(n)
            small()
        _serve_rounds(
            lambda steps, calls: _figures(
                lambda: push(g), lambda: pull(n), None, small, steps, calls
            )
        )


# -- the driver ------------------------------------------------------------------------
class System:
    """A client process (and the server processes it talks to)."""

    def __init__(
        self,
        name: str,
        client: list[str],
        servers: list[subprocess.Popen[bytes]],
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.servers = servers
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *client],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.rounds: list[dict[str, float]] = []

    def ready(self) -> bool:
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() == "ready":
            return True
        self.log.seek(0)
        print(
            f"{self.name}: did not start:\n{self.log.read()[-3000:]}", file=sys.stderr
        )
        return False

    def round(self, steps: int, calls: int) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{steps} {calls}\n")
        self.proc.stdin.flush()
        res: dict[str, float] = json.loads(self.proc.stdout.readline())
        self.rounds.append(res)
        return res

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        for p in [self.proc, *self.servers]:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _torch_available() -> bool:
    try:
        import torch.distributed.rpc as rpc
    except ImportError:
        return False
    return bool(rpc.is_available())


def _start_systems(args: argparse.Namespace) -> tuple[list[System], list[Any]]:
    from onnxps.cli.process import start_default_server, start_server_process

    mib = ["--mib", str(args.mib)]
    systems: list[System] = []
    owned: list[Any] = []
    workdir = tempfile.TemporaryDirectory()  # noqa: SIM115
    owned.append(workdir)
    here = Path(workdir.name)
    proc, address = start_default_server(here, log=here / "server.log")
    owned.append(proc)
    defaults = ["--onnxps-client", address, "--defaults", *mib]
    systems.append(System("onnxps, no flags", defaults, []))
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115
    owned.append(log)
    proc, address = start_server_process(log=Path(log.name))
    owned.append(proc)
    systems.append(System("onnxps tcp", ["--onnxps-client", address, *mib], []))
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115
    owned.append(log)
    proc, address = start_server_process("--data-port", "0", log=Path(log.name))
    owned.append(proc)
    data = ["--onnxps-client", address, "--data-channel", *mib]
    systems.append(System("onnxps data", data, []))
    for extra in args.onnxps_address:
        systems.append(System(f"onnxps {extra}", ["--onnxps-client", extra, *mib], []))
    if args.torch and _torch_available():
        for transport in ("uv", "shm"):
            env = dict(
                os.environ,
                PEERS_INIT=f"tcp://127.0.0.1:{_free_port()}",
                TP_SOCKET_IFNAME="lo",  # TensorPipe listens on loopback only
            )
            server = subprocess.Popen(
                [sys.executable, __file__, "--torch-server", transport],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            systems.append(
                System(
                    f"torch rpc {transport}",
                    ["--torch-client", transport, *mib],
                    [server],
                    env,
                )
            )
    port_file = tempfile.NamedTemporaryFile(suffix=".port", delete=False)  # noqa: SIM115
    port_file.close()
    Path(port_file.name).unlink()
    raw = subprocess.Popen(
        [sys.executable, __file__, "--raw-server", port_file.name, *mib]
    )
    deadline = time.monotonic() + 60
    while not Path(port_file.name).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    port = Path(port_file.name).read_text()
    systems.append(System("raw gRPC", ["--raw-client", port, *mib], []))
    owned.append(raw)
    return systems, owned


def _cell(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def _report(systems: list[System], mib: int) -> None:
    header = ["system", "push ms", "pull ms", "push returning X ms",
              f"{SMALL:,}-element push returning X p50 us"]  # fmt: skip
    rows = [header]
    for s in systems:
        rows.append(
            [s.name]
            + [
                _cell([r[f] for r in s.rounds if f in r], 0 if f == "small_us" else 1)
                for f in FIGURES
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    print(f"\n{mib} MiB float32 Adam group; median over rounds (min-max)")
    for k, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if k == 0:
            print("  ".join("-" * w for w in widths))

    def med(name: str, f: str) -> float | None:
        for s in systems:
            if s.name == name:
                vals = [r[f] for r in s.rounds if f in r]
                return statistics.median(vals) if vals else None
        return None

    print("\nAims (ratios of medians in this run):")
    ox = {f: med("onnxps tcp", f) for f in FIGURES}
    raw = {f: med("raw gRPC", f) for f in FIGURES}
    uv = {f: med("torch rpc uv", f) for f in FIGURES}
    shm = {f: med("torch rpc shm", f) for f in FIGURES}
    step = _sum(ox["push"], ox["pull"])
    raw_step = _sum(raw["push"], raw["pull"])
    _aim("onnxps step / raw gRPC step (aim <= 1.1)", step, raw_step, 1.1)
    _aim("onnxps step / torch rpc uv step (aim < 1)", step,
         _sum(uv["push"], uv["pull"]), 1.0)  # fmt: skip
    _aim("onnxps push returning X / (push + pull) (aim <= 1)",
         ox["push_values"], step, 1.0)  # fmt: skip
    _aim("onnxps small push returning X p50 / torch rpc uv (aim <= 1)",
         ox["small_us"], uv["small_us"], 1.0)  # fmt: skip
    _aim("onnxps small push returning X p50 / torch rpc shm (aim <= 1)",
         ox["small_us"], shm["small_us"], 1.0)  # fmt: skip
    _aim("onnxps tcp step / torch rpc shm step (same-host aim <= 1/3)", step,
         _sum(shm["push"], shm["pull"]), 1 / 3)  # fmt: skip
    nf = {f: med("onnxps, no flags", f) for f in FIGURES}
    nf_step = _sum(nf["push"], nf["pull"])
    _aim("onnxps no flags step / torch rpc shm step (same-host aim <= 1/3)",
         nf_step, _sum(shm["push"], shm["pull"]), 1 / 3)  # fmt: skip
    _aim("onnxps no flags push returning X / (push + pull) (aim <= 1)",
         nf["push_values"], nf_step, 1.0)  # fmt: skip
    dc = {f: med("onnxps data", f) for f in FIGURES}
    dc_step = _sum(dc["push"], dc["pull"])
    _aim("onnxps data channel step / torch rpc uv step (aim < 1)", dc_step,
         _sum(uv["push"], uv["pull"]), 1.0)  # fmt: skip
    _aim("onnxps data channel step / raw gRPC step (aim <= 1.1)", dc_step,
         raw_step, 1.1)  # fmt: skip
    _aim("onnxps data channel push returning X / (push + pull) (aim <= 1)",
         dc["push_values"], dc_step, 1.0)  # fmt: skip


def _sum(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _aim(what: str, a: float | None, b: float | None, limit: float) -> None:
    if a is None or b is None:
        print(f"  {what}: not measured")
        return
    ratio = a / b
    print(f"  {what}: {ratio:.2f} -> {'met' if ratio <= limit else 'not met'}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="64 MiB calls per round")
    p.add_argument("--small-calls", type=int, default=300)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument(
        "--onnxps-address",
        action="append",
        default=[],
        metavar="ADDR",
        help="also measure the onnxps server at ADDR (e.g. unix:///tmp/ps.sock)",
    )
    p.add_argument("--no-torch", dest="torch", action="store_false")
    p.add_argument("--onnxps-client", help=argparse.SUPPRESS)
    p.add_argument("--data-channel", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--defaults", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--torch-server", help=argparse.SUPPRESS)
    p.add_argument("--torch-client", help=argparse.SUPPRESS)
    p.add_argument("--raw-server", help=argparse.SUPPRESS)
    p.add_argument("--raw-client", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.onnxps_client:
        onnxps_client(args.onnxps_client, args.mib, args.data_channel, args.defaults)
        return 0
    if args.torch_server:
        torch_server(args.torch_server)
        return 0
    if args.torch_client:
        torch_client(args.torch_client, args.mib)
        return 0
    if args.raw_server:
        raw_server(args.mib, args.raw_server)
        return 0
    if args.raw_client:
        raw_client(int(args.raw_client), args.mib)
        return 0
    started, owned = _start_systems(args)
    try:
        systems = [s for s in started if s.ready()]
        for r in range(args.rounds):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            for s in order:
                res = s.round(args.steps, args.small_calls)
                figs = "  ".join(f"{k} {v:8.1f}" for k, v in res.items())
                print(f"round {r + 1} {s.name:16s} {figs}", flush=True)
        _report(systems, args.mib)
    finally:
        for s in started:
            s.stop()
        from onnxps.cli.process import stop_processes

        procs = [o for o in owned if isinstance(o, subprocess.Popen)]
        stop_processes(procs, timeout=60)  # the default server writes a snapshot
        for o in owned:
            if isinstance(o, tempfile.TemporaryDirectory):
                o.cleanup()
            elif not isinstance(o, subprocess.Popen):
                o.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
