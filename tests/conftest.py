"""Shared fixtures: a real server on 127.0.0.1 port 0 and a client connected to it."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from onnxps.client import Client
from onnxps.server.app import ServerConfig, ServerHandle, create_server


@pytest.fixture
def server() -> Iterator[ServerHandle]:
    """A started in-process server without durability; stopped after the test."""
    handle = create_server(ServerConfig(address="127.0.0.1:0", durability="none"))
    handle.start()
    try:
        yield handle
    finally:
        handle.stop(grace=0)


@pytest.fixture
def client(server: ServerHandle) -> Iterator[Client]:
    """A client of ``server`` with a 30 s default deadline; closed after the test."""
    with Client(server.address, timeout=30.0) as c:
        yield c


@pytest.fixture
def silent_address() -> Iterator[str]:
    """A TCP port that accepts connections and never speaks HTTP/2."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
