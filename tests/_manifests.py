"""Kubernetes manifests as local processes: what a pod's container would run.

``kubectl kustomize`` renders an overlay; ``Pod`` resolves one pod of a StatefulSet
as the kubelet would (its env: values, ``$(VAR)`` references to earlier variables,
the downward API's name and labels, ConfigMap and Secret keys; Secret volumes as
files) and rewrites what a pod network would give it for local ones: a pod DNS
name and port (``etcd-1.etcd:2379``) or a wildcard bind (``0.0.0.0:2379``) becomes
``127.0.0.1`` and a free port, a mount path a directory of the test.
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
_VAR = re.compile(r"\$\((\w+)\)")
_LABEL = re.compile(r"metadata\.labels\['(.+)'\]")

Doc = dict[str, Any]


def kustomize(path: Path) -> list[Doc]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [
        d
        for d in docs
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = find(docs, kind, name)
    return doc


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)``: a variable defined earlier, else left as written."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass
class Network:
    """Local stand-ins for pod addresses: (pod, container port) -> a local port."""

    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    services: dict[str, str] = field(default_factory=dict)  # pod -> its service

    def add(self, pod: str, service: str, port: int, local: int) -> None:
        self.ports[(pod, port)] = local
        self.services[pod] = service

    def local(self, text: str, pod: str | None = None) -> str:
        """``pod.service:port`` (and ``0.0.0.0:port`` of ``pod``) as 127.0.0.1."""
        for (name, port), local in self.ports.items():
            dns = f"{name}.{self.services[name]}:{port}"
            text = text.replace(dns, f"127.0.0.1:{local}")
            if name == pod:
                text = text.replace(f"0.0.0.0:{port}", f"127.0.0.1:{local}")
        return text


@dataclass
class Pod:
    """Pod ``ordinal`` of StatefulSet ``sts`` in the rendered ``docs``."""

    docs: list[Doc]
    sts: Doc
    ordinal: int

    @property
    def name(self) -> str:
        return f"{self.sts['metadata']['name']}-{self.ordinal}"

    @property
    def container(self) -> Doc:
        (c,) = self.sts["spec"]["template"]["spec"]["containers"]
        container: Doc = c
        return container

    @property
    def labels(self) -> dict[str, str]:
        labels: dict[str, str] = self.sts["spec"]["template"]["metadata"]["labels"]
        return labels

    def _secret(self, name: str, key: str) -> str:
        data = one(self.docs, "Secret", name)["data"]
        return base64.b64decode(data[key]).decode()

    def _value(self, source: Doc) -> str:
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path == "metadata.name":
                return self.name
            m = _LABEL.fullmatch(path)
            assert m, f"unexpected fieldRef {path}"
            return self.labels[m.group(1)]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return str(one(self.docs, "ConfigMap", ref["name"])["data"][ref["key"]])
        ref = source["secretKeyRef"]
        return self._secret(ref["name"], ref["key"])

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for e in self.container.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
            else:
                env[e["name"]] = self._value(e["valueFrom"])
        return env

    def mount_of(self, secret: str) -> str:
        """Where the container mounts Secret ``secret``."""
        volumes = self.sts["spec"]["template"]["spec"].get("volumes", [])
        (name,) = [v["name"] for v in volumes
                   if v.get("secret", {}).get("secretName") == secret]  # fmt: skip
        (path,) = [m["mountPath"] for m in self.container.get("volumeMounts", [])
                   if m["name"] == name]  # fmt: skip
        return str(path)

    def mounts(self, tmp: Path) -> dict[str, str]:
        """Mount path -> a local directory: a Secret's items written as files, a
        volume claim an empty directory (the pod's own volume)."""
        volumes = {v["name"]: v for v in self.sts["spec"]["template"]["spec"].get(
            "volumes", []
        )}  # fmt: skip
        out = {}
        for m in self.container.get("volumeMounts", []):
            local = tmp / self.name / m["name"]
            local.mkdir(parents=True, exist_ok=True)
            secret = volumes.get(m["name"], {}).get("secret")
            if secret is not None:
                for item in secret["items"]:
                    (local / item["path"]).write_text(
                        self._secret(secret["secretName"], item["key"])
                    )
            out[m["mountPath"]] = str(local)
        return out

    def command(self, env: dict[str, str], program: dict[str, list[str]]) -> list[str]:
        """The container's command and args, ``$(VAR)`` expanded, its program
        (``onnxps``, ``etcd``) replaced by ``program``'s local one."""
        cmd = [
            expand(a, env)
            for a in self.container["command"] + self.container.get("args", [])
        ]
        return program[cmd[0]] + cmd[1:]


def local_programs(etcd: str | None) -> dict[str, list[str]]:
    programs = {
        "onnxps": [sys.executable, "-m", "onnxps.cli"],
        "python": [sys.executable],
    }
    if etcd is not None:
        programs["etcd"] = [etcd]
    return programs


def localize(value: str, mounts: dict[str, str], net: Network, pod: str) -> str:
    """An env value or argument of ``pod`` with local paths and addresses."""
    for path, local in mounts.items():
        # a value that is the path, or an argument --flag=path, or below it
        if value == path or value.startswith(path + "/"):
            value = local + value[len(path) :]
        value = value.replace(f"={path}/", f"={local}/")
        if value.endswith(f"={path}"):
            value = value[: -len(path)] + local
    return net.local(value, pod)
