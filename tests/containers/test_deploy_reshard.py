"""overlays/replicated-grown (docs/resharding.md, "On Kubernetes"): the replicated
cluster grown from 3 to 4 shards, with the Job that runs ``onnxps reshard``. Built
with ``kubectl kustomize``; every resource validated, and what the pods would run
resolved from their environment."""

from __future__ import annotations

import kubernetes_validate
import pytest
from _manifests import KUBECTL, KUBERNETES, Pod, find, kustomize, one

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH")

GROWN = KUBERNETES / "overlays" / "replicated-grown"
SHARD = "onnxps.io/shard"


def test_the_grown_overlay_builds_and_validates() -> None:
    docs = kustomize(GROWN)
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    assert all(
        d["metadata"]["namespace"] == "onnxps" for d in docs if d["kind"] != "Namespace"
    )
    shards = sorted(
        (
            d
            for d in find(docs, "StatefulSet")
            if SHARD in d["spec"]["template"]["metadata"]["labels"]
        ),
        key=lambda d: int(d["metadata"]["labels"][SHARD]),
    )
    assert [s["metadata"]["name"] for s in shards] == [
        f"onnxps-shard-{i}" for i in range(4)
    ]
    assert len(find(docs, "PodDisruptionBudget")) == 4 + 1  # and etcd's
    for i, sts in enumerate(shards):
        env = Pod(docs, sts, 0).env()
        assert env["ONNXPS_SHARD"] == f"{i}/4", env
        # every replica, shard 3's too, has the etcd client certificate
        assert env["ONNXPS_COORDINATOR_CERT"] == "/etc/etcd/client/tls.crt"
        assert sts["metadata"]["labels"]["app.kubernetes.io/name"] == "onnxps"


def test_the_reshard_job_runs_onnxps_reshard_to_the_configmaps_count() -> None:
    docs = kustomize(GROWN)
    job = one(docs, "Job", "onnxps-reshard")
    pod = Pod(docs, job, 0)
    env = pod.env()
    command = pod.command(env, {"onnxps": ["onnxps"]})
    coordinator = "etcds://etcd-0.etcd:2379,etcd-1.etcd:2379,etcd-2.etcd:2379/onnxps"
    assert command == [
        "onnxps", "reshard", coordinator, "--shards", "4", "--timeout", "30",
    ]  # fmt: skip
    assert env["ONNXPS_COORDINATOR_CA"] == "/etc/etcd/client/ca.crt"
    assert pod.mount_of("etcd-client-tls") == "/etc/etcd/client"
    assert pod.mount_of("onnxps-tls") == "/etc/onnxps/tls"
    # its token is one of role admin for every group (prefix *) in the servers'
    # tokens file: a resharding's RPCs are refused to a prefix-confined admin
    tokens = Pod(docs, job, 0)._secret("onnxps-tokens", "tokens")
    grants = {line.split()[0]: line.split()[1:] for line in tokens.splitlines()}
    assert grants[env["ONNXPS_TOKEN"]] == ["admin", "*"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    # the replicas' NetworkPolicy admits it (it dials every shard's primary)
    labels = job["spec"]["template"]["metadata"]["labels"]
    policy = one(docs, "NetworkPolicy", "onnxps-replicas")
    admitted = [
        f["podSelector"]["matchLabels"] for f in policy["spec"]["ingress"][0]["from"]
    ]
    assert any(a.items() <= labels.items() for a in admitted)
