"""The attacks of the hardening issue, measured again against a real server process.

    python benchmarks/hardening.py [--mib 64] [--ids 100000]

Each attack is the one the issue measured, at its scale, and prints what the server
did (the figures the issue reported from before the fixes are printed beside them):

1. 64 unary ``Pull(min_version=2**62)`` with no deadline: how many wait, how many are
   refused; a push and a health check answer in how long; how long after the callers
   cancel until the server's ``onnxps_waiting_calls`` gauge is 0 again.
2. With a tokens file and ``--threads 8``: 64 streams that send no message and no
   token. How long until all are refused, and how long a health check and an
   authenticated push take meanwhile.
3. 12 ``PullStream`` readers of a ``--mib`` MiB float32 Adagrad group (X and H) that
   read only the header: the server's RSS growth, and whether a 13th is refused.
4. 12 pushes of ``--mib`` MiB cut off by their client's deadline before the last
   chunk: the server's RSS growth, its ERROR lines, tracebacks, and T (must stay 0).
5. ``--ids`` client ids pushing once each to one group (in process, tracemalloc):
   the bytes kept per client id, with the exactly-once window rule (600 s after its
   last push, at most 10,000 per group).

A benchmark, not a test: the tests in ``tests/service/test_availability.py``,
``test_security.py`` and ``test_store_hardening.py`` assert the behaviour.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.cli.process import start_server_process, stop_processes
from onnxps.client import Adagrad, Client
from onnxps.server.kernels import make_attrs
from onnxps.server.store import ParameterStore
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import header_tensor, iter_chunks

MIB = 1 << 20
FOREVER = 2**62
TOKEN = "hardening-admin-token"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def gauge(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    found = re.search(rf"^{name} (\S+)$", text.decode(), re.M)
    return float(found.group(1)) if found else float("nan")


def until(probe: Callable[[], bool], seconds: float) -> float:
    start = time.monotonic()
    while not probe():
        if time.monotonic() - start > seconds:
            return float("inf")
        time.sleep(0.01)
    return time.monotonic() - start


def health(address: str, token: str | None = None) -> float:
    start = time.monotonic()
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return time.monotonic() - start


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def waiting_pulls(tmp: Path) -> None:
    port = free_port()
    proc, address = start_server_process(
        "--metrics-port", str(port), log=tmp / "waits.log"
    )
    try:
        with Client(address, timeout=30) as c, grpc.insecure_channel(address) as ch:
            c.create_group(
                "g",
                Adagrad(),
                learning_rate=0.1,
                tensors={"w": np.zeros(4, np.float32)},
            )
            stub = pb_grpc.ParameterServerServiceStub(ch)
            req = pb.PullRequest(group="g", min_version=FOREVER)
            calls = [stub.Pull.future(req) for _ in range(64)]
            until(lambda: gauge(port, "onnxps_waiting_calls") > 0, 10)
            time.sleep(0.5)  # let every call arrive
            refused = sum(f.done() for f in calls)
            waiting = gauge(port, "onnxps_waiting_calls")
            t0 = time.monotonic()
            c.push("g", np.ones(4, np.float32), timeout=5)
            push_s = time.monotonic() - t0
            health_s = health(address)
            for f in calls:
                f.cancel()
            released = until(lambda: gauge(port, "onnxps_waiting_calls") == 0, 30)
        print(
            f"1. 64 Pull(min_version=2**62), no deadline: {waiting:.0f} wait, "
            f"{refused} refused at once; push {push_s * 1e3:.0f} ms, health check "
            f"{health_s * 1e3:.0f} ms; waits released {released * 1e3:.0f} ms after "
            "cancel (the issue: push and health check hung; still hung 30 s after)"
        )
    finally:
        stop_processes([proc])


def silent_streams(tmp: Path) -> None:
    tokens = tmp / "tokens.txt"
    tokens.write_text(f"{TOKEN} admin *\n")
    proc, address = start_server_process(
        "--tokens-file", str(tokens), "--threads", "8", log=tmp / "silent.log"
    )
    stop = threading.Event()

    def silent() -> Iterator[pb.PushStreamRequest]:
        stop.wait(60)
        yield from ()

    try:
        with (
            grpc.insecure_channel(address) as ch,
            Client(address, token=TOKEN, timeout=30) as admin,
        ):
            w = np.zeros(4, np.float32)
            admin.create_group("g", Adagrad(), learning_rate=0.1, tensors={"w": w})
            stub = pb_grpc.ParameterServerServiceStub(ch)
            start = time.monotonic()
            calls = [stub.PushStream.future(silent(), timeout=60) for _ in range(64)]
            health_s = health(address)
            t0 = time.monotonic()
            admin.push("g", np.ones(4, np.float32), timeout=10)
            push_s = time.monotonic() - t0
            codes = [c.exception(timeout=30) for c in calls]
            all_s = time.monotonic() - start
            unauth = sum(
                isinstance(e, grpc.RpcError)
                and e.code() == grpc.StatusCode.UNAUTHENTICATED
                for e in codes
            )
        print(
            f"2. 64 silent streams, no token, --threads 8: {unauth}/64 UNAUTHENTICATED "
            f"within {all_s:.2f} s; meanwhile health {health_s * 1e3:.0f} ms, an "
            f"authenticated push {push_s * 1e3:.0f} ms (the issue: every thread taken)"
        )
    finally:
        stop.set()
        stop_processes([proc])


def slow_pullers(tmp: Path, mib: int) -> None:
    proc, address = start_server_process(log=tmp / "pullers.log")
    try:
        with Client(address, timeout=120) as c:
            w = np.ones(mib * MIB // 4, np.float32)
            c.create_group("big", Adagrad(), learning_rate=0.1, tensors={"w": w})
            del w
        time.sleep(0.5)
        before = rss_mib(proc.pid)
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            readers, refused = [], 0
            for _ in range(13):
                it = stub.PullStream(
                    pb.PullStreamRequest(group="big", with_state=True), timeout=60
                )
                try:
                    next(it)
                    readers.append(it)
                except grpc.RpcError as exc:
                    refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(1.0)
            after = rss_mib(proc.pid)
            for r in readers:
                r.cancel()
        print(
            f"3. 13 PullStreams of a {mib} MiB group (X+H: {2 * mib} MiB each) reading "
            f"only the header: {len(readers)} held, {refused} refused by the in-flight "
            f"limit; server RSS {before:.0f} -> {after:.0f} MiB "
            f"(+{after - before:.0f}; one copy each would be +{len(readers) * 2 * mib})"
            " (the issue, 12 readers: 257 -> 2,592 MiB)"
        )
    finally:
        stop_processes([proc])


def cut_off_pushes(tmp: Path, mib: int) -> None:
    log = tmp / "cutoff.log"
    proc, address = start_server_process("--log-level", "INFO", log=log)
    try:
        n = mib * MIB // 4
        with Client(address, timeout=120) as c:
            w = np.zeros(n, np.float32)
            c.create_group("big", Adagrad(), learning_rate=0.1, tensors={"w": w})
        g = np.full(n, 0.5, np.float32)
        chunks = list(iter_chunks([g], MIB))
        before = rss_mib(proc.pid)
        codes = []
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ParameterServerServiceStub(ch)
            for _ in range(12):
                stall = threading.Event()

                def messages(stall: threading.Event = stall) -> Iterator[object]:
                    header = pb.PushRequest(
                        group="big", gradients=[header_tensor(g, "w")]
                    )
                    yield pb.PushStreamRequest(header=header)
                    for chunk in chunks[:-1]:
                        yield pb.PushStreamRequest(chunk=chunk)
                    stall.wait(60)

                try:
                    stub.PushStream(messages(), timeout=3.0)
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
                finally:
                    stall.set()
        time.sleep(1.0)
        after = rss_mib(proc.pid)
        with Client(address, timeout=30) as c:
            t = c.describe_group("big").update_count
        text = log.read_text()
        errors = len(re.findall(r" (?:ERROR|CRITICAL) ", text))
        tracebacks = text.count("Traceback")
        print(
            f"4. 12 pushes of {mib} MiB cut off before their last chunk "
            f"({', '.join(sorted(set(codes)))}): server RSS {before:.0f} -> "
            f"{after:.0f} MiB (+{after - before:.0f}); {errors} ERROR lines, "
            f"{tracebacks} tracebacks; T = {t} (the issue: +64 MiB per push, 11 "
            "INTERNAL log entries with tracebacks)"
        )
    finally:
        stop_processes([proc])


def client_ids(count: int) -> None:
    store = ParameterStore()
    store.create_group(
        "g", make_attrs("Adagrad", {}), 0.1, [("w", np.zeros(4, np.float32))]
    )
    g = np.ones(4, np.float32)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    start = time.monotonic()
    for i in range(count):
        store.push("g", [g], client_id=f"client-{i:08d}", seq=1)
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    print(
        f"5. {count:,} client ids, one push each ({time.monotonic() - start:.1f} s): "
        f"+{grown / MIB:.1f} MiB kept, {grown / count:.0f} B per id "
        "(the issue: +69 MiB per 100,000 ids, about 0.7 KiB each, never reclaimed)"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64, help="size of the big group's X")
    p.add_argument("--ids", type=int, default=100_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        waiting_pulls(tmp)
        silent_streams(tmp)
        slow_pullers(tmp, args.mib)
        cut_off_pushes(tmp, args.mib)
    client_ids(args.ids)


if __name__ == "__main__":
    main()
