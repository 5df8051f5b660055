"""The command line as a user runs it: serve, status, health, reflection."""

from __future__ import annotations

import argparse
import dataclasses
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from _procs import StartServer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from onnxps import cli
from onnxps.client import Adagrad, Adam, Client, Nesterov, Sync, UnavailableError
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.cli import add_serve_arguments, config_flags, config_from_args
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import header_tensor, iter_chunks


def _slow_push(
    address: str, grad: np.ndarray, in_flight: threading.Event, go: threading.Event
) -> pb.PushStreamResponse:
    """A streamed push that stalls after its first chunk until ``go`` is set."""

    def chunks() -> Iterator[pb.PushStreamRequest]:
        header = pb.PushRequest(group="big", client_id="slow", seq=1)
        header.gradients.append(header_tensor(grad))
        yield pb.PushStreamRequest(header=header)
        for i, c in enumerate(iter_chunks([grad], 1 << 20)):
            if i == 1:
                in_flight.set()
                go.wait(20)
            yield pb.PushStreamRequest(chunk=c)

    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ParameterServerServiceStub(channel).PushStream(
            chunks(), timeout=30
        )


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_drains_in_flight_call_and_exits_0_on_signal(
    server_processes: StartServer, tmp_path: Path, signum: signal.Signals
) -> None:
    log = tmp_path / "server.log"
    proc, address = server_processes(log, "--metrics-port", "0")
    try:
        assert address.startswith("127.0.0.1:") and int(address.split(":")[1]) > 0
        found = re.search(r"metrics on (http://\S+/metrics)", log.read_text())
        assert found, log.read_text()
        x = np.zeros(1 << 20, np.float32)  # 4 MiB: four 1 MiB chunks
        with Client(address, timeout=10) as c:
            c.create_group("big", Adagrad(), learning_rate=0.5, tensors={"x": x})
        in_flight, go = threading.Event(), threading.Event()
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["reply"] = _slow_push(address, np.ones_like(x), in_flight, go)
            except grpc.RpcError as exc:  # pragma: no cover - reported below
                result["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        assert in_flight.wait(10)
        # The client has sent two chunks; the server may not have handed the call to
        # a handler yet. Signal only once it counts the push as admitted.
        assert _wait_gauge(found.group(1), "onnxps_calls_in_flight", 1, 10)
        proc.send_signal(signum)
        deadline = time.monotonic() + 10
        while "draining" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        # Draining: a new call is refused while the stalled push is still open.
        with Client(address, timeout=5) as late:
            with pytest.raises(UnavailableError) as refused:
                late.list_groups()
            assert refused.value.reason == "SHUTTING_DOWN"
        go.set()
        t.join(20)
        assert proc.wait(20) == 0
    finally:
        go.set()
    assert "error" not in result, result.get("error")
    reply = result["reply"]
    assert isinstance(reply, pb.PushStreamResponse)
    assert reply.update_count == 1 and reply.applied
    text = log.read_text()
    assert f"onnxps listening on {address}" in text
    assert f"received {signum.name}: draining in-flight calls" in text
    assert f"onnxps on {address} stopped" in text


def _wait_gauge(url: str, name: str, value: float, timeout: float) -> bool:
    """True once the metric ``name`` at ``url`` reads ``value``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        if re.search(rf"^{name} {float(value)}$", text, re.M):
            return True
        time.sleep(0.02)
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_status_prints_one_row_per_group(
    server: ServerHandle, client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    client.create_group(
        "mlp/adam",
        Adam(),
        learning_rate=0.001,
        tensors={"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.float32)},
    )
    client.create_group(
        "mlp/nesterov",
        Nesterov(alpha=0.9, beta=1.0),
        learning_rate=0.05,
        tensors={"w": np.zeros(7)},
        consistency=Sync(2),
    )
    client.join("mlp/nesterov", worker_id="w0")
    client.push("mlp/adam", np.ones((3, 4), np.float32), np.ones(4, np.float32))
    assert cli.main(["status", server.address]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split() for line in out] == [
        ["GROUP", "OPTIMIZER", "DTYPE", "TENSORS", "ELEMENTS", "T", "LR", "MODE"]
        + ["WORKERS"],
        ["mlp/adam", "adam", "float32", "2", "16", "1", "0.001", "async", "0"],
        ["mlp/nesterov", "nesterov", "float64", "1", "7", "0", "0.05", "sync/mean"]
        + ["1/2"],
    ]
    # Columns line up: the optimizer column starts at the same offset on every line.
    assert out[0].index("OPTIMIZER") == out[1].index(" adam") + 1 == 14
    assert out[2].index(" nesterov ") + 1 == 14


def test_status_of_empty_server(
    server: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", server.address]) == 0
    assert capsys.readouterr().out == f"no groups on {server.address}\n"


def test_status_unreachable_server_exits_1_within_its_timeout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = f"127.0.0.1:{_free_port()}"
    assert cli.main(["status", address, "--timeout", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(
        f"onnxps status: cannot list the groups on {address}"
    )
    assert "UNAVAILABLE" in captured.err or "DEADLINE_EXCEEDED" in captured.err


def test_health_check_reports_serving(server: ServerHandle) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "onnxps.v1.ParameterServerService"):
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(server: ServerHandle) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(stub.ServerReflectionInfo(iter([request]), timeout=5))
    names = {s.name for s in replies[0].list_services_response.service}
    assert names == {
        "onnxps.v1.ParameterServerService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "demo", "status"):
        assert command in out


def test_serve_flags_are_the_config_fields_with_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ={})
    config = config_from_args(parser.parse_args([]))
    assert config == ServerConfig()
    assert (config.durability, config.data_dir) == ("snapshot", "onnxps-data")
    assert [f.name for f in config_flags()] == [
        f.name for f in dataclasses.fields(ServerConfig)
    ]


def test_serve_flags_take_onnxps_variables_then_flags() -> None:
    parser = argparse.ArgumentParser()
    env = {
        "ONNXPS_THREADS": "7",
        "ONNXPS_DURABILITY": "WAL",
        "ONNXPS_INSECURE": "1",
        "ONNXPS_LEASE_SECONDS": "2.5",
    }
    add_serve_arguments(parser, environ=env)
    config = config_from_args(parser.parse_args(["--threads", "9"]))
    assert (config.threads, config.durability, config.insecure) == (9, "wal", True)
    assert config.lease_seconds == 2.5
    assert config.metrics_port is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--durability", "sometimes"])


ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_serve_flags_table_matches_the_parser() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_table.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr


def test_readme_quickstart_runs(server: ServerHandle) -> None:
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S)
    assert code is not None
    source = code.group(1)
    assert 'Client("127.0.0.1:50051")' in source
    namespace: dict[str, object] = {}
    exec(source.replace("127.0.0.1:50051", server.address), namespace)  # noqa: S102
    assert namespace["t"] == 1
