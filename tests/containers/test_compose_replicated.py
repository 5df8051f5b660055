"""docker-compose.yml's profile "replicated", run without containers: each service's
command as a local process (as tests/containers/test_compose.py does for the other
profiles; tests/containers/test_containers.py runs it under podman).

The etcd service's command runs Debian's etcd (tests/_etcd.py), the three replicas'
commands ``onnxps serve``, their health checks what compose would run, and the four
workers train against ``etcd://``. The primary is killed with SIGKILL mid-training
and started again, as ``restart: unless-stopped`` would (once a standby took over);
training ends with every push applied exactly once (T = 4 x 300). The only changes
are what a container network gives: service names and ports become 127.0.0.1 and
free ports, /data and /var/lib/etcd temporary directories, ``python``/``onnxps``/
``etcd`` local programs.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from _etcd import INSTALL_HINT, etcd_binary, free_port
from _procs import clean_env, stop
from onnxps.cli.process import wait_for_listening

pytestmark = pytest.mark.slow  # docker-compose services run as local processes

ROOT = Path(__file__).resolve().parents[2]
ACCURACY = re.compile(r"^worker (\d)/4 done: 300 steps, held-out accuracy (\d\.\d+)$")
REPLICAS = ["replica-0", "replica-1", "replica-2"]
WORKERS = [f"replicated-worker-{i}" for i in range(4)]


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    found: dict[str, Any] = compose["services"]
    return found


def _local(
    args: list[str], replace: dict[str, str], programs: dict[str, str]
) -> list[str]:
    out = []
    for arg in args:
        for old, new in replace.items():
            arg = arg.replace(old, new)
        out.append(arg)
    return [*programs[out[0]].split(), *out[1:]]


def test_the_replicated_profile_declares_etcd_three_replicas_and_workers(
    services: dict[str, Any],
) -> None:
    profile = sorted(
        n for n, s in services.items() if "replicated" in s.get("profiles", [])
    )
    assert profile == sorted(["etcd", *REPLICAS, *WORKERS, "replicated-status"])
    for i, name in enumerate(REPLICAS):
        cmd = services[name]["command"]
        assert f"--advertise-address={name}:50051" in cmd
        assert f"--member-id={name}" in cmd
        assert "--coordinator=etcd://etcd:2379/onnxps" in cmd
        assert "--durability=wal" in cmd and "--shard=0/1" in cmd
        assert services[name]["volumes"] == [f"onnxps-replica-{i}:/data"]
        assert services[name]["depends_on"] == {
            "etcd": {"condition": "service_healthy"}
        }
        assert services[name]["restart"] == "unless-stopped"
        # healthy = ready: a standby once it holds the primary's log
        assert "service='onnxps.ready'" in services[name]["healthcheck"]["test"][-1]
    for name in WORKERS:
        env = services[name]["environment"]
        assert env["ONNXPS_ADDRESS"] == "etcd://etcd:2379/onnxps"
        assert set(services[name]["depends_on"]) == set(REPLICAS)
    assert services["replicated-status"]["command"][-1] == "etcd://etcd:2379/onnxps"
    assert services["etcd"]["build"] == {"context": ".", "target": "etcd"}


def _run_check(service: dict[str, Any], replace: dict[str, str]) -> int:
    """The service's health check command, run here."""
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD"
    cmd = _local(
        test[1:], replace, {"python": sys.executable, "python3": sys.executable}
    )
    return subprocess.run(
        cmd, timeout=30, env=clean_env(), capture_output=True
    ).returncode


def _wait_check(service: dict[str, Any], replace: dict[str, str], what: str) -> None:
    for _ in range(120):
        if _run_check(service, replace) == 0:
            return
        time.sleep(0.25)
    raise AssertionError(f"{what}: its health check never passed")


def _primary(port: int, after: int = 0) -> dict[str, Any]:
    """The shard's primary in etcd, once one of a term after ``after`` is."""
    import etcd3gw

    client = etcd3gw.Etcd3Client(
        host="127.0.0.1", port=port, api_path="/v3/", timeout=5
    )
    for _ in range(600):
        got = client.get("/onnxps/shards/0/primary")
        if got:
            value: dict[str, Any] = json.loads(got[0])
            if value["term"] > after:
                return value
        time.sleep(0.05)
    raise AssertionError(f"no primary of a term after {after} in etcd")


def test_replicated_profile_trains_through_a_killed_primary_as_local_processes(
    services: dict[str, Any], tmp_path: Path
) -> None:
    binary = etcd_binary()
    if binary is None:
        pytest.skip(INSTALL_HINT)
    client_port, peer_port = free_port(), free_port()
    ports = {name: free_port() for name in REPLICAS}
    programs = {
        "etcd": binary,
        "onnxps": f"{sys.executable} -m onnxps.cli",
        "python": sys.executable,
    }
    network = {
        "0.0.0.0:2379": f"127.0.0.1:{client_port}",
        "etcd:2379": f"127.0.0.1:{client_port}",
        "127.0.0.1:2380": f"127.0.0.1:{peer_port}",
        "=/var/lib/etcd": f"={tmp_path / 'etcd'}",
    } | {f"{name}:50051": f"127.0.0.1:{port}" for name, port in ports.items()}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    workers: list[subprocess.Popen[bytes]] = []
    starts = dict.fromkeys(REPLICAS, 0)

    def start(name: str) -> None:
        """``name`` as compose runs it (again: restart: unless-stopped)."""
        starts[name] += 1
        here = network | {
            "0.0.0.0:50051": f"127.0.0.1:{ports[name]}",
            "=/data": f"={tmp_path / name}",
        }
        log = tmp_path / f"{name}-{starts[name]}.log"
        with open(log, "wb") as out:
            procs[name] = subprocess.Popen(
                _local(services[name]["command"], here, programs),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=clean_env(**services[name]["environment"]),
            )
        assert wait_for_listening(procs[name], log, timeout=60) == here["0.0.0.0:50051"]
        check = {"127.0.0.1:50051": here["0.0.0.0:50051"]}
        _wait_check(services[name], check, name)

    try:
        etcd_log = tmp_path / "etcd.log"
        with open(etcd_log, "wb") as out:
            procs["etcd"] = subprocess.Popen(
                _local(services["etcd"]["command"], network, programs),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        _wait_check(services["etcd"], {"127.0.0.1:2379": network["etcd:2379"]}, "etcd")
        for name in REPLICAS:
            start(name)

        for i, name in enumerate(WORKERS):
            env = {
                k: str(v).replace("etcd:2379", network["etcd:2379"])
                for k, v in services[name]["environment"].items()
            }
            with open(tmp_path / f"{name}.out", "wb") as out:
                workers.append(
                    subprocess.Popen(
                        _local(services[name]["command"], {}, programs),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=clean_env(**env),
                    )
                )
            assert env["ONNXPS_WORKER_INDEX"] == str(i)
        out0 = tmp_path / f"{WORKERS[0]}.out"
        for _ in range(1200):
            if "step 50/300" in out0.read_text():
                break
            assert workers[0].poll() is None, out0.read_text()
            time.sleep(0.1)
        else:
            raise AssertionError(f"no step 50 in time:\n{out0.read_text()}")

        first = _primary(client_port)
        victim = first["member"]
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        # compose's restart policy brings it back at once, within its old lease
        # (it rejoins as a standby, and refuses the resends that reach it while
        # etcd still names its address:
        # tests/replication/test_replicated_resend_to_standby.py)
        start(victim)
        new_term = _primary(client_port, after=first["term"])

        for name, w in zip(WORKERS, workers, strict=True):
            assert w.wait(timeout=300) == 0, (tmp_path / f"{name}.out").read_text()
            last = (tmp_path / f"{name}.out").read_text().strip().splitlines()[-1]
            m = ACCURACY.match(last)
            assert m and m.group(1) == name[-1] and float(m.group(2)) > 0.8, last
        # a new term: the synchronous standby, or the victim itself (back within its
        # old lease, it is the primary etcd's sync key names, holding every push it
        # acknowledged), and it is primary still
        assert new_term["term"] > first["term"]
        second = _primary(client_port)
        assert second == new_term

        status = subprocess.run(
            _local(services["replicated-status"]["command"], network, programs),
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
        )
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        # T exact across the failover: every push applied once, none lost
        assert lines[1].split()[:6] == [
            "digits-mlp", "adam", "float32", "4", "4810", "1200"
        ]  # fmt: skip
        members = {
            line.split()[1]: line.split()
            for line in lines
            if len(line.split()) > 3 and line.split()[1] in REPLICAS
        }
        assert set(members) == set(REPLICAS)
        assert "primary" in members[second["member"]]
    finally:
        for w in workers:
            stop(w)
        for p in procs.values():
            stop(p)


def test_only_the_profiles_private_network_reaches_the_replicas(
    services: dict[str, Any],
) -> None:
    """docs/SECURITY.md, 'Who may follow a primary': the compose replicated profile
    runs without tokens (--insecure), so anything that reaches a replica's port may
    follow it. It publishes no port of the replicas or of etcd (only its private
    network reaches them), and the file says so where the replicas are declared."""
    for name in [*REPLICAS, "etcd"]:
        assert "ports" not in services[name], name
        assert "network_mode" not in services[name], name
    for name in REPLICAS:
        cmd = services[name]["command"]
        assert "--insecure" in cmd
        assert not any(a.startswith("--tokens-file") for a in cmd)
    text = (ROOT / "docker-compose.yml").read_text()
    start = text.index("# Who may follow a primary")
    comment = " ".join(
        line.strip().lstrip("#").strip()
        for line in text[start : text.index("replica-0:", start)].splitlines()
    )
    assert "(docs/SECURITY.md)" in comment
    assert "publishes no port of the replicas or of etcd" in comment
    assert "a token of role replication (prefix *)" in comment
    assert "ONNXPS_REPLICATION_TOKEN, to them alone" in comment
