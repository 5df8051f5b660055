"""The first hour with onnxps (issue 25): what a newcomer types first works, or
says in one line what to do instead."""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import random
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxps.client
import pytest
from _pki import _cert, _key, _pem, _pem_key
from _procs import clean_env
from onnxps import cli
from onnxps.cli._demo_worker import loss_text
from onnxps.cli.demo import STEP_LINE, Progress
from onnxps.client import (
    Adam,
    AlreadyExistsError,
    AsyncClient,
    Client,
    FailedPreconditionError,
    InvalidArgumentError,
    UnauthenticatedError,
    UnavailableError,
)
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.server.cli import (
    add_serve_arguments,
    config_flags,
    config_from_args,
    parse_bytes,
)


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
def default_port_server(
    servers: Callable[..., ServerHandle],
) -> Iterator[tuple[str, ServerHandle]]:
    host = _loopback_with_free_default_port()
    handle = servers(ServerConfig(address=f"{host}:50051", durability="none"))
    yield host, handle


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
def tls_server(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> Iterator[ServerHandle]:
    ca_key, key = _key(), _key()
    cert = _cert("localhost", key, "onnxps test CA", ca_key, server=True)
    (tmp_path / "server.pem").write_bytes(_pem(cert))
    (tmp_path / "server.key").write_bytes(_pem_key(key))
    handle = servers(
        ServerConfig(
            address="127.0.0.1:0",
            durability="none",
            tls_cert=str(tmp_path / "server.pem"),
            tls_key=str(tmp_path / "server.key"),
        )
    )
    yield handle


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


def test_a_tls_client_at_a_plaintext_server_is_told_in_one_line(
    server: ServerHandle, tmp_path: Path
) -> None:
    """The reverse of the test above: the hint replaces 300 characters of OpenSSL,
    and the command prints no gRPC C-core line before its own."""
    ca_key = _key()
    ca = _cert("onnxps test CA", ca_key, "onnxps test CA", ca_key, ca=True)
    (tmp_path / "ca.pem").write_bytes(_pem(ca))
    with Client(server.address, timeout=5, root_certificates=_pem(ca)) as ps:
        with pytest.raises(UnavailableError) as err:
            ps.list_groups()
    assert err.value.details == (
        "the TLS handshake failed: the server did not answer in TLS "
        "(WRONG_VERSION_NUMBER). If it runs without TLS, this client spoke TLS to "
        "it: leave out root_certificates (--tls-ca on the command line), or give "
        "the server --tls-cert and --tls-key"
    )
    env = clean_env()
    env.pop("GRPC_VERBOSITY", None)
    run = subprocess.run(
        [sys.executable, "-m", "onnxps", "status", server.address, "--timeout", "5",
         "--tls-ca", str(tmp_path / "ca.pem")],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert run.returncode == 1
    assert run.stdout == ""
    assert run.stderr == (
        f"onnxps status: cannot list the groups on {server.address}: UNAVAILABLE: "
        f"{err.value.details}\n"
    )


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


@pytest.mark.slow
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
    expected = (
        f"onnxps {command[0]}: {what}: UNAVAILABLE: cannot connect to {address}: "
    )
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


def test_exceptions_print_under_the_module_they_are_imported_from(
    client: Client,
) -> None:
    client.create_group(
        "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3, np.float32)}
    )
    with pytest.raises(AlreadyExistsError) as err:
        client.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3, np.float32)}
        )
    last = traceback.format_exception_only(err.value)[-1]
    assert last.startswith("onnxps.client.AlreadyExistsError: ALREADY_EXISTS: ")
    for name in onnxps.client.__all__:
        value = getattr(onnxps.client, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert not value.__module__.startswith("onnxps.client._"), name


def test_python_lists_are_gradients_of_the_groups_dtype(client: Client) -> None:
    client.create_group(
        "g",
        Adam(),
        learning_rate=0.1,
        tensors={"w": np.zeros(3, np.float32), "b": np.zeros((), np.float32)},
    )
    assert client.push("g", [1.0, 2.0, 3.0], 0.5) == 1
    assert client.push("g", (1, 2, 3), 1) == 2
    with pytest.raises(InvalidArgumentError) as err:  # an array keeps its dtype
        client.push("g", np.ones(3), np.float32(1))
    assert err.value.details == (
        "gradient 1 ('w') must be float32, the group's dtype; got float64"
    )
    with Client(client.address, timeout=10) as fresh:  # learns it from a pull
        fresh.pull("g")
        assert fresh.push("g", [0.0, 0.0, 0.0], 0.0) == 3


def test_a_refused_token_names_the_call_the_user_made(
    servers: Callable[..., ServerHandle], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("admin-token-0123456789 admin *\n")
    handle = servers(
        ServerConfig(address="127.0.0.1:0", durability="none", tokens_file=str(tokens))
    )
    with Client(handle.address, token="admin-token-0123456789") as admin:
        admin.create_group(
            "g", Adam(), learning_rate=0.1, tensors={"w": np.zeros(3, np.float32)}
        )
    with Client(handle.address, token="not-a-token-0123456789") as ps:
        with pytest.raises(UnauthenticatedError) as err:
            ps.pull("g")
    assert err.value.details == (
        "pull() was refused: DescribeGroup: the token is not known to this server"
    )
    assert err.value.metadata["method"] == "DescribeGroup"

    async def pushed() -> None:
        async with AsyncClient(handle.address, token="not-a-token-01234") as aps:
            await aps.push("g", np.ones(3, np.float32))

    with pytest.raises(UnauthenticatedError) as err:
        asyncio.run(pushed())
    assert err.value.details == "Push: the token is not known to this server"

    async def pulled() -> None:
        async with AsyncClient(handle.address, token="not-a-token-01234") as aps:
            await aps.pull("g")

    with pytest.raises(UnauthenticatedError) as err:
        asyncio.run(pulled())
    assert err.value.details.startswith("pull() was refused: DescribeGroup: ")


def test_a_refusals_traceback_is_the_call_and_the_method_that_raised_it(
    server: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/troubleshooting.md: two frames, the user's call and the client's public
    method (its line ``raise surfaced(...)``), for both clients."""
    monkeypatch.delenv("ONNXPS_DEBUG", raising=False)
    with Client(server.address, timeout=10) as ps:
        with pytest.raises(onnxps.client.NotFoundError) as err:
            ps.pull("no-such-group")
    sync = traceback.extract_tb(err.value.__traceback__)

    async def pull() -> None:
        async with AsyncClient(server.address, timeout=10) as aps:
            await aps.pull("no-such-group")

    with pytest.raises(onnxps.client.NotFoundError) as aerr:
        asyncio.run(pull())
    awaited = traceback.extract_tb(aerr.value.__traceback__)
    assert [f.name for f in sync] == [
        "test_a_refusals_traceback_is_the_call_and_the_method_that_raised_it",
        "method",
    ]
    assert [f.name for f in awaited][-2:] == ["pull", "method"]
    for frames, module in ((sync, "_client.py"), (awaited, "_async.py")):
        assert Path(frames[-1].filename).parts[-2:] == ("client", module)
        assert (frames[-1].line or "").startswith("raise surfaced(exc, ")


def test_a_wrong_shard_order_is_one_line_not_thirty_frames(
    servers: Callable[..., ServerHandle],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ONNXPS_DEBUG", raising=False)
    shards = [servers(shard=f"{i}/2") for i in range(2)]
    backwards = [shards[1].address, shards[0].address]
    with Client(backwards, timeout=10) as ps:
        with pytest.raises(FailedPreconditionError) as err:
            ps.list_groups()
    frames = traceback.extract_tb(err.value.__traceback__)
    # this test's call, and the client's public method that raised
    assert [f.name for f in frames] == [
        "test_a_wrong_shard_order_is_one_line_not_thirty_frames",
        "method",
    ]
    assert err.value.reason == "SHARD_LAYOUT_MISMATCH"
    assert "its address list is in another order" in err.value.details
    assert cli.main(["status", ",".join(backwards)]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1
    assert errors[0].endswith("(its address list is in another order)")


def test_the_demos_progress_lines_say_what_they_know() -> None:
    out = io.StringIO()
    bar = Progress(400, out, tty=False, every=0.0)
    bar.update(0, None)
    bar.update(100, 1.5)  # the first count: no rate yet
    bar.update(400, 2.5e-5)  # the workers are done...
    bar.update(400, 2.5e-5, force=True)  # ...and the demo's last, forced, update
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert " 100/400 pushes  loss 1.5000  " in lines[1]
    assert "pushes/s" not in lines[1]  # no rate from one count, and no "- pushes/s"
    assert lines[2].startswith("progress 100%  400/400 pushes  loss 2.50e-05  ")
    assert " 0 pushes/s" not in lines[2]


def test_a_long_demo_runs_loss_is_not_zero() -> None:
    line = f"worker 0/4 step 3000/3000 loss {loss_text(2.5e-5)}"
    assert line == "worker 0/4 step 3000/3000 loss 2.50e-05"
    m = STEP_LINE.match(line)
    assert m is not None and float(m.group(3)) == 2.5e-5
    assert loss_text(0.4321) == "0.4321"


def test_serve_help_is_grouped_with_units_and_every_default() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert run.returncode == 0, run.stderr
    sections = [
        line[:-1]
        for line in run.stdout.splitlines()
        if line.endswith(":") and not line.startswith(" ")  # headings, not help
    ]
    assert sections == [
        "options",
        "network",
        "security",
        "durability",
        "limits",
        "memory",
        "training",
        "cluster",
        "replication",
        "observability",
    ]
    text = " ".join(run.stdout.split())
    assert "default None" not in text and "268435456" not in text
    assert "(ONNXPS_MAX_MESSAGE_BYTES; default 256 MiB)" in text
    assert "(ONNXPS_MAX_INFLIGHT_BYTES; default 4 GiB)" in text
    assert "(ONNXPS_STALL_SECONDS; default 30 s)" in text
    assert "(ONNXPS_METRICS_PORT; default no metrics endpoint)" in text
    assert "(ONNXPS_MAX_CONCURRENT_STREAMS; default half of --threads)" in text
    for flag in config_flags():  # every flag says its variable and its default
        assert f"({flag.env}; default " in text, flag.flag


def test_sizes_take_units() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, environ={"ONNXPS_MAX_INFLIGHT_BYTES": "8G"})
    config = config_from_args(parser.parse_args(["--max-message-bytes", "512MiB"]))
    assert config.max_message_bytes == 512 << 20
    assert config.max_inflight_bytes == 8 << 30
    assert parse_bytes("1048576") == 1 << 20
    with pytest.raises(ValueError, match="'12 parsecs' is not a byte count"):
        parse_bytes("12 parsecs")
