"""A caller without a known token cannot make the server hold its request's bytes.

gRPC receives a unary request whole before the handler's behavior runs, so a call
refused in the behavior (as tokenless calls once were) had its 64 MiB received and
copied (twice: bytes, then the parsed message) first. A call refused from its metadata
is served as a request stream that nothing reads: its status goes out at once and its
bytes are not received beyond HTTP/2's flow-control windows.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
from _procs import StartServer, clean_env
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

MIB = 1 << 20
REQUEST_MIB = 64
CALLS = 4


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_tokenless_large_unary_pushes_are_refused_before_their_bytes_are_read(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("adm-5e1f0c2b9a8d7e6f admin *\n")
    # (NumPy kernels: numba's, loaded in the background at start, would grow the
    # peak meanwhile by about 100 MiB of their own)
    proc, address = server_processes(
        tmp_path / "server.log",
        "--tokens-file",
        str(tokens),
        "--max-inflight-bytes",
        f"{REQUEST_MIB}MiB",
        env=clean_env(ONNXPS_KERNELS="numpy"),
    )
    peak_before = _kib(proc.pid, "VmHWM")
    data = bytes(REQUEST_MIB * MIB)
    request = pb.PushRequest(
        group="g",
        gradients=[
            pb.Tensor(dims=[len(data) // 4], dtype=pb.DATA_TYPE_FLOAT, raw_data=data)
        ],
    )
    channel = grpc.insecure_channel(
        address, options=[("grpc.max_send_message_length", -1)]
    )
    stub = pb_grpc.ParameterServerServiceStub(channel)
    codes: list[grpc.StatusCode] = []

    def push(metadata: tuple[tuple[str, str], ...]) -> None:
        try:
            stub.Push(request, timeout=60, metadata=metadata)
        except grpc.RpcError as exc:
            codes.append(exc.code())
        else:
            codes.append(grpc.StatusCode.OK)

    bad = (("authorization", "Bearer not-a-token"),)
    threads = [
        threading.Thread(target=push, args=(() if i % 2 else bad,))
        for i in range(CALLS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    channel.close()
    peak_after = _kib(proc.pid, "VmHWM")
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * CALLS
    # Before: the peak grew by 240-340 MiB (each request received, then copied).
    # Now about 12 MiB here: what HTTP/2 flow control let in before the status.
    grown_mib = (peak_after - peak_before) / 1024
    assert grown_mib < REQUEST_MIB / 2, f"the server's peak RSS grew {grown_mib} MiB"
