"""``onnxps demo`` end to end as a process, its interruption, and its workers."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from _procs import children, clean_env, gone, start_server, stop
from onnxps.cli import _demo_worker as worker
from onnxps.cli.demo import Progress
from onnxps.server.app import ServerHandle

pytestmark = pytest.mark.slow  # the examples and demo, as processes

ACCURACY = re.compile(r"^held-out accuracy: (\d\.\d+) on 359 test images", re.M)


def _demo(*args: str) -> list[str]:
    return [sys.executable, "-m", "onnxps.cli", "demo", *args]


@pytest.mark.parametrize(
    ("optimizer", "mode"), [("adam", "async"), ("momentum", "sync")]
)
def test_demo_trains_to_high_accuracy(optimizer: str, mode: str) -> None:
    steps, workers = 100, 2
    run = subprocess.run(
        _demo(
            f"--optimizer={optimizer}",
            f"--mode={mode}",
            f"--workers={workers}",
            f"--steps={steps}",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    m = ACCURACY.search(out)
    assert m, out
    assert float(m.group(1)) > 0.8
    # Not a terminal: plain progress lines, the last one complete, no bar drawing.
    assert "\r" not in out and "\x1b" not in out
    assert f"progress 100%  {steps * workers}/{steps * workers} pushes" in out
    updates = steps if mode == "sync" else steps * workers
    assert f"trained: T={updates} updates from {steps * workers} pushes" in out
    assert f"with {optimizer} (R={worker.LEARNING_RATES[optimizer]}, {mode}" in out


def test_demo_sigint_stops_every_process_and_exits_130() -> None:
    proc = subprocess.Popen(
        _demo("--workers=2", "--steps=100000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    watchdog = threading.Timer(120, proc.kill)  # a hung demo fails, not hangs
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # wait until the workers are pushing
            if line.startswith("progress") and " 0/" not in line:
                break
        kids = children(proc.pid)
        assert len(kids) == 3  # the server and two workers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert all(gone(pid) for pid in kids)
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert "onnxps demo: SIGINT: stopped the server and workers" in err
    finally:
        watchdog.cancel()
        stop(proc)  # type: ignore[arg-type]
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_worker_exits_3_with_a_message_when_the_server_dies(tmp_path: Path) -> None:
    server, address = start_server(tmp_path / "server.log")
    w = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "onnxps.cli._demo_worker",
            f"--address={address}",
            "--steps=100000",
            "--log-every=1",
            "--timeout=3",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    watchdog = threading.Timer(120, w.kill)
    watchdog.start()
    try:
        assert w.stdout is not None and w.stderr is not None
        assert w.stdout.readline().startswith("worker 0/4 step 1/100000 loss ")
        server.kill()
        server.wait()
        assert w.wait(30) == worker.EXIT_SERVER_GONE
        # Before it: the client's warnings about its retries.
        last = w.stderr.read().splitlines()[-1]
        assert last.startswith(
            f"worker 0/4: the parameter server at {address} is unreachable or gone "
        )
        assert last.endswith("; stopping")
    finally:
        watchdog.cancel()
        stop(server)
        stop(w)  # type: ignore[arg-type]
        for stream in (w.stdout, w.stderr):
            if stream is not None:
                stream.close()


def _worker(address: str, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "onnxps.cli._demo_worker", f"--address={address}",
         "--workers=1", "--index=0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
    )  # fmt: skip


def test_a_worker_started_before_its_server_waits_for_it(
    servers: Callable[..., ServerHandle],
) -> None:
    """compose under podman older than 4.6 starts the workers with the server
    (depends_on: service_healthy ignored): a worker waits up to its timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    w = _worker(address, "--steps=5", "--log-every=5", "--timeout=60")
    try:
        assert w.stderr is not None
        said = w.stderr.readline()
        assert said == f"worker 0/1: waiting up to 60 s for the server at {address}\n"
        servers(address=address)
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        assert "waiting" not in err  # said once
        assert out.splitlines()[-1].startswith("worker 0/1 done: 5 steps, held-out")
    finally:
        stop(w)  # type: ignore[arg-type]


def test_a_worker_whose_server_never_comes_exits_3_after_its_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    w = _worker(address, "--steps=5", "--timeout=2")
    try:
        out, err = w.communicate(timeout=120)
    finally:
        stop(w)  # type: ignore[arg-type]
    assert w.returncode == worker.EXIT_SERVER_GONE
    lines = err.splitlines()
    assert lines[0] == f"worker 0/1: waiting up to 2 s for the server at {address}"
    assert lines[-1].startswith(
        f"worker 0/1: the parameter server at {address} is unreachable or gone "
    )
    assert out == ""


def test_progress_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    bar = Progress(400, out, tty=False, every=0.0)
    bar.update(0, None)
    bar.update(100, 1.23456)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("progress   0%  0/400 pushes  loss    -  ")
    assert lines[1].startswith("progress  25%  100/400 pushes  loss 1.2346  ")
    assert out.getvalue().endswith("s\n")


def test_progress_bar_redraws_one_line_on_a_terminal() -> None:
    out = io.StringIO()
    bar = Progress(400, out, tty=True, columns=120)
    bar.update(200, 0.5, force=True)
    bar.update(400, 0.25, force=True)
    bar.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    frames = text.rstrip("\n").split("\r\x1b[K")[1:]
    assert frames[0].startswith(f"[{'#' * 15}{'.' * 15}]  50%  200/400 pushes")
    assert frames[1].startswith(f"[{'#' * 30}] 100%  400/400 pushes  loss 0.2500")


def test_mlp_gradients_match_finite_differences() -> None:
    import numpy as np

    data = worker.load_dataset(0)
    params = [p.astype(np.float64) for p in worker.init_params(0).values()]
    x, y = data.x_train[:16].astype(np.float64), data.y_train[:16]
    _, grads = worker.loss_and_grads(params, x, y)
    rng = np.random.default_rng(1)
    for i, p in enumerate(params):
        for _ in range(3):
            j = tuple(int(rng.integers(d)) for d in p.shape)
            old = p[j]
            p[j] = old + 1e-6
            up, _ = worker.loss_and_grads(params, x, y)
            p[j] = old - 1e-6
            down, _ = worker.loss_and_grads(params, x, y)
            p[j] = old
            assert grads[i][j] == pytest.approx((up - down) / 2e-6, rel=1e-4, abs=1e-8)


def test_shards_partition_the_training_set() -> None:
    data = worker.load_dataset(0)
    sizes = [len(data.shard(i, 4)[0]) for i in range(4)]
    assert sum(sizes) == len(data.x_train) == 1438
    assert len(data.x_test) == 359


def test_example_worker_trains_against_a_server(server: ServerHandle) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "train_worker.py"
    run = subprocess.run(
        [sys.executable, str(example), f"--address={server.address}", "--steps=150"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert run.returncode == 0, run.stderr
    last = run.stdout.splitlines()[-1]
    assert last.startswith("worker 0 held-out accuracy ")
    assert float(last.rsplit(" ", 1)[1]) > 0.8


def test_demo_exits_1_and_says_so_when_its_server_dies() -> None:
    proc = subprocess.Popen(
        _demo("--workers=2", "--steps=100000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if line.startswith("progress") and " 0/" not in line:
                break
        kids = children(proc.pid)
        cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in kids}
        (server,) = [pid for pid, cmd in cmdlines.items() if b"\x00serve\x00" in cmd]
        os.kill(server, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert all(gone(pid) for pid in kids)
        err = proc.stderr.read()
        assert "onnxps demo: the server exited with status -9" in err
    finally:
        watchdog.cancel()
        stop(proc)  # type: ignore[arg-type]
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("columns", [20, 40, 60, 80])
def test_progress_bar_fits_a_narrow_terminal(columns: int) -> None:
    out = io.StringIO()
    bar = Progress(12000, out, tty=True, columns=columns)
    for done in (0, 600, 12000):
        bar.update(done, None if done == 0 else 0.123456, force=True)
    bar.close()
    frames = out.getvalue().rstrip("\n").split("\r\x1b[K")[1:]
    assert len(frames) == 3
    assert all(len(f) <= columns - 1 for f in frames), frames
    assert "12000/12000" in frames[2] or columns < 40


def test_progress_says_starting_workers_until_the_first_push() -> None:
    out = io.StringIO()
    bar = Progress(400, out, tty=True, columns=100)
    bar.update(0, None, force=True)
    bar.update(4, 2.3, force=True)
    frames = out.getvalue().split("\r\x1b[K")[1:]
    assert "0/400 pushes  starting workers..." in frames[0]
    assert "starting" not in frames[1] and "4/400 pushes  loss 2.3000" in frames[1]
    plain = io.StringIO()
    Progress(400, plain, tty=False).update(0, None)
    assert "starting workers..." in plain.getvalue()


def test_demo_sigterm_stops_every_process_and_exits_143_without_tracebacks() -> None:
    proc = subprocess.Popen(
        _demo("--workers=2", "--steps=100000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if line.startswith("progress") and " 0/" not in line:
                break
        kids = children(proc.pid)
        assert len(kids) == 3
        proc.terminate()
        assert proc.wait(30) == 143
        assert all(gone(pid) for pid in kids)
        err = proc.stderr.read()
    finally:
        watchdog.cancel()
        stop(proc)  # type: ignore[arg-type]
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert err.strip() == "onnxps demo: SIGTERM: stopped the server and workers"


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--learning-rate=0", "argument --learning-rate: must be a finite number > 0"),
        ("--batch-size=0", "argument --batch-size: must be >= 1, got 0"),
        ("--seed=-1", "argument --seed: must be >= 0, got -1"),
        ("--workers=0", "argument --workers: must be >= 1, got 0"),
        ("--steps=x", "argument --steps: 'x' is not an integer"),
    ],
)
def test_demo_refuses_bad_flags_with_one_line_and_status_2(
    flag: str, message: str
) -> None:
    run = subprocess.run(
        _demo(flag), capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.splitlines() == [
        f"onnxps demo: {message}" + run.stderr.split(message, 1)[1].rstrip("\n")
    ]
    assert run.stderr.endswith("(see onnxps demo --help)\n")


@pytest.mark.parametrize(
    "flag", ["--batch-size=0", "--seed=-1", "--learning-rate=0", "--timeout=-1"]
)
def test_demo_worker_refuses_bad_flags(flag: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "onnxps.cli._demo_worker", flag],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert run.returncode == 2
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert "Traceback" not in run.stderr
