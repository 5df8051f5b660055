"""Serving on a Unix domain socket: ``--address unix:PATH``."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _procs import StartServer, clean_env
from onnxps import cli
from onnxps.client import Adam, AsyncClient, Client, UnauthenticatedError
from onnxps.server.app import ServerConfig, ServerHandle, create_server
from onnxps.server.interceptors.security import ConfigError
from onnxps.server.transports._unix import unix_path

W0 = np.arange(1000, dtype=np.float32)
G = np.full(1000, 0.5, np.float32)


@pytest.fixture
def sock(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "ps.sock"
    yield path
    path.unlink(missing_ok=True)


def _mode(path: Path) -> int:
    st = os.lstat(path)
    assert stat.S_ISSOCK(st.st_mode)
    return stat.S_IMODE(st.st_mode)


def test_unix_path_forms() -> None:
    assert unix_path("unix:///run/onnxps.sock") == "/run/onnxps.sock"
    assert unix_path("unix:/run/onnxps.sock") == "/run/onnxps.sock"
    assert unix_path("unix:ps.sock") == "ps.sock"
    assert unix_path("127.0.0.1:50051") is None
    assert unix_path("unix-abstract:onnxps") is None


def test_push_and_pull_over_a_unix_socket(
    servers: Callable[..., ServerHandle], sock: Path
) -> None:
    address = f"unix://{sock}"
    handle = servers(address=address)
    assert handle.address == address
    assert _mode(sock) == 0o600  # the default: only this user connects
    with Client(address, timeout=10) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": W0})
        assert c.push("g", G) == 1
        (w,) = c.pull("g")
    # Apply over the socket gives the same step
    with Client(address, timeout=10) as c:
        out = c.apply(Adam(), 0.1, 0, W0, G, np.zeros_like(W0), np.zeros_like(W0))
    assert w.tobytes() == out[0].tobytes()

    async def async_push() -> int:
        async with AsyncClient(address, timeout=10) as ac:
            return await ac.push("g", G)

    assert asyncio.run(async_push()) == 2
    handle.stop(grace=0)
    assert not sock.exists()  # removed at stop


def test_a_relative_unix_address_and_a_wider_mode(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    handle = servers(address="unix:rel.sock", unix_socket_mode="0660")
    assert _mode(tmp_path / "rel.sock") == 0o660
    with Client("unix:rel.sock", timeout=10) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": W0})
        assert c.push("g", G) == 1
    handle.stop(grace=0)
    assert not (tmp_path / "rel.sock").exists()


def test_a_bad_socket_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="unix_socket_mode must be octal"):
        ServerConfig(address="unix:x.sock", unix_socket_mode="0999")


def test_a_stale_socket_file_is_replaced(
    servers: Callable[..., ServerHandle], sock: Path
) -> None:
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sock))  # a socket file nobody listens on: a killed server's
    dead.close()
    assert sock.exists()
    servers(address=f"unix://{sock}")
    with Client(f"unix://{sock}", timeout=10) as c:
        assert c.list_groups() == []


def test_a_live_socket_is_refused_with_a_clear_message(
    servers: Callable[..., ServerHandle], sock: Path
) -> None:
    address = f"unix://{sock}"
    servers(address=address)
    with pytest.raises(OSError, match="a server is already listening on"):
        create_server(ServerConfig(address=address, durability="none"))
    # the first server still serves, on its own socket file
    with Client(address, timeout=10) as c:
        assert c.list_groups() == []
    out = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--address", address]
        + ["--durability", "none"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=False,
    )
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"onnxps: cannot listen on {address}: a server is already listening on "
        f"{sock} (is another onnxps running? pass another --address)"
    )
    with Client(address, timeout=10) as c:
        assert c.list_groups() == []


def test_a_file_that_is_not_a_socket_is_left_alone(sock: Path) -> None:
    sock.write_text("my notes")
    with pytest.raises(OSError, match="exists and is not a socket"):
        create_server(ServerConfig(address=f"unix://{sock}", durability="none"))
    assert sock.read_text() == "my notes"


def test_tokens_work_over_the_socket(
    servers: Callable[..., ServerHandle], sock: Path, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("admin-token-0123456789 admin *\n")
    address = f"unix://{sock}"
    servers(address=address, tokens_file=str(tokens))
    with Client(address, token="admin-token-0123456789", timeout=10) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": W0})
    with Client(address, timeout=10) as anonymous:
        with pytest.raises(UnauthenticatedError):
            anonymous.push("g", G)


def test_tls_works_over_the_socket(
    servers: Callable[..., ServerHandle], sock: Path, tmp_path: Path
) -> None:
    from _pki import _cert, _key, _pem, _pem_key

    ca_key, server_key = _key(), _key()
    ca = _cert("onnxps test CA", ca_key, "onnxps test CA", ca_key, ca=True)
    cert = _cert("localhost", server_key, "onnxps test CA", ca_key, server=True)
    (tmp_path / "s.pem").write_bytes(_pem(cert))
    (tmp_path / "s.key").write_bytes(_pem_key(server_key))
    address = f"unix://{sock}"
    servers(
        address=address,
        tls_cert=str(tmp_path / "s.pem"),
        tls_key=str(tmp_path / "s.key"),
    )
    # a socket has no host name: the client names the certificate's
    with Client(
        address,
        root_certificates=_pem(ca),
        server_name_override="localhost",
        timeout=10,
    ) as c:
        c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": W0})
        assert c.push("g", G) == 1
    with Client(address, timeout=3) as plaintext:
        with pytest.raises(Exception, match="UNAVAILABLE|within 3 s"):
            plaintext.list_groups()


def test_status_and_serve_commands_take_a_unix_address(
    server_processes: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock = tmp_path / "cli.sock"
    address = f"unix://{sock}"
    proc, listening = server_processes(tmp_path / "server.log", "--address", address)
    try:
        assert listening == address
        assert _mode(sock) == 0o600
        with Client(address, timeout=10) as c:
            c.create_group("g", Adam(), learning_rate=0.1, tensors={"w": W0})
        assert cli.main(["status", address]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[1].split()[:2] == ["g", "adam"]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert not sock.exists()  # a graceful stop removes it
