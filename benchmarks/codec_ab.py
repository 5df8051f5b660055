"""A/B of the stream chunk codec: hand-written (one copy) vs plain protobuf.

    python benchmarks/codec_ab.py [--rounds 7] [--mib 64]

Two real server processes run side by side on loopback: ``proto`` is the server as
built (generated protobuf (de)serializers, ``codec.chunk_messages``), ``fast`` the
same server with the hand-written one-copy chunk codec that onnxps had before this
A/B removed it (kept below, with the interceptor that installed it, so the decision
can be measured again). One round is a 64 MiB float32
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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from onnxps.client import Adagrad, Client
from onnxps.client.codec import (
    CHUNK_BYTES,
    SERVICE,
    TensorAssembler,
    chunk_messages,
    header_tensor,
)
from onnxps.server.process import stop_processes, wait_for_listening
from onnxps.v1 import parameter_server_pb2 as pb

MIB = 1 << 20
GROUP = "ab/w"


# -- the hand-written chunk codec (removed from onnxps by this A/B) -------------------
# A stream message's chunk, written from the array's memory and read as a view.
CHUNK_FIELD = pb.PushStreamRequest.DESCRIPTOR.fields_by_name["chunk"].number
assert CHUNK_FIELD == pb.PullStreamResponse.DESCRIPTOR.fields_by_name["chunk"].number


@dataclass(frozen=True)
class RawChunk:
    """A ``TensorChunk`` whose ``data`` is a view of the message it came in.

    It stands for the whole stream message too (``msg.chunk``, ``WhichOneof``), so
    code written against the protobuf classes reads it unchanged.
    """

    index: int
    offset: int
    data: memoryview

    @property
    def chunk(self) -> RawChunk:
        return self

    def WhichOneof(self, name: str) -> str:  # noqa: N802 - the protobuf spelling
        return "chunk"

    def ByteSize(self) -> int:  # noqa: N802 - the protobuf spelling
        return len(self.data) + 32


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(field: int, index: int, offset: int, data: memoryview) -> bytes:
    """The wire bytes of a stream message whose ``chunk`` (field ``field``) is set."""
    inner = b""
    if index:
        inner += b"\x08" + _varint(index)
    if offset:
        inner += b"\x10" + _varint(offset)
    inner += b"\x1a" + _varint(len(data))
    head = _varint((field << 3) | 2) + _varint(len(inner) + len(data)) + inner
    return b"".join((head, data))


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return -1, pos  # truncated or too long


def decode_chunk(raw: bytes, field: int) -> RawChunk | None:
    """The chunk of a stream message in canonical form; None for anything else."""
    buf = memoryview(raw)
    end = len(buf)
    tag, pos = _read_varint(buf, 0, end)
    if tag != (field << 3) | 2:
        return None
    length, pos = _read_varint(buf, pos, end)
    if length < 0 or pos + length != end:
        return None
    index = offset = 0
    data: memoryview | None = None
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        if key == 0x08 and data is None:
            index, pos = _read_varint(buf, pos, end)
        elif key == 0x10 and data is None:
            offset, pos = _read_varint(buf, pos, end)
        elif key == 0x1A and data is None:
            size, pos = _read_varint(buf, pos, end)
            if size < 0 or pos + size != end:
                return None
            data = buf[pos:end]
            pos = end
        else:
            return None
        if index < 0 or offset < 0 or index > 0xFFFFFFFF or offset >= 1 << 64:
            return None
    if data is None:
        return None
    return RawChunk(index, offset, data)


def iter_raw_chunks(arrays: Iterable[Any], chunk_bytes: int) -> Iterator[RawChunk]:
    """The bytes of ``arrays`` in order as chunks viewing the arrays' memory.

    The arrays must not change until the stream has sent them.
    """
    for index, a in enumerate(arrays):
        arr = np.asarray(a)
        arr = np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")
        view = memoryview(arr.reshape(-1)).cast("B")  # type: ignore[arg-type]
        for start in range(0, len(view), chunk_bytes):
            yield RawChunk(index, start, view[start : start + chunk_bytes])


def serializer(field: int) -> Callable[[Any], bytes]:
    """A stream message serializer that writes ``RawChunk`` items by hand."""

    def serialize(msg: Any) -> bytes:
        if isinstance(msg, RawChunk):
            return encode_chunk(field, msg.index, msg.offset, msg.data)
        return bytes(msg.SerializeToString())

    return serialize


def deserializer(message: type[Any], field: int) -> Callable[[bytes], Any]:
    """A stream message parser: chunks as zero-copy ``RawChunk``, the rest protobuf."""

    def parse(raw: bytes) -> Any:
        chunk = decode_chunk(raw, field)
        return chunk if chunk is not None else message.FromString(raw)

    return parse


class _FastChunks(grpc.ServerInterceptor):
    """The innermost interceptor: the hand-written codec for PushStream/PullStream."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        method = (details.method or "").rsplit("/", 1)[-1]
        if handler is None:
            return None
        if method == "PushStream":
            return grpc.stream_unary_rpc_method_handler(
                handler.stream_unary,
                request_deserializer=deserializer(pb.PushStreamRequest, CHUNK_FIELD),
                response_serializer=handler.response_serializer,
            )
        if method == "PullStream":
            return grpc.unary_stream_rpc_method_handler(
                handler.unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=serializer(CHUNK_FIELD),
            )
        return handler


# -- the server child ------------------------------------------------------------------
def serve(variant: str) -> None:
    from onnxps.server import app, limits, service

    if variant == "fast":
        plain = limits.interceptors

        def with_fast_chunks(config: Any) -> list[grpc.ServerInterceptor]:
            return [*plain(config), _FastChunks()]

        def raw_chunks(message: Any, arrays: Any, chunk_bytes: int) -> Any:
            return iter_raw_chunks(arrays, chunk_bytes)

        limits.interceptors = with_fast_chunks  # type: ignore[assignment]
        service.chunk_messages = raw_chunks  # type: ignore[assignment]
    logging.basicConfig(level=logging.WARNING)
    handle = app.create_server(app.ServerConfig(address="127.0.0.1:0")).start()
    print(f"onnxps listening on {handle.address}", flush=True)
    handle.wait()


# -- the client side -------------------------------------------------------------------
def _methods(channel: grpc.Channel, variant: str) -> tuple[Callable[..., Any], ...]:
    path = f"/{SERVICE}/"
    if variant == "fast":
        push_ser: Any = serializer(CHUNK_FIELD)
        pull_de: Any = deserializer(pb.PullStreamResponse, CHUNK_FIELD)
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
        yield from iter_raw_chunks([grad], CHUNK_BYTES)
        return
    yield from chunk_messages(pb.PushStreamRequest, [grad], CHUNK_BYTES)


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
