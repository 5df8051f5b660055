"""A/B of the stream chunk codec: hand-written (one copy) vs plain protobuf.

    python benchmarks/codec_ab.py [--rounds 7] [--mib 64]

Two real server processes run side by side on loopback: ``fast`` is the server as
built (the chunk codec interceptor), ``proto`` the same server with the generated
protobuf (de)serializers and protobuf chunk messages. One round is a 64 MiB float32
push and pull of the whole group through PushStream and PullStream; the client side
uses the same codec as the server it talks to. Rounds alternate between the two, so
both see the same machine load; each prints its time, then the median, the min-max
spread and the ratio of the medians.

The machine may be shared: compare the ratio with the spread, not absolute figures.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from onnxps.client import Adagrad, Client
from onnxps.client._codec import CHUNK_BYTES, SERVICE, TensorAssembler, header_tensor
from onnxps.server.process import stop_processes, wait_for_listening
from onnxps.v1 import parameter_server_pb2 as pb

MIB = 1 << 20
GROUP = "ab/w"


# -- the server child ------------------------------------------------------------------
def _proto_chunks(arrays: Any, chunk_bytes: int) -> Iterator[pb.PullStreamResponse]:
    for index, a in enumerate(arrays):
        view = memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B")
        for start in range(0, len(view), chunk_bytes):
            chunk = pb.TensorChunk(
                index=index, offset=start, data=bytes(view[start : start + chunk_bytes])
            )
            yield pb.PullStreamResponse(chunk=chunk)


def serve(variant: str) -> None:
    from onnxps.server import app, service

    if variant == "proto":

        class _Off(grpc.ServerInterceptor):
            def intercept_service(self, continuation: Any, details: Any) -> Any:
                return continuation(details)

        app.FastChunkInterceptor = _Off  # type: ignore[misc, assignment]
        service.iter_raw_chunks = _proto_chunks  # type: ignore[assignment]
    logging.basicConfig(level=logging.WARNING)
    handle = app.create_server(app.ServerConfig(address="127.0.0.1:0")).start()
    print(f"onnxps listening on {handle.address}", flush=True)
    handle.wait()


# -- the client side -------------------------------------------------------------------
def _methods(channel: grpc.Channel, variant: str) -> tuple[Callable[..., Any], ...]:
    path = f"/{SERVICE}/"
    if variant == "fast":
        from onnxps.client._wire import deserializer, serializer

        push_ser: Any = serializer(2)
        pull_de: Any = deserializer(pb.PullStreamResponse, 2)
    else:
        push_ser = pb.PushStreamRequest.SerializeToString
        pull_de = pb.PullStreamResponse.FromString
    push = channel.stream_unary(
        path + "PushStream",
        request_serializer=push_ser,
        response_deserializer=pb.PushStreamResponse.FromString,
    )
    pull = channel.unary_stream(
        path + "PullStream",
        request_serializer=pb.PullStreamRequest.SerializeToString,
        response_deserializer=pull_de,
    )
    return push, pull


def _push_messages(grad: np.ndarray[Any, Any], variant: str, seq: int) -> Iterator[Any]:
    header = pb.PushRequest(group=GROUP, gradients=[header_tensor(grad)], seq=seq)
    yield pb.PushStreamRequest(header=header)
    if variant == "fast":
        from onnxps.client._wire import iter_raw_chunks

        yield from iter_raw_chunks([grad], CHUNK_BYTES)
        return
    view = memoryview(grad.reshape(-1)).cast("B")
    for start in range(0, len(view), CHUNK_BYTES):
        data = bytes(view[start : start + CHUNK_BYTES])
        chunk = pb.TensorChunk(index=0, offset=start, data=data)
        yield pb.PushStreamRequest(chunk=chunk)


def one_round(
    address: str, variant: str, grad: np.ndarray[Any, Any], seq: int
) -> float:
    with grpc.insecure_channel(
        address,
        [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
    ) as channel:
        push, pull = _methods(channel, variant)
        channel_ready = grpc.channel_ready_future(channel)
        channel_ready.result(timeout=30)
        start = time.perf_counter()
        reply = push(_push_messages(grad, variant, seq), timeout=120)
        it = pull(pb.PullStreamRequest(group=GROUP), timeout=120)
        header = next(it).header
        asm = TensorAssembler(list(header.tensors), ["w"])
        for msg in it:
            asm.add(msg.chunk)
        (x,) = asm.finish()
        elapsed = time.perf_counter() - start
    assert reply.applied and x.shape == grad.shape
    return elapsed * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", choices=["fast", "proto"], help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    n = args.mib * MIB // 4
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32) * 1e-3
    procs: list[subprocess.Popen[bytes]] = []
    addresses: dict[str, str] = {}
    logs = []
    try:
        for variant in ("fast", "proto"):
            log = tempfile.NamedTemporaryFile(suffix=".log")  # noqa: SIM115
            logs.append(log)
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", variant],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            procs.append(proc)
            addresses[variant] = wait_for_listening(proc, Path(log.name))
            with Client(addresses[variant]) as c:
                c.create_group(
                    GROUP,
                    Adagrad(),
                    learning_rate=0.1,
                    tensors={"w": np.zeros(n, "f4")},
                )
        times: dict[str, list[float]] = {"fast": [], "proto": []}
        seq = 1
        for variant in ("fast", "proto"):  # warm-up, not counted
            one_round(addresses[variant], variant, grad, seq)
            seq += 1
        print(f"{args.mib} MiB float32, push + pull through the streams, ms per round")
        for r in range(args.rounds):
            order = ("fast", "proto") if r % 2 == 0 else ("proto", "fast")
            for variant in order:
                ms = one_round(addresses[variant], variant, grad, seq)
                seq += 1
                times[variant].append(ms)
                print(f"round {r + 1} {variant:5s} {ms:8.1f}", flush=True)
        print()
        print(f"{'codec':8s} {'median':>8s} {'min':>8s} {'max':>8s} {'spread':>8s}")
        for variant, ts in times.items():
            med = statistics.median(ts)
            print(
                f"{variant:8s} {med:8.1f} {min(ts):8.1f} {max(ts):8.1f} "
                f"{(max(ts) - min(ts)) / med:8.1%}"
            )
        fast, proto = times["fast"], times["proto"]
        ratio = statistics.median(proto) / statistics.median(fast)
        wins = sum(f < p for f, p in zip(fast, proto, strict=True))
        print(f"proto / fast median ratio: {ratio:.3f}")
        print(f"fast faster in {wins} of {len(fast)} rounds")
        beyond = max(fast) < min(proto) or max(proto) < min(fast)
        print(f"gain beyond the min-max spread: {'yes' if beyond else 'no'}")
    finally:
        stop_processes(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
