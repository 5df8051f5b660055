"""deploy/kubernetes, replicated (issue 23): rendered, checked, and run locally.

``kubectl kustomize`` builds overlays/replicated (with the etcd of
components/etcd) and overlays/replicated-external-etcd (an existing etcd);
``kubernetes-validate`` checks every resource. Then what Kubernetes would run is
run as local processes (tests/_manifests.py resolves each pod's env as the kubelet
would): the etcd StatefulSet's 3 members, shard 0's 3 replicas (and one replica of
each other shard, so clients find every shard's primary), a push through
``Client("etcd://...")`` with the ConfigMap's coordinator, the primary killed,
and the next push landing on the replica that took over.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import numpy as np
import pytest
from _etcd import INSTALL_HINT, EtcdProcess, etcd_binary, free_port
from _manifests import (
    KUBECTL,
    KUBERNETES,
    Doc,
    Network,
    Pod,
    find,
    kustomize,
    local_programs,
    localize,
    one,
)
from _pki import _pki
from _procs import clean_env, start_server, stop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.cli.process import wait_for_listening
from onnxps.client import (
    Adagrad,
    Client,
    DeadlineExceededError,
    UnavailableError,
)
from onnxps.client._cluster import parse_target, placement
from onnxps.server._health import READY
from onnxps.server.app import ServerConfig
from onnxps.server.interceptors.security import ConfigError
from onnxps.wire.coordinator import CoordinatorAddress, CoordinatorTls, gateway_clients

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH")

WITH_ETCD = KUBERNETES / "overlays" / "replicated"
EXTERNAL = KUBERNETES / "overlays" / "replicated-external-etcd"
HEALTH = re.compile(r"onnxps health \(plaintext\) on (\S+)")
SHARD = "onnxps.io/shard"


def _shards(docs: list[Doc]) -> list[Doc]:
    """The shards' StatefulSets, in shard order."""
    found = [
        d
        for d in find(docs, "StatefulSet")
        if d["spec"]["template"]["metadata"]["labels"].get(
            "app.kubernetes.io/component"
        )
        == "shard"
    ]
    return sorted(found, key=lambda d: int(d["metadata"]["labels"][SHARD]))


def _admitted(policy: Doc) -> list[dict[str, str]]:
    """The pod labels a NetworkPolicy's first ingress rule admits."""
    return [
        f["podSelector"]["matchLabels"] for f in policy["spec"]["ingress"][0]["from"]
    ]


def _config(docs: list[Doc]) -> dict[str, str]:
    (cm,) = find(docs, "ConfigMap")
    assert cm["metadata"]["name"].startswith("onnxps-replication")
    data: dict[str, str] = cm["data"]
    return data


@pytest.mark.parametrize("path", [WITH_ETCD, EXTERNAL], ids=["etcd", "external"])
def test_overlays_build_and_every_resource_validates(path: Path) -> None:
    docs = kustomize(path)
    kinds = sorted(d["kind"] for d in docs)
    n, etcd = 3, path == WITH_ETCD
    want = ["ConfigMap", "Job", "Namespace", "NetworkPolicy", "Secret", "Service"]
    want += ["StatefulSet"] * n + ["PodDisruptionBudget"] * n
    if etcd:
        want += ["StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    assert kinds == sorted(want)
    assert all(
        d["metadata"]["namespace"] == "onnxps" for d in docs if d["kind"] != "Namespace"
    )
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("path", [WITH_ETCD, EXTERNAL], ids=["etcd", "external"])
def test_every_shard_runs_r_replicas_apart_with_its_own_pdb(path: Path) -> None:
    docs = kustomize(path)
    config = _config(docs)
    shards = _shards(docs)
    n, k = int(config["shards"]), int(config["sync-replicas"])
    assert (n, k) == (3, 1)
    assert [s["metadata"]["name"] for s in shards] == [
        f"onnxps-shard-{i}" for i in range(n)
    ]
    headless = one(docs, "Service", "onnxps-headless")
    assert headless["spec"]["clusterIP"] == "None"
    pdbs = find(docs, "PodDisruptionBudget")
    for i, sts in enumerate(shards):
        r = sts["spec"]["replicas"]
        assert r == 3
        selector = sts["spec"]["selector"]["matchLabels"]
        assert selector[SHARD] == str(i)
        pod = sts["spec"]["template"]["spec"]
        (term,) = pod["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"] == selector
        # one PDB selects this shard's replicas, and no other shard's
        (pdb,) = [p for p in pdbs if p["spec"]["selector"]["matchLabels"] == selector]
        assert pdb["metadata"]["name"] == sts["metadata"]["name"]
        # what a drain may take still leaves a primary and K standbys
        assert r - pdb["spec"]["maxUnavailable"] >= 1 + k
        assert headless["spec"]["selector"].items() <= selector.items()
        assert sts["spec"]["serviceName"] == "onnxps-headless"
        claim = sts["spec"]["volumeClaimTemplates"][0]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        (c,) = pod["containers"]
        assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in c[
            "volumeMounts"
        ]
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": 8081}
        assert c["readinessProbe"]["grpc"] == {"port": 8081, "service": READY}
        # pods 0..R-1 of this shard, as the kubelet would give them their env
        for ordinal in range(r):
            p = Pod(docs, sts, ordinal)
            env = p.env()
            assert env["ONNXPS_SHARD"] == f"{i}/{n}"
            assert env["ONNXPS_COORDINATOR"] == config["coordinator"]
            assert env["ONNXPS_SYNC_REPLICAS"] == str(k)
            assert env["ONNXPS_DURABILITY"] == "wal"
            assert env["ONNXPS_DATA_DIR"] == "/data"
            assert env["ONNXPS_MEMBER_ID"] == f"onnxps-shard-{i}-{ordinal}"
            assert env["ONNXPS_ADVERTISE_ADDRESS"] == (
                f"onnxps-shard-{i}-{ordinal}.onnxps-headless:50051"
            )
            assert env["ONNXPS_ADDRESS"] == "0.0.0.0:50051"
            assert env["ONNXPS_REPLICATION_TOKEN"] == "example-replication-token"
            # TLS only; a standby checks its primary against the cluster's CA
            assert "ONNXPS_INSECURE" not in env
            assert env["ONNXPS_TLS_CERT"] == "/etc/onnxps/tls/tls.crt"
            assert env["ONNXPS_TLS_CA"] == "/etc/onnxps/tls/ca.crt"
    # the workers find the primaries through the same coordinator
    (job,) = find(docs, "Job")
    (worker,) = job["spec"]["template"]["spec"]["containers"]
    (address,) = [e for e in worker["env"] if e["name"] == "ONNXPS_ADDRESS"]
    (ca,) = [e for e in worker["env"] if e["name"] == "ONNXPS_TLS_CA"]
    assert ca["value"] == "/etc/onnxps/tls/ca.crt"
    ca_mount = {"name": "ca", "mountPath": "/etc/onnxps/tls", "readOnly": True}
    assert ca_mount in worker["volumeMounts"]
    assert address["valueFrom"]["configMapKeyRef"] == {
        "name": find(docs, "ConfigMap")[0]["metadata"]["name"],
        "key": "coordinator",
    }


def _demo(docs: list[Doc]) -> Pod:
    """The demo Job's pod (a worker)."""
    (job,) = find(docs, "Job")
    return Pod(docs, job, 0)


def test_the_replicated_overlay_deploys_an_etcd_of_three_members() -> None:
    docs = kustomize(WITH_ETCD)
    etcd = one(docs, "StatefulSet", "etcd")
    members = etcd["spec"]["replicas"]
    assert members == 3
    service = etcd["spec"]["serviceName"]
    assert one(docs, "Service", service)["spec"]["publishNotReadyAddresses"] is True
    (c,) = etcd["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "gcr.io/etcd-development/etcd:v3.5.17"
    cluster = next(a for a in c["args"] if a.startswith("--initial-cluster="))
    assert cluster.split("=", 1)[1].split(",") == [
        f"etcd-{i}=https://etcd-{i}.{service}:2380" for i in range(members)
    ]
    # TLS only, clients and peers showing a certificate of the etcd-tls CA
    assert {
        "--listen-client-urls=https://0.0.0.0:2379",
        "--client-cert-auth",
        "--trusted-ca-file=/etc/etcd/tls/ca.crt",
        "--listen-peer-urls=https://0.0.0.0:2380",
        "--peer-client-cert-auth",
        "--peer-trusted-ca-file=/etc/etcd/tls/ca.crt",
    } <= set(c["args"])
    assert not [a for a in c["args"] if "http://" in a and "metrics" not in a]
    # the replicas and the demo workers check etcd and present etcd-client-tls
    for pod in [Pod(docs, sts, 0) for sts in _shards(docs)] + [_demo(docs)]:
        env = {e["name"]: e.get("value") for e in pod.container["env"]}
        mount = pod.mount_of("etcd-client-tls")
        assert (env["ONNXPS_COORDINATOR_CA"], env["ONNXPS_COORDINATOR_CERT"],
                env["ONNXPS_COORDINATOR_KEY"]) == tuple(
            f"{mount}/{f}" for f in ("ca.crt", "tls.crt", "tls.key"))  # fmt: skip
    # the shards' coordinator lists every member's client address, over TLS
    endpoints = _config(docs)["coordinator"].removeprefix("etcds://")
    assert (
        endpoints
        == ",".join(f"etcd-{i}.{service}:2379" for i in range(members)) + "/onnxps"
    )
    (term,) = etcd["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert (
        term["labelSelector"]["matchLabels"] == etcd["spec"]["selector"]["matchLabels"]
    )
    assert one(docs, "PodDisruptionBudget", "etcd")["spec"]["maxUnavailable"] == 1
    # etcd admits the replicas and the workers on its client port
    policy = one(docs, "NetworkPolicy", "etcd")
    client_from = _admitted(policy)
    assert {"onnxps.io/worker": "true"} in client_from
    assert {
        "app.kubernetes.io/component": "shard",
        "app.kubernetes.io/part-of": "onnxps",
    } in client_from
    # and the replicas admit each other (a standby follows its primary)
    replicas = one(docs, "NetworkPolicy", "onnxps-replicas")
    grpc_from = _admitted(replicas)
    assert _shards(docs)[0]["spec"]["template"]["metadata"]["labels"].items() >= (
        grpc_from[1].items()
    )


def test_the_external_overlay_names_an_existing_etcd_and_deploys_none() -> None:
    docs = kustomize(EXTERNAL)
    assert not [d for d in docs if "etcd" in d["metadata"]["name"]]
    coordinator = _config(docs)["coordinator"]
    assert coordinator == (
        "etcd://etcd-client.etcd.svc.cluster.local:2379/onnxps-training"
    )
    for sts in _shards(docs):
        assert Pod(docs, sts, 0).env()["ONNXPS_COORDINATOR"] == coordinator


# -- the manifests as local processes ----------------------------------------------
def _etcd_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def _serving(address: str, service: str = "") -> bool:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _probe_service(sts: Doc, probe: str) -> str:
    """The gRPC health service a container's probe asks ("" when it names none)."""
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return str(c[probe]["grpc"].get("service", ""))


def _wait_serving(address: str, service: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not _serving(address, service):
        assert time.monotonic() < deadline, f"{address}: {service!r} not SERVING"
        time.sleep(0.1)


class Cluster:
    """The rendered overlay's pods, started as local processes."""

    def __init__(self, docs: list[Doc], tmp: Path, etcd: str) -> None:
        self.docs, self.tmp = docs, tmp
        self.net = Network()
        self.programs = local_programs(etcd)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.health: dict[str, str] = {}
        for sts in find(docs, "StatefulSet"):
            service = sts["spec"]["serviceName"]
            (c,) = sts["spec"]["template"]["spec"]["containers"]
            for ordinal in range(sts["spec"]["replicas"]):
                for port in c["ports"]:
                    pod = f"{sts['metadata']['name']}-{ordinal}"
                    self.net.add(pod, service, port["containerPort"], free_port())

    def start(self, sts: Doc, ordinal: int) -> Pod:
        pod = Pod(self.docs, sts, ordinal)
        mounts = pod.mounts(self.tmp)
        env = pod.env()
        if env.get("ONNXPS_ADDRESS") == "0.0.0.0:50051":
            # the pod listens on every interface: here on loopback, by a name other
            # than the address it advertises, so etcd shows which one it wrote
            port = self.net.ports[(pod.name, 50051)]
            env["ONNXPS_ADDRESS"] = f"localhost:{port}"
        env = {k: localize(v, mounts, self.net, pod.name) for k, v in env.items()}
        if "ONNXPS_HEALTH_PORT" in env:
            env["ONNXPS_HEALTH_PORT"] = "0"  # the kubelet's probe: read from the log
        if env.get("ONNXPS_DATA_PORT", "").isdigit():
            # the pod's fixed data port, here one free port per pod (as gRPC's)
            data = self.net.ports[(pod.name, int(env["ONNXPS_DATA_PORT"]))]
            env["ONNXPS_DATA_PORT"] = str(data)
        cmd = [localize(a, mounts, self.net, pod.name) for a in pod.command(
            env, self.programs
        )]  # fmt: skip
        log = self.tmp / f"{pod.name}.log"
        with open(log, "wb") as out:
            self.procs[pod.name] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=clean_env(**env)
            )
        return pod

    def wait_onnxps(self, pod: Pod) -> str:
        log = self.tmp / f"{pod.name}.log"
        address = wait_for_listening(self.procs[pod.name], log, timeout=60)
        health = HEALTH.search(log.read_text())
        assert health is not None
        self.health[pod.name] = health.group(1)
        return address

    def close(self) -> None:
        for proc in self.procs.values():
            stop(proc)


def _etcd_get(port: int, key: str, tls: CoordinatorTls | None = None) -> Any:
    """``key``'s value in the etcd on ``port`` (over TLS with ``tls``)."""
    address = CoordinatorAddress((("127.0.0.1", port),), "/", tls)
    got = gateway_clients(address, 5)[0].get(key)
    return json.loads(got[0]) if got else None


def _wait_key(port: int, key: str, timeout: float = 30.0) -> Any:
    """The value of ``key`` once it is there (the election runs after listening)."""
    deadline = time.monotonic() + timeout
    while (value := _etcd_get(port, key)) is None:
        assert time.monotonic() < deadline, f"no {key} in etcd within {timeout} s"
        time.sleep(0.05)
    return value


@pytest.mark.slow
def test_one_shards_replicas_run_as_local_processes_and_fail_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = etcd_binary()
    if binary is None:
        pytest.skip(INSTALL_HINT)
    docs = kustomize(WITH_ETCD)
    docs.extend(_tls_secrets(tmp_path / "pki"))  # what the operator creates
    pki = tmp_path / "pki"
    etcd_tls = {
        "ONNXPS_COORDINATOR_CA": str(pki / "ca.crt"),
        "ONNXPS_COORDINATOR_CERT": str(pki / "tls.crt"),
        "ONNXPS_COORDINATOR_KEY": str(pki / "tls.key"),
    }
    for name, value in etcd_tls.items():  # this test's clients: a worker's files
        monkeypatch.setenv(name, value)
    cluster = Cluster(docs, tmp_path, binary)
    try:
        _run_and_fail_over(cluster, docs)
    finally:
        cluster.close()


def _tls_secrets(pki: Path) -> list[Doc]:
    """The Secrets of tls.crt, tls.key and ca.crt the overlay expects (onnxps-tls,
    etcd-tls, etcd-client-tls), of one test CA; the certificate names 127.0.0.1,
    where the pods' DNS names lead here."""
    pki.mkdir()
    _pki(pki)
    data = {
        name: base64.b64encode((pki / name).read_bytes()).decode()
        for name in ("tls.crt", "tls.key", "ca.crt")
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {"name": name},
            "data": data,
        }
        for name in ("onnxps-tls", "etcd-tls", "etcd-client-tls")
    ]


def _run_and_fail_over(cluster: Cluster, docs: list[Doc]) -> None:
    etcd = one(docs, "StatefulSet", "etcd")
    members = [cluster.start(etcd, i) for i in range(etcd["spec"]["replicas"])]
    metrics = [cluster.net.ports[(m.name, 2381)] for m in members]
    deadline = time.monotonic() + 60
    while not all(_etcd_healthy(p) for p in metrics):  # the readiness probe
        assert time.monotonic() < deadline, "etcd members never formed a quorum"
        for m in members:
            assert cluster.procs[m.name].poll() is None, (
                cluster.tmp / f"{m.name}.log"
            ).read_text()[-3000:]
        time.sleep(0.1)
    client_port = cluster.net.ports[(members[0].name, 2379)]
    etcd_tls = CoordinatorTls.from_env()  # the test's: a worker's files

    config = _config(docs)
    coordinator = cluster.net.local(config["coordinator"])
    assert coordinator.count("127.0.0.1:") == 3  # every member, as the pods list
    shards = _shards(docs)
    n = len(shards)
    group = next(f"digits-{i}" for i in range(100) if placement(f"digits-{i}", n) == 0)
    # shard 0: all its replicas; the other shards one replica each (a primary for
    # the client to find; the group lives on shard 0)
    pods = [cluster.start(shards[0], j) for j in range(shards[0]["spec"]["replicas"])]
    others = [cluster.start(sts, 0) for sts in shards[1:]]
    addresses = {p.name: cluster.wait_onnxps(p) for p in pods + others}
    # the kubelet's probes: liveness on the server's own status; readiness on
    # "onnxps.ready", which a standby reaches once it holds the primary's log
    assert _probe_service(shards[0], "livenessProbe") == ""
    ready = _probe_service(shards[0], "readinessProbe")
    assert ready == READY
    for p in pods:
        assert _serving(cluster.health[p.name]), p.name
        _wait_serving(cluster.health[p.name], ready)
        assert addresses[p.name].startswith("localhost:")  # what it listens on

    token = Pod(docs, shards[0], 0)._secret("onnxps-tokens", "worker-token")
    ca_path = cluster.tmp / "pki" / "ca.crt"
    ca = ca_path.read_bytes()
    primary_key = "/onnxps/shards/0/primary"
    # the pods serve TLS only: a plaintext client is not answered
    with pytest.raises((UnavailableError, DeadlineExceededError)):
        with Client(coordinator, timeout=3, token=token) as plain:
            plain.list_groups()
    with Client(coordinator, timeout=60, token=token, root_certificates=ca) as ps:
        ps.create_group(
            group, Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(8, np.float32)}
        )
        assert ps.push(group, np.ones(8, np.float32)) == 1
        first = _etcd_get(client_port, primary_key, etcd_tls)
        assert first["member"] in addresses
        # what it advertised (its pod DNS name), not what it listens on
        advertised = cluster.net.local(f"{first['member']}.onnxps-headless:50051")
        assert first["address"] == advertised.replace("localhost", "127.0.0.1")
        assert first["address"] != addresses[first["member"]]
        sync = _etcd_get(client_port, "/onnxps/shards/0/sync", etcd_tls)
        assert len(sync["standbys"]) == int(config["sync-replicas"])

        cluster.procs[first["member"]].kill()  # the node is gone
        assert ps.push(group, np.ones(8, np.float32)) == 2  # lands on the new one
        second = _etcd_get(client_port, primary_key, etcd_tls)
        assert second["member"] != first["member"]
        assert second["member"] in sync["standbys"]
        assert second["term"] > first["term"]
        # (acknowledged with a synchronous standby: it followed over TLS, the
        # only way the pods serve)
        with Client(
            second["address"], timeout=30, token=token, root_certificates=ca
        ) as direct:
            assert direct.describe_group(group).update_count == 2

    status = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "status", coordinator, "--token", token]
        + ["--tls-ca", str(ca_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(
            ONNXPS_COORDINATOR_CA=str(etcd_tls.ca),
            ONNXPS_COORDINATOR_CERT=str(etcd_tls.cert),
            ONNXPS_COORDINATOR_KEY=str(etcd_tls.key),
        ),
    )
    assert status.returncode == 0, status.stderr
    assert group in status.stdout
    row = next(
        line.split()
        for line in status.stdout.splitlines()
        if second["member"] in line.split()
    )
    assert "primary" in row


# -- --advertise-address: what a replica writes to etcd ------------------------------
def test_a_replica_writes_its_advertised_address_to_etcd_not_its_bind_address(
    tmp_path: Path,
    etcd_server: EtcdProcess,
) -> None:
    port = free_port()
    url = etcd_server.url("adv")
    proc, listening = start_server(
        tmp_path / "server.log",
        "--address", f"127.0.0.1:{port}",
        "--durability", "wal",
        "--data-dir", str(tmp_path / "data"),
        "--coordinator", url,
        "--shard", "0/1",
        "--sync-replicas", "0",
        "--member-id", "ps-0",
        env=clean_env(ONNXPS_ADVERTISE_ADDRESS=f"localhost:{port}"),
    )  # fmt: skip
    try:
        assert listening == f"127.0.0.1:{port}"
        primary = _wait_key(etcd_server.client_port, "/adv/shards/0/primary")
        assert (primary["member"], primary["address"]) == ("ps-0", f"localhost:{port}")
        member = _etcd_get(etcd_server.client_port, "/adv/shards/0/members/ps-0")
        assert member["address"] == f"localhost:{port}"
        with Client(url, timeout=30) as ps:  # dials the advertised address
            ps.create_group(
                "g", Adagrad(), learning_rate=0.1, tensors={"x": np.zeros(4)}
            )
            assert ps.push("g", np.ones(4)) == 1
    finally:
        stop(proc)


def test_a_wildcard_address_with_a_coordinator_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "serve", "--address", "0.0.0.0:0"]
        + ["--insecure", "--durability", "wal", "--data-dir", str(tmp_path)]
        + ["--coordinator", "etcd://127.0.0.1:1/ps", "--shard", "0/1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "onnxps: --address 0.0.0.0:0 is a wildcard: a replica set member writes "
        "where it is reached to etcd, and no client or standby can dial that; give "
        "--advertise-address HOST:PORT (e.g. the pod's DNS name)"
    )


@pytest.mark.parametrize(
    ("advertised", "coordinator", "message"),
    [
        ("ps-0:50051", None, "--advertise-address is what a replica set member "
         "writes to etcd: it needs --coordinator"),
        ("ps-0", "etcd://e:2379/ps", "--advertise-address must be HOST:PORT that "
         "another host can dial (e.g. onnxps-0.onnxps-headless:50051), got 'ps-0'"),
        ("0.0.0.0:50051", "etcd://e:2379/ps", "--advertise-address must be HOST:PORT "
         "that another host can dial (e.g. onnxps-0.onnxps-headless:50051), got "
         "'0.0.0.0:50051'"),
        ("ps-0:0", "etcd://e:2379/ps", "--advertise-address must be HOST:PORT that "
         "another host can dial (e.g. onnxps-0.onnxps-headless:50051), got 'ps-0:0'"),
    ],
)  # fmt: skip
def test_an_advertise_address_that_cannot_be_dialled_is_refused(
    tmp_path: Path, advertised: str, coordinator: str | None, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        ServerConfig(
            address="127.0.0.1:0",
            durability="wal",
            data_dir=str(tmp_path),
            coordinator=coordinator,
            shard="0/1",
            advertise_address=advertised,
        )
    assert str(err.value) == message


def test_an_ipv6_advertise_address_is_taken(tmp_path: Path) -> None:
    config = ServerConfig(
        address="127.0.0.1:0",
        durability="wal",
        data_dir=str(tmp_path),
        coordinator="etcd://e:2379/ps",
        shard="0/1",
        advertise_address="[fd00::5]:50051",
    )
    assert config.advertise_address == "[fd00::5]:50051"


def test_a_command_line_address_keeps_an_etcd_url_with_several_endpoints() -> None:
    # the demo worker, export and import read ONNXPS_ADDRESS / their address so
    url = "etcd://etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379/onnxps"
    assert parse_target(url) == url
    assert parse_target("a:1,b:2") == ["a:1", "b:2"]


@pytest.mark.slow
def test_a_primary_stopped_with_sigterm_hands_over_before_its_lease_ends(
    tmp_path: Path,
    etcd_server: EtcdProcess,
) -> None:
    """What an eviction (drain, rolling update) does to a primary: the kubelet sends
    SIGTERM; the primary gives its key up, so a standby takes over without waiting
    out the lease (30 s here; the takeover is awaited for half of it)."""
    url = etcd_server.url("term")
    procs = {}
    try:
        for name in ("m0", "m1"):
            procs[name], _ = start_server(
                tmp_path / f"{name}.log",
                "--durability", "wal",
                "--data-dir", str(tmp_path / name),
                "--coordinator", url,
                "--shard", "0/1",
                "--member-id", name,
                "--lease-ttl", "30",
                env=clean_env(),
            )  # fmt: skip
        port = etcd_server.client_port
        first = _wait_key(port, "/term/shards/0/primary")
        sync = _wait_key(port, "/term/shards/0/sync")
        deadline = time.monotonic() + 30
        while not sync["standbys"]:
            assert time.monotonic() < deadline, "no synchronous standby"
            time.sleep(0.05)
            sync = _etcd_get(port, "/term/shards/0/sync")
        procs[first["member"]].send_signal(signal.SIGTERM)
        assert procs[first["member"]].wait(timeout=30) == 0
        deadline = time.monotonic() + 15
        while True:
            now = _etcd_get(port, "/term/shards/0/primary")
            if now is not None and now["member"] != first["member"]:
                break
            assert time.monotonic() < deadline, "no takeover within half the lease"
            time.sleep(0.05)
        assert now["member"] == sync["standbys"][0]
        assert now["term"] == first["term"] + 1
    finally:
        for p in procs.values():
            stop(p)


@pytest.mark.parametrize("path", [WITH_ETCD, EXTERNAL], ids=["etcd", "external"])
def test_only_the_replicas_are_given_the_replication_token(path: Path) -> None:
    """docs/SECURITY.md, 'Who may follow a primary': the overlays give the replicas,
    and nothing else, a token of role replication (prefix *) from the
    onnxps-tokens Secret; the workers' token is another, of another role."""
    docs = kustomize(path)
    secret = one(docs, "Secret", "onnxps-tokens")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    grants = [
        line.split() for line in data["tokens"].splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]  # fmt: skip
    replication = [g for g in grants if g[1] == "replication"]
    assert replication == [[data["replication-token"], "replication", "*"]]
    for sts in _shards(docs):
        for ordinal in range(sts["spec"]["replicas"]):
            env = Pod(docs, sts, ordinal).env()
            assert env["ONNXPS_REPLICATION_TOKEN"] == data["replication-token"]
    (job,) = find(docs, "Job")
    (worker,) = job["spec"]["template"]["spec"]["containers"]
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in worker["env"] if "secretKeyRef" in e.get("valueFrom", {})
    }  # fmt: skip
    assert list(refs) == ["ONNXPS_TOKEN"]  # and no replication token
    assert refs["ONNXPS_TOKEN"]["name"] == "onnxps-tokens"
    token = data[refs["ONNXPS_TOKEN"]["key"]]
    assert token != data["replication-token"]
    (role,) = [g[1] for g in grants if g[0] == token]
    assert role != "replication"
