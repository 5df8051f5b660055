"""TLS, mutual TLS, token roles and group prefixes, and the safe-bind policy."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from _pki import _cert, _key, _pem, _pem_key
from cryptography import x509
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.client import (
    Adagrad,
    AsyncClient,
    Client,
    PermissionDeniedError,
    UnauthenticatedError,
)
from onnxps.server.app import ServerConfig, ServerHandle, create_server
from onnxps.server.interceptors.security import (
    ConfigError,
    check_bind_policy,
    is_loopback,
    parse_tokens,
)
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import SERVICE

W0 = np.array([1.0, 2.0, 3.0], np.float32)
G = np.array([0.5, -0.5, 0.25], np.float32)


# -- certificates made at test time ----
@dataclass(frozen=True)
class Pki:
    ca: bytes
    server_cert: Path
    server_key: Path
    ca_file: Path
    client_cert: bytes
    client_key: bytes
    rogue_cert: bytes  # signed by a CA the server does not trust
    rogue_key: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("onnxps test CA", ca_key, "onnxps test CA", ca_key, ca=True)
    server_key, client_key, rogue_key = _key(), _key(), _key()
    server = _cert("localhost", server_key, "onnxps test CA", ca_key, server=True)
    client = _cert("worker-1", client_key, "onnxps test CA", ca_key)
    rogue = _cert("intruder", rogue_key, "rogue CA", rogue_ca_key)
    (d / "ca.pem").write_bytes(_pem(ca))
    (d / "server.pem").write_bytes(_pem(server))
    (d / "server.key").write_bytes(_pem_key(server_key))
    return Pki(
        ca=_pem(ca),
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        ca_file=d / "ca.pem",
        client_cert=_pem(client),
        client_key=_pem_key(client_key),
        rogue_cert=_pem(rogue),
        rogue_key=_pem_key(rogue_key),
    )


def _raw_describe(
    address: str, creds: grpc.ChannelCredentials, group: str = "nope"
) -> grpc.StatusCode:
    """One DescribeGroup over a channel without retries; the status it ends with."""
    with grpc.secure_channel(address, creds) as ch:
        try:
            pb_grpc.ParameterServerServiceStub(ch).DescribeGroup(
                pb.DescribeGroupRequest(group=group), timeout=5
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


# -- TLS ----
def test_tls_serves_a_client_that_trusts_the_ca(
    servers: Callable[..., ServerHandle], pki: Pki
) -> None:
    handle = servers(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key))
    with Client(handle.address, root_certificates=pki.ca, timeout=10) as c:
        c.create_group("t", Adagrad(), learning_rate=0.5, tensors={"w": W0})
        assert c.push("t", G) == 1
        assert c.describe_group("t").update_count == 1
    # by host name too: the certificate names localhost
    local = f"localhost:{handle.port}"
    with Client(local, root_certificates=pki.ca, timeout=10) as c:
        assert c.describe_group("t").update_count == 1
    # a plaintext client cannot talk to a TLS server
    with grpc.insecure_channel(handle.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.ParameterServerServiceStub(ch).DescribeGroup(
                pb.DescribeGroupRequest(group="t"), timeout=5
            )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_from_the_ca(
    servers: Callable[..., ServerHandle], pki: Pki
) -> None:
    handle = servers(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca_file),
    )
    with Client(
        handle.address,
        root_certificates=pki.ca,
        private_key=pki.client_key,
        certificate_chain=pki.client_cert,
        timeout=10,
    ) as c:
        c.create_group("m", Adagrad(), learning_rate=0.5, tensors={"w": W0})
        assert c.push("m", G) == 1
    no_cert = grpc.ssl_channel_credentials(pki.ca)
    assert _raw_describe(handle.address, no_cert, "m") == (grpc.StatusCode.UNAVAILABLE)
    rogue = grpc.ssl_channel_credentials(pki.ca, pki.rogue_key, pki.rogue_cert)
    assert _raw_describe(handle.address, rogue, "m") == (grpc.StatusCode.UNAVAILABLE)
    good = grpc.ssl_channel_credentials(pki.ca, pki.client_key, pki.client_cert)
    assert _raw_describe(handle.address, good, "m") == grpc.StatusCode.OK


# -- tokens ----
def test_async_client_over_mutual_tls_streams_and_unary(
    servers: Callable[..., ServerHandle], pki: Pki
) -> None:
    handle = servers(
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca_file),
    )

    async def run() -> list[int]:
        async with AsyncClient(
            f"localhost:{handle.port}",
            root_certificates=pki.ca,
            private_key=pki.client_key,
            certificate_chain=pki.client_cert,
            timeout=10,
        ) as c:
            await c.create_group("t", Adagrad(), learning_rate=0.5, tensors={"w": W0})
            ts = [await c.push("t", G)]
            c.transport = "stream"
            ts.append(await c.push("t", G))
            return ts

    assert asyncio.run(run()) == [1, 2]


TOKENS = {
    "admin": "adm-7f3a9c1e5b2d4f60",
    "writer": "wr-1b2c3d4e5f607182",
    "reader": "rd-99aa88bb77cc66dd",
    "a_writer": "aw-0011223344556677",
}


@pytest.fixture(scope="module")
def auth_server(
    module_servers: Callable[..., ServerHandle],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerHandle]:
    """One server with tokens, for the module's tests."""
    path = tmp_path_factory.mktemp("auth") / "tokens.txt"
    path.write_text(
        "# token role prefixes\n"
        f"{TOKENS['admin']} admin *\n"
        f"{TOKENS['writer']} write *\n"
        f"{TOKENS['reader']} read *\n"
        f"\n{TOKENS['a_writer']} write a/,shared/\n"
    )
    handle = module_servers(tokens_file=str(path))
    with Client(handle.address, token=TOKENS["admin"], timeout=10) as admin:
        for name in ("a/x", "b/x"):
            admin.create_group(name, Adagrad(), learning_rate=0.5, tensors={"w": W0})
    yield handle


def _state(handle: ServerHandle, group: str) -> tuple[int, list[bytes]]:
    with Client(handle.address, token=TOKENS["admin"], timeout=10) as c:
        t, arrays = c.pull_versioned(group, state=True)
    return t, [a.tobytes() for a in arrays]


def test_no_token_or_an_unknown_token_is_unauthenticated(
    auth_server: ServerHandle,
) -> None:
    before = _state(auth_server, "a/x")
    for token in (None, "not-a-token", TOKENS["admin"] + "x", TOKENS["admin"][:-1]):
        with Client(auth_server.address, token=token, timeout=10) as c:
            with pytest.raises(UnauthenticatedError) as err:
                c.push("a/x", G)
            assert "token" in err.value.details
            assert TOKENS["admin"] not in err.value.details
            assert err.value.reason == (
                "TOKEN_MISSING" if token is None else "TOKEN_UNKNOWN"
            )
            assert err.value.metadata == {"method": "Push"}
            with pytest.raises(UnauthenticatedError):
                c.pull("a/x")
            with pytest.raises(UnauthenticatedError):
                c.list_groups()
    assert _state(auth_server, "a/x") == before


def test_a_read_token_reads_but_cannot_push_or_create(
    auth_server: ServerHandle,
) -> None:
    before = _state(auth_server, "b/x")
    with Client(auth_server.address, token=TOKENS["reader"], timeout=10) as c:
        assert c.describe_group("b/x").update_count == before[0]
        assert [a.tobytes() for a in c.pull("b/x")] == before[1][:1]
        for transport in ("unary", "stream"):
            c.transport = transport
            with pytest.raises(PermissionDeniedError) as err:
                c.push("b/x", G)
            method = "Push" if transport == "unary" else "PushStream"
            assert err.value.details == "a read token may not call " + method
            assert err.value.reason == "ROLE_FORBIDS_METHOD"
            assert err.value.metadata == {"method": method, "role": "read"}
        c.transport = "auto"
        with pytest.raises(PermissionDeniedError):
            c.set_learning_rate("b/x", 9.0)
        with pytest.raises(PermissionDeniedError):
            c.join("b/x")
        with pytest.raises(PermissionDeniedError):
            c.create_group("b/new", Adagrad(), learning_rate=1.0, tensors={"w": W0})
        with pytest.raises(PermissionDeniedError):
            c.delete_group("b/x")
    assert _state(auth_server, "b/x") == before
    with Client(auth_server.address, token=TOKENS["admin"], timeout=10) as c:
        assert c.describe_group("b/x").learning_rate == 0.5
        assert sorted(g.name for g in c.list_groups()) == ["a/x", "b/x"]


def test_a_prefix_token_touches_only_its_prefixes(auth_server: ServerHandle) -> None:
    before_b = _state(auth_server, "b/x")
    with Client(auth_server.address, token=TOKENS["a_writer"], timeout=10) as c:
        t = c.push("a/x", G)
        assert t == c.describe_group("a/x").update_count
        for transport in ("unary", "stream"):
            c.transport = transport
            with pytest.raises(PermissionDeniedError) as err:
                c.push("b/x", G)
            assert err.value.details == (
                "this token may touch groups whose names start with 'a/', 'shared/', "
                "not 'b/x'"
            )
            assert err.value.reason == "GROUP_NOT_PERMITTED"
            assert err.value.metadata == {"group": "b/x", "prefixes": "'a/', 'shared/'"}
            with pytest.raises(PermissionDeniedError):
                c.pull("b/x")
        c.transport = "auto"
        with pytest.raises(PermissionDeniedError):
            c.describe_group("b/x")
        with pytest.raises(PermissionDeniedError):
            c.set_learning_rate("b/x", 3.0)
        # ListGroups shows only what the token may touch
        assert [g.name for g in c.list_groups()] == ["a/x"]
        assert [g.name for g in c.list_groups("b/")] == []
    assert _state(auth_server, "b/x") == before_b


def test_a_write_token_pushes_but_cannot_create_or_delete(
    auth_server: ServerHandle,
) -> None:
    with Client(auth_server.address, token=TOKENS["writer"], timeout=10) as c:
        t = c.describe_group("b/x").update_count
        assert c.push("b/x", G) == t + 1
        c.join("b/x")
        c.leave("b/x")
        with pytest.raises(PermissionDeniedError) as err:
            c.delete_group("b/x")
        assert err.value.details == "a write token may not call DeleteGroup"
        assert c.describe_group("b/x").update_count == t + 1


def test_health_stays_open_without_a_token(auth_server: ServerHandle) -> None:
    with grpc.insecure_channel(auth_server.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="onnxps.v1.ParameterServerService"),
            timeout=5,
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _silent(stop: threading.Event) -> Iterator[pb.PushStreamRequest]:
    """A request stream that sends nothing until ``stop`` is set."""
    stop.wait(30)
    yield from ()


def test_silent_streams_without_a_token_are_refused_at_once(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
) -> None:
    """ISSUE11 item 2: authentication reads the metadata, never the first message,
    so 64 streams that send nothing cannot hold the server's 8 threads."""
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"{TOKENS['admin']} admin *\n")
    handle = servers(tokens_file=str(tokens), threads=8)
    stop = threading.Event()
    try:
        with (
            grpc.insecure_channel(handle.address) as ch,
            Client(handle.address, token=TOKENS["admin"], timeout=10) as admin,
        ):
            admin.create_group("g", Adagrad(), learning_rate=0.5, tensors={"w": W0})
            stub = pb_grpc.ParameterServerServiceStub(ch)
            calls = [
                stub.PushStream.future(_silent(stop), timeout=20) for _ in range(64)
            ]
            for call in calls:
                exc = call.exception(timeout=10)  # type: ignore[call-arg]
                assert isinstance(exc, grpc.RpcError)
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE),
                timeout=2,
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert admin.push("g", G, timeout=2) == 1
    finally:
        stop.set()


def test_token_file_formats_and_errors() -> None:
    line = parse_tokens("# c\ntok1 read a/,b/\n\ntok2 admin *\n")
    as_json = parse_tokens(
        json.dumps(
            {
                "tokens": [
                    {"token": "tok1", "role": "read", "prefixes": ["a/", "b/"]},
                    {"token": "tok2", "role": "admin", "prefixes": ["*"]},
                ]
            }
        )
    )
    assert [(g.role, g.prefixes) for g in line] == [
        ("read", ("a/", "b/")),
        ("admin", ("",)),
    ]
    assert [(g.role, g.prefixes, g.digest) for g in as_json] == [
        (g.role, g.prefixes, g.digest) for g in line
    ]
    assert line[0].allows_group("a/x") and not line[0].allows_group("c/a/x")
    with pytest.raises(ConfigError, match=r"line 2: role 'root' is not one of"):
        parse_tokens("s3cret-1 read *\ns3cret-2 root *\n")
    with pytest.raises(ConfigError, match=r"line 1: expected 'token role prefix"):
        parse_tokens("s3cret-1 read\n")
    with pytest.raises(ConfigError, match="one token twice"):
        parse_tokens("s3cret-1 read *\ns3cret-1 write a/\n")
    with pytest.raises(ConfigError, match="entry 1: the token must be"):
        parse_tokens('[{"token": "", "role": "read"}]')
    for bad in ("s3cret-1 root *", "s3cret-1 read"):
        with pytest.raises(ConfigError) as err:
            parse_tokens(bad)
        assert "s3cret" not in str(err.value)


# -- the bind policy ----
@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:50051", True),
        ("127.3.2.1:1", True),
        ("localhost:0", True),
        ("[::1]:0", True),
        ("unix:/tmp/onnxps.sock", True),
        ("0.0.0.0:0", False),
        ("[::]:0", False),
        ("10.1.2.3:50051", False),
        ("ps.example.com:50051", False),
    ],
)
def test_which_addresses_are_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback
    config = ServerConfig(address=address)
    if loopback:
        check_bind_policy(config)
    else:
        with pytest.raises(ConfigError, match="not a loopback address"):
            check_bind_policy(config)
        check_bind_policy(ServerConfig(address=address, insecure=True))
        check_bind_policy(
            ServerConfig(address=address, tls_cert="c", tls_key="k", tokens_file="t")
        )
        with pytest.raises(ConfigError, match=r"without token authentication"):
            check_bind_policy(ServerConfig(address=address, tls_cert="c", tls_key="k"))


def test_a_public_bind_without_tls_and_tokens_refuses_to_start(
    servers: Callable[..., ServerHandle],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(ConfigError) as err:
        create_server(ServerConfig(address="0.0.0.0:0", durability="none"))
    assert str(err.value).startswith(
        "refusing to listen on 0.0.0.0:0, which is not a loopback address, without "
        "TLS (--tls-cert, --tls-key) and token authentication (--tokens-file)"
    )
    with caplog.at_level(logging.WARNING, logger="onnxps.security"):
        handle = servers(address="0.0.0.0:0", insecure=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert (
        warnings[0]
        .getMessage()
        .startswith("listening on 0.0.0.0:0, which is not loopback, without TLS")
    )
    with Client(f"127.0.0.1:{handle.port}", timeout=10) as c:
        assert c.list_groups() == []


def test_inconsistent_tls_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="both a certificate"):
        create_server(ServerConfig(address="127.0.0.1:0", tls_cert="server.pem"))
    with pytest.raises(ConfigError, match="needs server TLS too"):
        create_server(ServerConfig(address="127.0.0.1:0", tls_client_ca="ca.pem"))


def test_the_cli_refuses_a_public_bind_with_a_message_and_status_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--address", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "ONNXPS_DURABILITY": "none"},
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("onnxps: refusing to listen on 0.0.0.0:0")
    assert "Traceback" not in proc.stderr


def test_async_client_sends_its_token(auth_server: ServerHandle) -> None:
    async def push(token: str | None) -> int:
        async with AsyncClient(auth_server.address, token=token, timeout=10) as c:
            return await c.push("a/x", G)

    before = _state(auth_server, "a/x")[0]
    assert asyncio.run(push(TOKENS["writer"])) == before + 1
    with pytest.raises(UnauthenticatedError):
        asyncio.run(push(None))
    with pytest.raises(PermissionDeniedError):
        asyncio.run(push(TOKENS["reader"]))


def test_a_prefix_confined_admin_may_not_move_groups_between_shards(
    servers: Callable[..., ServerHandle],
    tmp_path: Path,
) -> None:
    """Resharding's RPCs are the cluster's: an admin confined to 'a/' can neither
    hold, import (a snapshot names its group only inside) nor export a group, its
    own included; an admin for every group can, and the refused calls change
    nothing."""
    tokens = tmp_path / "tokens.txt"
    tenant, operator = "tenant-admin-5e6f7a8b9c", "operator-admin-0d1e2f3a4b"
    tokens.write_text(f"{tenant} admin a/\n{operator} admin *\n")
    handle = servers(tokens_file=str(tokens))
    with Client(handle.address, token=operator, timeout=10) as admin:
        admin.create_group("a/x", Adagrad(), learning_rate=0.5, tensors={"w": W0})
    with grpc.insecure_channel(handle.address) as ch:
        stub = pb_grpc.ParameterServerServiceStub(ch)
        as_tenant = (("authorization", f"Bearer {tenant}"),)
        calls: dict[str, Callable[[], object]] = {
            "MoveGroup": lambda: stub.MoveGroup(
                pb.MoveGroupRequest(group="a/x", step=pb.MOVE_STEP_BEGIN_IMPORT),
                metadata=as_tenant,
            ),
            "ExportGroup": lambda: list(
                stub.ExportGroup(
                    pb.ExportGroupRequest(group="a/x", fence=True),
                    metadata=as_tenant,
                )
            ),
            "ImportGroup": lambda: stub.ImportGroup(
                iter([pb.ImportGroupRequest(done=pb.ReplicaSnapshotDone())]),
                metadata=as_tenant,
            ),
        }
        for method, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
            details = err.value.details() or ""
            assert f"{method} moves groups between shards" in details, details
            assert "prefix '*'" in details and "'a/'" in details, details
        # nothing was fenced, held or deleted: the tenant's group still steps
        with Client(handle.address, token=tenant, timeout=10) as c:
            c.push("a/x", G)
            assert c.describe_group("a/x").update_count == 1
        as_operator = (("authorization", f"Bearer {operator}"),)
        begin = pb.MoveGroupRequest(group="a/new", step=pb.MOVE_STEP_BEGIN_IMPORT)
        assert not stub.MoveGroup(begin, metadata=as_operator).present
        abort = pb.MoveGroupRequest(group="a/new", step=pb.MOVE_STEP_ABORT_IMPORT)
        stub.MoveGroup(abort, metadata=as_operator)
