"""What a push returning X costs the server in memory beyond the group's state.

A PushPullStream's X goes back through the push's own gradient buffers: a caller
that reads its reply slower than the group steps (here: not at all until the push
has applied) holds no copy of X in the server's memory beyond them. Before, every
block of X was encoded into frames as it stepped and the frames waited for the
network: a second copy of X.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import StartServer
from onnxps.client import Adam, Client
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import TensorAssembler, chunk_messages, header_tensor

MIB = 1 << 20
N = 64 * MIB // 4  # a 64 MiB float32 tensor: its gradient fits the default pool


def _kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _requests(g: np.ndarray) -> list[pb.PushPullStreamRequest]:
    header = pb.PushRequest(
        group="big", client_id="raw", seq=1, gradients=[header_tensor(g, "w")]
    )
    return [
        pb.PushPullStreamRequest(header=header),
        *chunk_messages(pb.PushPullStreamRequest, [g], MIB),
    ]


@pytest.mark.slow
def test_a_reply_read_late_holds_no_copy_of_x_in_the_server(
    server_processes: StartServer, tmp_path: Path
) -> None:
    proc, address = server_processes(tmp_path / "server.log")
    g = np.full(N, 1e-3, np.float32)
    with Client(address, timeout=120, shared_memory="off") as ps:
        ps.create_group("big", Adam(), learning_rate=0.1, tensors={"w": g * 0})
        # V and H touched, the gradient buffers pooled: the push below needs
        # no new memory for the state or its gradient
        ps.push("big", g)
        requests = _requests(g)
        options = [("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(address, options) as channel:
            stub = pb_grpc.ParameterServerServiceStub(channel)
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM = VmRSS
            before = _kib(proc.pid, "VmRSS")
            call = stub.PushPullStream(iter(requests), timeout=120)
            for _ in range(1200):  # the push applies while nobody reads X
                if ps.describe_group("big").update_count == 2:
                    break
                time.sleep(0.05)
            assert ps.describe_group("big").update_count == 2
            grown = (_kib(proc.pid, "VmHWM") - before) / 1024
            header = next(call).header  # type: ignore[call-overload]
            asm = TensorAssembler(list(header.values), ["w"])
            for msg in call:
                asm.add(msg.chunk)
        (x,) = asm.finish()
        np.testing.assert_array_equal(x, ps.pull("big")[0], strict=True)
    # Before: the 64 MiB of X waited in frames (less what the network took).
    assert grown < 32, f"the server grew {grown:.0f} MiB over the push"


def test_a_reply_read_late_is_the_x_of_its_push_after_later_pushes(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    """The gradient buffers holding a late reader's X go back to the pool only once
    the reply is sent: a push meanwhile leases other buffers."""
    proc, address = server_processes(tmp_path / "server.log")
    n = 2 * MIB  # 8 MiB: pooled
    g = np.full(n, 1e-3, np.float32)
    with Client(address, timeout=120, shared_memory="off") as ps:
        ps.create_group("big", Adam(), learning_rate=0.1, tensors={"w": g * 0})
        ps.push("big", g)  # T=1, the gradient buffers pooled
        options = [("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(address, options) as channel:
            stub = pb_grpc.ParameterServerServiceStub(channel)
            call = stub.PushPullStream(iter(_requests(g)), timeout=120)
            for _ in range(1200):
                if ps.describe_group("big").update_count == 2:
                    break
                time.sleep(0.05)
            x2 = ps.pull("big")[0].copy()
            ps.push("big", g * 2)  # T=3, streamed into pooled buffers
            header = next(call).header  # type: ignore[call-overload]
            assert header.update_count == 2
            asm = TensorAssembler(list(header.values), ["w"])
            for msg in call:
                asm.add(msg.chunk)
        (x,) = asm.finish()
        np.testing.assert_array_equal(x, x2, strict=True)
        assert not np.array_equal(x, ps.pull("big")[0])


def test_a_push_returning_x_through_shared_memory_makes_no_copy_of_x(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    """X goes into the client's reply segment block by block as the push steps,
    under the group's lock: the server makes no copy of X beside it (before: a
    frozen copy of X, then the write into the segment). X is 64 MiB and the bound
    half of that: the step's own scratch (its blocks, per thread) and the code the
    call pages in come to 5-21 MiB whatever X's size, which a 32 MiB X left too
    close to a 16 MiB bound (a CI run failed at 16.1 MiB)."""
    proc, address = server_processes(tmp_path / "server.log")
    n = 64 * MIB // 4
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal(n).astype(np.float32)
    g = np.full(n, 1e-3, np.float32)
    with Client(address, timeout=120, shared_memory="on") as ps:
        ps.create_group(
            "big", Adam(), learning_rate=0.1, tensors={"a": x0[:1000], "b": x0}
        )
        # the segments mapped and touched, V and H too
        ps.push("big", g[:1000], g, return_values=True)
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM = VmRSS
        before = _kib(proc.pid, "VmRSS")
        a, b = ps.push("big", g[:1000], g, return_values=True)
        grown = (_kib(proc.pid, "VmHWM") - before) / 1024
        print(f"grown {grown:.1f} MiB")
        pulled = ps.pull("big")
        assert ps.describe_group("big").update_count == 2
    np.testing.assert_array_equal(a, pulled[0], strict=True)
    np.testing.assert_array_equal(b, pulled[1], strict=True)
    assert grown < 32, f"the server grew {grown:.0f} MiB over the push"
