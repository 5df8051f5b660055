"""The first hour with onnxps (issue 25): what a newcomer types first works, or
says in one line what to do instead."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _procs import clean_env
from onnxps import cli
from onnxps.client import Adam, AsyncClient, Client, UnavailableError
from onnxps.server.app import ServerConfig, ServerHandle, create_server
from test_security import _cert, _key, _pem, _pem_key


def _loopback_with_free_default_port() -> str:
    """A 127.x.y.z address (all of 127/8 is loopback on Linux) whose port 50051 is
    free, so a server can listen on the default port without taking 127.0.0.1's."""
    rng = random.Random()
    for _ in range(50):
        host = (
            f"127.{rng.randrange(1, 255)}.{rng.randrange(255)}.{rng.randrange(1, 255)}"
        )
        with socket.socket() as s:
            try:
                s.bind((host, 50051))
            except OSError:
                continue
        return host
    raise RuntimeError("no 127/8 address with port 50051 free")


@pytest.fixture
def default_port_server() -> Iterator[tuple[str, ServerHandle]]:
    host = _loopback_with_free_default_port()
    handle = create_server(ServerConfig(address=f"{host}:50051", durability="none"))
    handle.start()
    try:
        yield host, handle
    finally:
        handle.stop(grace=0)


def test_an_address_without_a_port_means_50051(
    default_port_server: tuple[str, ServerHandle],
    capsys: pytest.CaptureFixture[str],
) -> None:
    host, server = default_port_server
    assert server.port == 50051
    with Client(host, timeout=10) as ps:
        assert ps.addresses == [f"{host}:50051"]
        ps.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3, np.float32)}
        )
        assert [g.name for g in ps.list_groups()] == ["g"]
    with Client([host], timeout=10) as ps:  # a cluster (of one) given as a list
        assert ps.describe_group("g").update_count == 0

    async def listed() -> list[str]:
        async with AsyncClient(host, timeout=10) as aps:
            return [g.name for g in await aps.list_groups()]

    assert asyncio.run(listed()) == ["g"]
    assert cli.main(["status", host]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:3] == ["g", "adam", "float32"]


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[ServerHandle]:
    ca_key, key = _key(), _key()
    cert = _cert("localhost", key, "onnxps test CA", ca_key, server=True)
    (tmp_path / "server.pem").write_bytes(_pem(cert))
    (tmp_path / "server.key").write_bytes(_pem_key(key))
    handle = create_server(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            tls_cert=str(tmp_path / "server.pem"),
            tls_key=str(tmp_path / "server.key"),
        )
    ).start()
    try:
        yield handle
    finally:
        handle.stop(grace=0)


def test_a_plaintext_client_at_a_tls_server_is_told_about_tls(
    tls_server: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(tls_server.address, timeout=5) as ps:
        with pytest.raises(UnavailableError) as err:
            ps.list_groups()
    assert "Socket closed" in err.value.details
    assert "root_certificates=ca_pem" in err.value.details
    assert "--tls-ca" in err.value.details
    assert cli.main(["status", tls_server.address]) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        f"onnxps status: cannot list the groups on {tls_server.address}"
    )
    assert line.endswith("or --tls-ca ca.pem on the command line)")


def _dead_address() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_push_to_a_server_that_is_down_warns_that_it_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = _dead_address()
    caplog.set_level(logging.INFO, logger="onnxps.client")
    with Client(address, timeout=3) as ps:
        with pytest.raises(UnavailableError) as err:
            ps.push("g", np.ones(3, np.float32))
    assert f"the server at {address} stayed unavailable for 3 s" in str(err.value)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "onnxps.client" and r.levelno == logging.WARNING
    ]
    assert len(warnings) == 1, warnings  # once, then at most every 5 s
    assert warnings[0].startswith(
        f"push to group g: the server at {address} is unavailable (UNAVAILABLE: "
    )
    assert "Connection refused" in warnings[0]
    assert "(timeout=3; pass a smaller timeout= to the client" in warnings[0]


@pytest.mark.parametrize("command", [["status"], ["export", "--prefix", "x"]])
def test_a_dead_port_is_one_message_whatever_the_timeout(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = _dead_address()
    extra = [str(tmp_path / "out.npz")] if command[0] == "export" else []
    lines = []
    for timeout in ([], ["--timeout", "1"], ["--timeout", "0.2"]):
        assert cli.main([command[0], address, *extra, *command[1:], *timeout]) == 1
        lines.append(capsys.readouterr().err.strip())
    what = f"cannot list the groups on {address}" if command[0] == "status" else address
    expected = f"onnxps {command[0]}: {what}: UNAVAILABLE: cannot connect to {address}: "
    assert lines == [expected + "Connection refused"] * 3


def test_a_bad_choice_from_a_variable_names_the_variable() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(ONNXPS_DURABILITY="bogus"),
    )
    assert run.returncode == 2
    assert run.stderr == (
        "onnxps serve: argument --durability: 'bogus' is not one of none, snapshot, "
        "wal (from ONNXPS_DURABILITY) (see onnxps serve --help)\n"
    )
