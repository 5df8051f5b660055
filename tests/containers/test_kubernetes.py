"""deploy/kubernetes: validated offline, and run as local processes.

``kubectl kustomize`` builds the base and the example overlay (skipped when kubectl
is not on PATH); ``kubernetes-validate`` checks every resource against the schemas
it ships. Then the StatefulSet's container command and environment run as 3 local
shard processes (with their pods' host names), and the demo Job's as 4 workers
against them, as tests/containers/test_compose.py does for compose. The only changes
are what a pod network and Secrets would provide: 0.0.0.0:50051 becomes 127.0.0.1
port 0, the health port 0, pod DNS names the shards' addresses, mounted Secrets files
made here (a test CA, a tokens file), /data a temporary directory.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from _pki import _pki
from _procs import clean_env, stop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnxps.cli.process import wait_for_listening

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes" / "base"
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "example"
KUBECTL = shutil.which("kubectl")
HEALTH = re.compile(r"onnxps health \(plaintext\) on (\S+)")
ACCURACY = re.compile(r"^worker (\d)/4 done: 300 steps, held-out accuracy (\d\.\d+)$")
TOKEN = "test-worker-token"


def _kustomize(path: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _base() -> list[dict[str, Any]]:
    """The base as kustomize builds it, or its files as they are without kubectl."""
    if KUBECTL is not None:
        return _kustomize(BASE)
    docs = []
    for name in yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]:
        docs += [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]
    return docs


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH")
@pytest.mark.parametrize("path", [BASE, OVERLAY], ids=["base", "overlay"])
def test_kustomize_builds_and_every_resource_validates(path: Path) -> None:
    docs = _kustomize(path)
    kinds = sorted(d["kind"] for d in docs)
    want = ["Job", "NetworkPolicy", "PodDisruptionBudget", "Service", "StatefulSet"]
    if path == OVERLAY:
        want += ["Namespace", "Secret"]
    assert kinds == sorted(want)
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    _check_shard_count_agrees(docs)


def test_the_validator_refuses_a_broken_resource() -> None:
    sts = _one(_base(), "StatefulSet")
    sts["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, kubernetes_validate.latest_version(), True)


def _check_shard_count_agrees(docs: list[dict[str, Any]]) -> None:
    sts = _one(docs, "StatefulSet")
    n = sts["spec"]["replicas"]
    assert _env(sts["spec"]["template"]["spec"]["containers"][0])["ONNXPS_SHARD"] == (
        f"auto/{n}"
    )
    service = sts["spec"]["serviceName"]
    job_env = _env(_one(docs, "Job")["spec"]["template"]["spec"]["containers"][0])
    assert job_env["ONNXPS_ADDRESS"].split(",") == [
        f"{sts['metadata']['name']}-{i}.{service}:50051" for i in range(n)
    ]


def test_manifests_declare_what_a_shard_needs() -> None:
    docs = _base()
    sts = _one(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = _env(c)
    assert sts["spec"]["replicas"] == 3
    assert env["ONNXPS_DURABILITY"] == "wal" and env["ONNXPS_DATA_DIR"] == "/data"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": int(env["ONNXPS_HEALTH_PORT"])}
    assert c["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    secrets = {v["secret"]["secretName"] for v in pod["volumes"]}
    assert secrets == {"onnxps-tls", "onnxps-tokens"}
    assert env["ONNXPS_TLS_CERT"].startswith("/etc/onnxps/tls/")
    service = _one(docs, "Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["name"] == sts["spec"]["serviceName"]
    assert _one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    policy = _one(docs, "NetworkPolicy")
    worker_label = policy["spec"]["ingress"][0]["from"][0]["podSelector"]
    job = _one(docs, "Job")
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert worker_label["matchLabels"].items() <= labels.items()
    assert policy["spec"]["ingress"][0]["ports"] == [
        {"port": 50051, "protocol": "TCP"},
        {"port": int(env["ONNXPS_DATA_PORT"]), "protocol": "TCP"},
    ]
    data = {"name": "data", "containerPort": int(env["ONNXPS_DATA_PORT"])}
    assert data in c["ports"]
    assert {"name": "data", "port": 50053, "targetPort": "data"} in service["spec"][
        "ports"
    ]
    _check_shard_count_agrees(docs)


def _local(cmd: list[str]) -> list[str]:
    if cmd[0] == "python":
        return [sys.executable, *cmd[1:]]
    assert cmd[0] == "onnxps", cmd
    return [sys.executable, "-m", "onnxps.cli", *cmd[1:]]


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.slow
def test_statefulset_and_demo_job_run_as_local_processes(tmp_path: Path) -> None:
    docs = _base()
    sts = _one(docs, "StatefulSet")
    (shard_c,) = sts["spec"]["template"]["spec"]["containers"]
    (worker_c,) = _one(docs, "Job")["spec"]["template"]["spec"]["containers"]
    tls = tmp_path / "tls"
    tls.mkdir()
    _pki(tls)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} admin digits-\n")
    mounts = {"/etc/onnxps/tls/": f"{tls}/", "/etc/onnxps/tokens/tokens": str(tokens)}
    n = sts["spec"]["replicas"]
    shards: list[subprocess.Popen[bytes]] = []
    workers: list[subprocess.Popen[str]] = []
    addresses = []
    try:
        for i in range(n):
            env = {k: str(v) for k, v in _env(shard_c).items()}
            env["ONNXPS_ADDRESS"] = env["ONNXPS_ADDRESS"].replace(
                "0.0.0.0:50051", "127.0.0.1:0"
            )
            env["ONNXPS_HEALTH_PORT"] = "0"
            env["ONNXPS_DATA_PORT"] = "0"
            env["ONNXPS_DATA_DIR"] = str(tmp_path / f"data-{i}")
            for k, v in env.items():
                for old, new in mounts.items():
                    env[k] = env[k].replace(old, new) if v.startswith(old) else env[k]
            env["HOSTNAME"] = f"{sts['metadata']['name']}-{i}"  # the pod's name
            log = tmp_path / f"shard-{i}.log"
            with open(log, "wb") as f:
                shards.append(
                    subprocess.Popen(
                        _local(shard_c["command"]),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=clean_env(**env),
                    )
                )
            addresses.append(wait_for_listening(shards[-1], log))
            text = log.read_text()
            assert f"this server is shard {i} of {n}" in text
            health = HEALTH.search(text)
            assert health is not None, text
            assert _serving(health.group(1))  # what the kubelet's probe asks

        job_env = _env(worker_c)
        pod_dns = job_env["ONNXPS_ADDRESS"].split(",")
        assert len(pod_dns) == n
        for index in range(4):
            env = {k: v for k, v in job_env.items() if isinstance(v, str)}
            env["ONNXPS_ADDRESS"] = ",".join(addresses)
            env["ONNXPS_WORKER_INDEX"] = str(index)  # the completion index
            env["ONNXPS_TOKEN"] = TOKEN  # from the onnxps-tokens Secret
            env["ONNXPS_TLS_CA"] = env["ONNXPS_TLS_CA"].replace(
                "/etc/onnxps/tls/", f"{tls}/"
            )
            assert set(job_env) == set(env)
            workers.append(
                subprocess.Popen(
                    _local(worker_c["command"]),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=clean_env(**env),
                )
            )
        for w in workers:
            out, err = w.communicate(timeout=180)
            assert w.returncode == 0, err
            m = ACCURACY.match(out.splitlines()[-1])
            assert m and float(m.group(2)) > 0.8, out

        status = subprocess.run(
            [sys.executable, "-m", "onnxps.cli", "status", ",".join(addresses)]
            + ["--token", TOKEN, "--tls-ca", str(tls / "ca.crt")],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
        assert status.returncode == 0, status.stderr
        row = status.stdout.splitlines()[1].split()
        assert row[:6] == ["digits-mlp", "adam", "float32", "4", "4810", "1200"]
    finally:
        for w in workers:
            stop(w)  # type: ignore[arg-type]
        for s in shards:
            stop(s)
