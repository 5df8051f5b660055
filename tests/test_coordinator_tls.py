"""A replicated cluster whose etcd serves TLS only (``etcds://``, docs/cluster.md):
servers, ``Client`` and ``onnxps status`` check etcd's certificate and present
theirs; a wrong CA or a plaintext address is refused, saying so."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _etcd import EtcdProcess, etcd_binary, start_etcd
from _pki import Pki, pki  # noqa: F401 - a fixture
from _procs import clean_env
from onnxps.client import Adagrad, AsyncClient, Client
from onnxps.server.app import ServerConfig, create_server
from onnxps.server.interceptors.security import ConfigError
from onnxps.wire.coordinator import (
    CoordinatorAddress,
    CoordinatorTls,
    is_coordinator,
    parse_coordinator,
)
from test_replication import SIZE, ReplicaSet

G = np.full(SIZE, 0.5, np.float32)


# -- the address ------------------------------------------------------------------
def test_etcds_names_tls_and_keeps_its_files(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    tls = CoordinatorTls(str(ca))
    address = parse_coordinator("etcds://h1:2379,[::1]:2380/ps/", tls)
    assert address == CoordinatorAddress((("h1", 2379), ("::1", 2380)), "/ps", tls)
    assert str(address) == "etcds://h1:2379,::1:2380/ps"
    assert str(parse_coordinator("etcd://h1:2379/ps")) == "etcd://h1:2379/ps"
    assert parse_coordinator("etcd://h1:2379/ps").tls is None
    assert is_coordinator("etcds://h:1/p") and is_coordinator("etcd://h:1/p")
    assert not is_coordinator("https://h:1/p")


def test_etcds_takes_its_files_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("CA", "CERT", "KEY"):
        (tmp_path / name).write_text("x")
        monkeypatch.setenv(f"ONNXPS_COORDINATOR_{name}", str(tmp_path / name))
    got = parse_coordinator("etcds://h:2379/ps").tls
    assert got == CoordinatorTls(*(str(tmp_path / n) for n in ("CA", "CERT", "KEY")))


@pytest.mark.parametrize(
    ("url", "tls", "says"),
    [
        ("etcd://h:2379/ps", CoordinatorTls("ca.pem"), "write etcds:// to talk TLS"),
        ("etcds://h:2379/ps", CoordinatorTls(None, "c.pem"), "needs both the certif"),
        ("etcds://h:2379/ps", CoordinatorTls("nope.pem"), "'nope.pem' does not exist"),
        ("http://h:2379/ps", None, "expected etcd://HOST:PORT[,HOST:PORT]/PREFIX"),
        ("etcds://h:2379", None, "(the PREFIX is missing)"),
    ],
)
def test_a_wrong_coordinator_address_says_what_is_expected(
    url: str, tls: CoordinatorTls | None, says: str
) -> None:
    with pytest.raises(ValueError) as err:
        parse_coordinator(url, tls)
    assert says in str(err.value)


def test_serve_refuses_etcd_tls_files_with_a_plaintext_address(
    tmp_path: Path,
) -> None:
    (tmp_path / "ca.pem").write_text("x")
    config = ServerConfig(
        address="127.0.0.1:0",
        durability="wal",
        data_dir=str(tmp_path / "d"),
        coordinator="etcd://127.0.0.1:1/ps",
        shard="0/1",
        coordinator_ca=str(tmp_path / "ca.pem"),
    )
    said = (
        "--coordinator: etcd TLS files were given for the plaintext address "
        "'etcd://127.0.0.1:1/ps': write etcds:// to talk TLS to etcd"
    )
    with pytest.raises(ConfigError) as err:
        create_server(config)
    assert str(err.value) == said
    # onnxps serve: exit 2, saying it (the file named in the environment here)
    done = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--address", "127.0.0.1:0",
         "--durability", "wal", "--data-dir", str(tmp_path / "d2"),
         "--coordinator", "etcd://127.0.0.1:1/ps", "--shard", "0/1"],
        capture_output=True, text=True, timeout=60,
        env=clean_env(ONNXPS_COORDINATOR_CA=str(tmp_path / "ca.pem")),
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"onnxps: {said}"


def test_etcd_tls_files_for_an_address_that_is_no_etcd_are_refused(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError) as err:
        Client("127.0.0.1:1", coordinator_ca=str(tmp_path / "ca.pem"))
    assert str(err.value) == (
        "coordinator_ca, coordinator_cert and coordinator_key are the files of an "
        "etcds:// address, not of '127.0.0.1:1'"
    )


def test_status_says_when_etcd_does_not_answer() -> None:
    from _etcd import free_port

    url = f"etcd://127.0.0.1:{free_port()}/ps"  # nothing listens there
    done = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "status", url, "--timeout", "2"],
        capture_output=True, text=True, env=clean_env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"onnxps status: {url}: etcd at {url} did not answer: [Errno 111] "
        "Connection refused"
    )


# -- a real etcd serving TLS only -------------------------------------------------
@pytest.fixture
def tls_etcd(tmp_path: Path, pki: Pki) -> Iterator[EtcdProcess]:  # noqa: F811
    """etcd on https only, asking its clients for a certificate of the test CA."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd is not installed: apt-get install -y etcd-server")
    etcd = start_etcd(
        binary,
        tmp_path,
        tls=(pki.cert, pki.key, pki.ca),
        client_tls=(pki.ca, pki.cert, pki.key),
    )
    try:
        yield etcd
    finally:
        etcd.stop()


def _tls_flags(pki: Pki) -> tuple[str, ...]:  # noqa: F811
    return (
        "--coordinator-ca", str(pki.ca), "--coordinator-cert", str(pki.cert),
        "--coordinator-key", str(pki.key),
    )  # fmt: skip


@pytest.mark.slow
def test_a_replica_set_on_a_tls_etcd_elects_replicates_and_fails_over(
    tmp_path: Path,
    tls_etcd: EtcdProcess,
    pki: Pki,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rs = ReplicaSet(tmp_path, tls_etcd, 2, extra=_tls_flags(pki))
    try:
        assert rs.url.startswith("etcds://")
        p = rs.primary()
        assert rs.wait_sync() == [f"m{1 - p}"]
        # clients read etcd over TLS with the same files: given to Client, named
        # in the environment for AsyncClient, as flags to onnxps status
        files = {"coordinator_ca": str(pki.ca), "coordinator_cert": str(pki.cert),
                 "coordinator_key": str(pki.key)}  # fmt: skip
        with Client(
            rs.url,
            timeout=60,
            coordinator_ca=files["coordinator_ca"],
            coordinator_cert=files["coordinator_cert"],
            coordinator_key=files["coordinator_key"],
        ) as c:
            c.create_group("g", Adagrad(), learning_rate=0.1,
                           tensors={"x": np.zeros(SIZE, np.float32)})  # fmt: skip
            assert [c.push("g", G) for _ in range(3)] == [1, 2, 3]
            rs.procs[p].kill()
            rs.procs[p].wait()
            assert rs.primary(not_=p) == 1 - p
            rs.start(p)  # a standby again, so that pushes are acknowledged
            assert c.push("g", G) == 4  # followed the failover, read over TLS

        async def async_push() -> int:
            async with AsyncClient(rs.url, timeout=60) as ac:
                return int(await ac.push("g", G))

        for name, value in files.items():
            monkeypatch.setenv(f"ONNXPS_{name.upper()}", value)
        assert asyncio.run(async_push()) == 5
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in files.items()]
        status = subprocess.run(
            [sys.executable, "-m", "onnxps.cli", "status", rs.url, "--timeout", "20",
             *flags],
            capture_output=True, text=True, env=clean_env(), timeout=120,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert f"m{1 - p}" in status.stdout and "primary" in status.stdout
    finally:
        rs.close()


@pytest.mark.slow
def test_a_wrong_etcd_ca_or_a_plaintext_address_is_refused_saying_why(
    tmp_path: Path,
    tls_etcd: EtcdProcess,
    pki: Pki,  # noqa: F811 - the fixture
) -> None:
    plain = tls_etcd.url("ps").replace("etcds://", "etcd://")
    rogue = ("--coordinator-ca", str(pki.rogue_cert))  # not the CA etcd's cert has
    runs = {
        "wrong CA": (tls_etcd.url("ps"), (*rogue, *_tls_flags(pki)[2:])),
        "plaintext": (plain, ()),
    }
    procs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "onnxps.cli",
                "serve",
                "--address",
                "127.0.0.1:0",
                "--durability",
                "wal",
                "--data-dir",
                str(tmp_path / name),
                "--coordinator",
                url,
                "--shard",
                "0/1",
                *flags,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )  # fmt: skip
        for name, (url, flags) in runs.items()
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, (name, err)
        last = err.strip().splitlines()[-1]
        url = runs[name][0]
        assert last.startswith(f"onnxps: cannot reach etcd at {url} (waited 15 s)")
        if name == "wrong CA":
            assert "CERTIFICATE_VERIFY_FAILED" in last, last
    # a client without the etcd CA is refused at once, naming etcd
    with pytest.raises(ConnectionError) as refused:
        Client(tls_etcd.url("ps"), timeout=10)
    said = str(refused.value)
    assert f"etcd at {tls_etcd.url('ps')} did not answer: TLS: [SSL: CERT" in said
