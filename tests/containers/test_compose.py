"""docker-compose.yml, run without Docker: each service's command as a local process.

(tests/containers/test_containers.py runs the file for real under podman.) This test
reads the compose file and runs the server, its health check and the workers with the
environment the file gives them; the only changes are the ones a container network
would make: the server's 0.0.0.0:50051
becomes 127.0.0.1 port 0, ``server:50051`` the address it got, /data a temporary
directory, and ``python``/``onnxps`` this interpreter.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _procs import clean_env, stop
from onnxps.cli.process import wait_for_listening

pytestmark = pytest.mark.slow  # docker-compose services run as local processes

ROOT = Path(__file__).resolve().parents[2]
ACCURACY = re.compile(r"^worker (\d)/4 done: 300 steps, held-out accuracy (\d\.\d+)$")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    compose: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return compose


def _local(cmd: list[str], replace: dict[str, str]) -> list[str]:
    """A container command as a local one (``python`` and ``onnxps`` are ours)."""
    out = []
    for arg in cmd:
        for old, new in replace.items():
            arg = arg.replace(old, new)
        out.append(arg)
    if out[0] == "python":
        return [sys.executable, *out[1:]]
    if out[0] == "onnxps":
        return [sys.executable, "-m", "onnxps.cli", *out[1:]]
    raise AssertionError(f"unexpected program {out[0]!r} in {cmd}")


def _env(service: dict[str, Any], replace: dict[str, str]) -> dict[str, str]:
    env = {}
    for key, value in (service.get("environment") or {}).items():
        value = str(value)
        for old, new in replace.items():
            value = value.replace(old, new)
        env[key] = value
    return clean_env(**env)


def test_compose_declares_server_workers_and_volume(compose: dict[str, Any]) -> None:
    services = compose["services"]
    server = services["server"]
    assert server["build"] == {"context": ".", "target": "server"}
    assert "--address=0.0.0.0:50051" in server["command"]
    assert "--insecure" in server["command"]
    assert "onnxps-data:/data" in server["volumes"]
    assert "onnxps-data" in compose["volumes"]
    assert server["healthcheck"]["test"][:3] == ["CMD", "python", "-c"]
    workers = sorted(n for n in services if n.startswith("worker-"))
    assert workers == ["worker-0", "worker-1", "worker-2", "worker-3"]
    for i, name in enumerate(workers):
        w = services[name]
        assert w["depends_on"] == {"server": {"condition": "service_healthy"}}
        assert w["environment"]["ONNXPS_ADDRESS"] == "server:50051"
        assert w["environment"]["ONNXPS_WORKER_INDEX"] == str(i)
        assert w["environment"]["ONNXPS_WORKERS"] == "4"
        assert w["build"] == {"context": ".", "target": "demo"}
        assert w["image"] != server["image"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install '.[demo]'" in dockerfile
    assert "VOLUME /data" in dockerfile and "EXPOSE 50051" in dockerfile


def test_compose_services_train_against_the_server(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    services = compose["services"]
    server_svc = services["server"]
    data = tmp_path / "data"
    data.mkdir()
    log = tmp_path / "server.log"
    to_local = {"0.0.0.0:50051": "127.0.0.1:0", "/data": str(data)}
    with open(log, "wb") as f:
        server = subprocess.Popen(
            _local(server_svc["command"], to_local),
            stdout=f,
            stderr=subprocess.STDOUT,
            env=_env(server_svc, to_local),
        )
    workers: list[subprocess.Popen[str]] = []
    try:
        address = wait_for_listening(server, log)
        port = address.rsplit(":", 1)[1]
        health = _local(
            server_svc["healthcheck"]["test"][1:], {"127.0.0.1:50051": address}
        )
        assert subprocess.run(health, timeout=30, env=clean_env()).returncode == 0

        to_server = {"server:50051": address}
        names = sorted(n for n in services if n.startswith("worker-"))
        for name in names:
            svc = services[name]
            workers.append(
                subprocess.Popen(
                    _local(svc["command"], to_server),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=_env(svc, to_server),
                )
            )
        results = [w.communicate(timeout=90) for w in workers]
        for name, w, (out, err) in zip(names, workers, results, strict=True):
            assert w.returncode == 0, f"{name}: {err}"
            last = out.splitlines()[-1]
            m = ACCURACY.match(last)
            assert m, f"{name}: {out}"
            assert m.group(1) == name[-1]
            assert float(m.group(2)) > 0.8

        status = _local(services["status"]["command"], {"server:50051": address})
        shown = subprocess.run(
            status, capture_output=True, text=True, timeout=30, env=clean_env()
        )
        assert shown.returncode == 0, shown.stderr
        row = shown.stdout.splitlines()[1].split()
        assert row[:6] == ["digits-mlp", "adam", "float32", "4", "4810", "1200"]

        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        for w in workers:
            stop(w)  # type: ignore[arg-type]
            for stream in (w.stdout, w.stderr):
                if stream is not None:
                    stream.close()
        stop(server)
    assert f"listening on 127.0.0.1:{port}" in log.read_text()


def test_compose_sharded_profile_trains_against_three_shards(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    services = compose["services"]
    shard_names = sorted(n for n in services if n.startswith("shard-"))
    assert shard_names == ["shard-0", "shard-1", "shard-2"]
    names = sorted(n for n in services if n.startswith("sharded-worker-"))
    assert len(names) == 4
    for name in [*shard_names, *names, "sharded-status"]:
        assert services[name]["profiles"] == ["sharded"]
    for name in names:  # the demo needs scikit-learn: the workers' image
        assert services[name]["image"] == services["worker-0"]["image"]
        assert services[name]["build"] == {"context": ".", "target": "demo"}
    for name in ["server", *shard_names]:  # a crashed server comes back
        assert services[name]["restart"] == "unless-stopped"
    shards: list[subprocess.Popen[bytes]] = []
    workers: list[subprocess.Popen[str]] = []
    try:
        to_address = {}
        for i, name in enumerate(shard_names):
            svc = services[name]
            assert f"--shard={i}/3" in svc["command"]
            assert svc["volumes"] == [f"onnxps-shard-{i}:/data"]
            data = tmp_path / f"data-{i}"
            to_local = {"0.0.0.0:50051": "127.0.0.1:0", "/data": str(data)}
            log = tmp_path / f"{name}.log"
            with open(log, "wb") as f:
                shards.append(
                    subprocess.Popen(
                        _local(svc["command"], to_local),
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=_env(svc, to_local),
                    )
                )
            to_address[f"{name}:50051"] = wait_for_listening(shards[-1], log)
        for name in names:
            svc = services[name]
            assert set(svc["depends_on"]) == set(shard_names)
            workers.append(
                subprocess.Popen(
                    _local(svc["command"], to_address),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=_env(svc, to_address),
                )
            )
        for name, w in zip(names, workers, strict=True):
            out, err = w.communicate(timeout=120)
            assert w.returncode == 0, f"{name}: {err}"
            m = ACCURACY.match(out.splitlines()[-1])
            assert m and m.group(1) == name[-1] and float(m.group(2)) > 0.8, out
        status = _local(services["sharded-status"]["command"], to_address)
        shown = subprocess.run(
            status, capture_output=True, text=True, timeout=30, env=clean_env()
        )
        assert shown.returncode == 0, shown.stderr
        row = shown.stdout.splitlines()[1].split()
        assert row[:6] == ["digits-mlp", "adam", "float32", "4", "4810", "1200"]
        assert shown.stdout.count(" serving ") == 3
    finally:
        for w in workers:
            stop(w)  # type: ignore[arg-type]
        for s in shards:
            stop(s)
