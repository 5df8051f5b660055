"""The data port of an ``onnxps serve`` process serving mutual TLS (``--tls-cert``,
``--tls-key``, ``--tls-client-ca``, ``--data-port``): data channels and frame calls
go over TLS and give the gRPC path's bits; a connection without TLS, without a
client certificate or with one of another CA gets no channel; and a flood of
connections that never finish their TLS handshake does not keep clients with a
certificate and a token out (issue 35: a TLS data port, item 12 over TLS)."""

from __future__ import annotations

import secrets
import socket
import ssl
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from _pki import Pki
from _procs import StartServer
from onnxps.client import Adam, Client
from onnxps.client._settings import multicallable
from onnxps.server.transports._frames import CALL_MAGIC
from onnxps.v1 import parameter_server_pb2 as pb

TOKEN = "admin-token"
RNG = np.random.default_rng(35)


def _serve(server_processes: StartServer, tmp_path: Path, pki: Pki) -> tuple[str, int]:
    """A mutual-TLS server process with a data port: its address and data port."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} admin *\n")
    _, address = server_processes(
        tmp_path / "server.log",
        "--data-port", "0",
        "--tokens-file", str(tokens),
        *pki.flags(),
    )  # fmt: skip
    creds = grpc.ssl_channel_credentials(**pki.client())
    with grpc.secure_channel(address, creds) as ch:
        port = multicallable(ch, "DataChannelHello")(
            pb.DataChannelHelloRequest(),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
            timeout=10,
        ).port
    return address, int(port)


def _tls(pki: Pki, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def _outcome(port: int, ctx: ssl.SSLContext | None) -> str:
    """Present a made-up ticket on a call channel (over ``ctx``, or plaintext):
    how the server ended it (an SSL error, a reset, or its first byte)."""
    sock = socket.create_connection(("127.0.0.1", port), 10)
    try:
        sock.settimeout(10)
        if ctx is not None:  # (the TLS socket takes over the descriptor)
            sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
        sock.sendall(CALL_MAGIC + secrets.token_bytes(32))
        return f"answered {sock.recv(1)!r}"
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as exc:
        return type(exc).__name__
    finally:
        sock.close()


def test_channels_and_frames_over_tls_equal_grpc_and_strangers_get_none(
    server_processes: StartServer, tmp_path: Path, pki: Pki
) -> None:
    address, port = _serve(server_processes, tmp_path, pki)
    x = RNG.standard_normal(1 << 18).astype(np.float32)  # 1 MiB: a data channel
    g = RNG.standard_normal(1 << 18).astype(np.float32)
    small = RNG.standard_normal(64).astype(np.float32)  # a frame call
    creds = {**pki.client(), "token": TOKEN, "shared_memory": "off", "timeout": 30}
    with (
        Client(address, data_channel="on", frames="off", **creds) as dc,
        Client(address, data_channel="off", frames="on", **creds) as fr,
        Client(address, data_channel="off", frames="off", **creds) as ref,
    ):
        for c, prefix in ((dc, "dc-"), (fr, "fr-"), (ref, "ref-")):
            c.create_group(f"{prefix}big", Adam(), learning_rate=0.01,
                           tensors={"w": x})  # fmt: skip
            c.create_group(f"{prefix}small", Adam(), learning_rate=0.01,
                           tensors={"w": small})  # fmt: skip
        # data_channel="on" raises when no channel opens: these go over TLS
        want = ref.push("ref-big", g, return_values=True)[0]
        np.testing.assert_array_equal(dc.push("dc-big", g, return_values=True)[0], want)
        np.testing.assert_array_equal(dc.pull("dc-big")[0], ref.pull("ref-big")[0])
        # small pushes and pulls as frames on a call channel over TLS
        for i in range(3):
            assert fr.push("fr-small", small * i) == ref.push("ref-small", small * i)
        np.testing.assert_array_equal(fr.pull("fr-small")[0], ref.pull("ref-small")[0])
        assert [ch.closed for ch in fr._call_channels.values()] == [False]
    # No TLS, no client certificate, or one another CA signed: the TLS handshake
    # fails (an SSL error or the connection closed, at the handshake or, in TLS
    # 1.3, at the first read), never a refusal byte from a channel's handshake.
    in_tls = ("answered b''", "SSLError", "SSLEOFError", "ConnectionResetError")
    assert _outcome(port, None) in (*in_tls, "answered b'\\x15'")  # a TLS alert
    assert _outcome(port, _tls(pki, None, None)) in in_tls
    assert _outcome(port, _tls(pki, pki.rogue_cert, pki.rogue_key)) in in_tls
    # a valid certificate with a ticket the server never gave: refused (1)
    assert _outcome(port, _tls(pki, pki.cert, pki.key)) == "answered b'\\x01'"


@pytest.mark.slow
def test_a_flood_of_stalled_tls_handshakes_does_not_deny_the_data_channel(
    server_processes: StartServer, tmp_path: Path, pki: Pki
) -> None:
    """Connections to the TLS data port that send nothing, or the first bytes of a
    ClientHello and then nothing: 100 from 127.0.0.2 and 40 from the clients' own
    address, then 2 more before each of 12 fresh clients with a certificate and a
    token opens a data channel (data_channel="on" raises when refused). Every
    push goes through and the server closes every flood connection."""
    address, port = _serve(server_processes, tmp_path, pki)
    g = np.ones(1 << 18, np.float32)
    creds = {**pki.client(), "token": TOKEN, "shared_memory": "off", "timeout": 30}

    def flood(count: int, source: str) -> list[socket.socket]:
        made = []
        for i in range(count):
            s = socket.create_connection(
                ("127.0.0.1", port), timeout=10, source_address=(source, 0)
            )
            if i % 2:
                s.sendall(b"\x16\x03\x01\x02\x00")  # a ClientHello's record header
            made.append(s)
        return made

    flooding: list[socket.socket] = []
    try:
        with Client(address, data_channel="off", **creds) as admin:
            admin.create_group(
                "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros_like(g)}
            )
        flooding = flood(100, "127.0.0.2") + flood(40, "127.0.0.1")
        time.sleep(1.2)  # past the 1 s of grace
        failures: list[str] = []
        for _ in range(12):
            flooding += flood(2, "127.0.0.1")
            try:
                with Client(address, data_channel="on", **creds) as c:
                    c.push("g", g)
            except Exception as exc:  # noqa: BLE001 - counted and shown
                failures.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.05)
        assert failures == [], f"{len(failures)} of 12 failed: {failures[:2]}"
        closed = 0
        for s in flooding:
            s.settimeout(10)
            try:
                while s.recv(1024):
                    pass
                closed += 1
            except TimeoutError:
                pass
            except OSError:
                closed += 1  # reset
        assert closed == len(flooding)
        with Client(address, data_channel="off", **creds) as admin:
            assert admin.describe_group("g").update_count == 12
    finally:
        for s in flooding:
            s.close()
