"""``onnxps demo``: a server and N workers training an MLP on digits, in one command.

The demo starts ``onnxps serve`` on 127.0.0.1 (port 0; the port is read from the
server's "listening on" log line), creates the group, starts the workers
(``python -m onnxps.cli._demo_worker``), shows their progress, and at the end pulls
the parameters and prints the held-out accuracy.

Exit status: 0 when training finished; 1 when a worker or the server failed; 128 + the
signal number when interrupted (130 for SIGINT/Ctrl-C, 143 for SIGTERM). In every case
each process the demo started is stopped before it returns.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from onnxps.client import Client, OnnxpsError

from . import _demo_worker as worker
from ._args import Parser, at_least, positive_float
from .process import start_server_process, stop_processes

__all__ = ["Progress", "add_arguments", "run"]

STEP_LINE = re.compile(r"^worker (\d+)/\d+ step (\d+)/\d+ loss ([0-9.eE+-]+|nan|inf)")
GROUP = "digits-mlp"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--optimizer",
        choices=worker.OPTIMIZERS,
        default="adam",
        help="ONNX optimizer applied by the server (default adam)",
    )
    p.add_argument(
        "--workers", type=at_least(1), default=4, help="worker processes (4)"
    )
    p.add_argument("--steps", type=at_least(1), default=300, help="pushes per worker")
    p.add_argument(
        "--mode", choices=("async", "sync"), default="async", help="consistency"
    )
    p.add_argument(
        "--learning-rate",
        type=positive_float,
        default=None,
        help="R (default tuned per optimizer: "
        + ", ".join(f"{k} {v}" for k, v in worker.LEARNING_RATES.items())
        + ")",
    )
    p.add_argument("--batch-size", type=at_least(1), default=32, help="minibatch (32)")
    p.add_argument(
        "--seed", type=at_least(0), default=0, help="data split and init seed (0)"
    )


STARTING = "starting workers..."


class Progress:
    """A progress bar on a terminal (one line that fits its width, redrawn);
    periodic plain lines anywhere else."""

    def __init__(
        self,
        total: int,
        out: TextIO,
        tty: bool | None = None,
        every: float = 2.0,
        columns: int | None = None,
    ) -> None:
        self.total = max(1, total)
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self.every = every if not self.tty else 0.1
        self.columns = columns
        self.start = time.monotonic()
        self._last = -1e9
        self._shown = False
        self._shown_done: int | None = None
        self._window: collections.deque[tuple[float, int]] = collections.deque()

    def line(self, done: int, loss: float | None) -> str:
        now = time.monotonic()
        elapsed = now - self.start
        frac = min(1.0, done / self.total)
        if done == 0 and loss is None:
            stats = f"0/{self.total} pushes  {STARTING}  {elapsed:.1f}s"
        else:
            shown = "   -  " if loss is None else worker.loss_text(loss)
            rate = self.rate(now, done)
            # no rate until two counts were seen: said by its absence, not "- pushes/s"
            speed = "" if rate is None else f"{rate:.0f} pushes/s  "
            stats = f"{done}/{self.total} pushes  loss {shown}  {speed}{elapsed:.1f}s"
        if not self.tty:
            if done == 0 and loss is None:
                stats = f"0/{self.total} pushes  loss    -   {STARTING}  {elapsed:.1f}s"
            return f"progress {100 * frac:3.0f}%  {stats}"
        return self._fit(frac, f"{100 * frac:3.0f}%  {stats}")

    def _fit(self, frac: float, text: str) -> str:
        """The bar and ``text`` in one line shorter than the terminal: the bar
        shrinks first (to nothing), then the text is cut."""
        columns = self.columns or shutil.get_terminal_size((80, 24)).columns
        room = columns - 1  # the last column would wrap on some terminals
        width = min(30, room - len(text) - 3)
        if width < 5:
            return text[:room]
        filled = int(width * frac)
        return f"[{'#' * filled}{'.' * (width - filled)}] {text}"[:room]

    def rate(self, now: float, done: int) -> float | None:
        """Pushes per second over the last few seconds (not worker start-up); None
        until two counts of pushes were seen (the first line has one)."""
        window = self._window
        if not window or window[-1][1] != done:
            window.append((now, done))
        while len(window) > 2 and now - window[1][0] > 3.0:
            window.popleft()
        t0, d0 = window[0]
        if len(window) < 2 or now <= t0:
            return None
        return (done - d0) / (now - t0)

    def update(self, done: int, loss: float | None, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        if not self.tty and done >= self.total and self._shown_done == done:
            return  # the last plain line said 100% already
        self._last = now
        self._shown_done = done
        if self.tty:
            self.out.write("\r\x1b[K" + self.line(done, loss))
        else:
            self.out.write(self.line(done, loss) + "\n")
        self.out.flush()
        self._shown = True

    def close(self) -> None:
        if self.tty and self._shown:
            self.out.write("\n")
            self.out.flush()


@dataclass
class _Workers:
    """What the workers reported, fed by one reader thread per worker."""

    steps: dict[int, int] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    lines: dict[int, list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, index: int, stream: TextIO) -> None:
        try:
            self._read(index, stream)
        except (OSError, ValueError):  # the stream was closed while stopping
            return

    def _read(self, index: int, stream: TextIO) -> None:
        for raw in stream:
            text = raw.rstrip("\n")
            m = STEP_LINE.match(text)
            with self.lock:
                self.lines.setdefault(index, []).append(text)
                if m:
                    self.steps[index] = int(m.group(2))
                    self.losses[index] = float(m.group(3))

    def snapshot(self) -> tuple[int, float | None]:
        with self.lock:
            done = sum(self.steps.values())
            losses = list(self.losses.values())
        return done, (sum(losses) / len(losses) if losses else None)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: Any) -> None:
    # Once: a second signal must not interrupt the stopping of the processes.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise _Interrupted(signum)


def _worker_cmd(args: argparse.Namespace, address: str, index: int) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "onnxps.cli._demo_worker",
        f"--address={address}",
        f"--group={GROUP}",
        f"--index={index}",
        f"--workers={args.workers}",
        f"--steps={args.steps}",
        f"--batch-size={args.batch_size}",
        f"--optimizer={args.optimizer}",
        f"--mode={args.mode}",
        f"--seed={args.seed}",
        f"--learning-rate={args.lr}",
        "--log-every=5",
    ]
    return cmd


def _train(
    args: argparse.Namespace, workdir: Path, procs: list[Any], out: TextIO
) -> int:
    server_log = workdir / "server.log"
    server, address = start_server_process(log=server_log)
    procs.append(server)
    print(
        f"onnxps demo: server on {address}; {args.workers} workers train a "
        f"{worker.HIDDEN}-unit MLP on digits with {args.optimizer} "
        f"(R={args.lr}, {args.mode}, {args.steps} steps each)",
        file=out,
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        ps = stack.enter_context(Client(address, timeout=10.0))
        worker.create_group_if_missing(
            ps, GROUP, args.optimizer, args.lr, args.mode, args.workers, args.seed
        )
        state = _Workers()
        readers = []
        errs = []
        for i in range(args.workers):
            err = stack.enter_context(open(workdir / f"worker-{i}.err", "w+b"))
            errs.append(err)
            p = subprocess.Popen(
                _worker_cmd(args, address, i),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            procs.append(p)
            stack.callback(p.stdout.close)  # type: ignore[union-attr]
            t = threading.Thread(target=state.read, args=(i, p.stdout), daemon=True)
            t.start()
            readers.append(t)
        workers = procs[1:]
        bar = Progress(args.workers * args.steps, out)
        while any(p.poll() is None for p in workers):
            if server.poll() is not None or any(p.poll() for p in workers):
                break
            bar.update(*state.snapshot())
            time.sleep(0.05)
        failed = [i for i, p in enumerate(workers) if p.poll()]
        if server.poll() is not None or failed:
            bar.close()
            stop_processes(workers)
            _report_failure(server, server_log, workers, failed, errs)
            return 1
        for t in readers:
            t.join(timeout=5)
        bar.update(*state.snapshot(), force=True)
        bar.close()
        params = ps.pull(GROUP)
        info = ps.describe_group(GROUP)
        elapsed = time.monotonic() - bar.start
    data = worker.load_dataset(args.seed)
    acc = worker.accuracy(params, data.x_test, data.y_test)
    print(
        f"trained: T={info.update_count} updates from "
        f"{args.workers * args.steps} pushes in {elapsed:.1f}s",
        file=out,
    )
    print(
        f"held-out accuracy: {acc:.4f} on {len(data.y_test)} test images "
        "(chance is 0.10)",
        file=out,
        flush=True,
    )
    return 0


def _report_failure(
    server: subprocess.Popen[Any],
    server_log: Path,
    workers: Sequence[subprocess.Popen[Any]],
    failed: Sequence[int],
    errs: Sequence[Any],
) -> None:
    if server.poll() is not None:
        print(
            f"onnxps demo: the server exited with status {server.returncode}:\n"
            + server_log.read_text(errors="replace")[-2000:],
            file=sys.stderr,
        )
    for i in failed:
        errs[i].seek(0)
        text = errs[i].read().decode(errors="replace")[-2000:]
        print(
            f"onnxps demo: worker {i} exited with status {workers[i].returncode}:\n"
            + text,
            file=sys.stderr,
        )


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the demo; returns the exit status (see the module docstring)."""
    out = out or sys.stdout
    if importlib.util.find_spec("sklearn") is None:
        print(
            "onnxps demo trains on scikit-learn's digits: pip install 'onnxps[demo]' "
            "(or run bash scripts/demo.sh)",
            file=sys.stderr,
        )
        return 2
    args.lr = args.learning_rate
    if args.lr is None:
        args.lr = worker.LEARNING_RATES[args.optimizer]
    procs: list[subprocess.Popen[Any]] = []
    previous = {
        s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with tempfile.TemporaryDirectory(prefix="onnxps-demo-") as tmp:
            try:
                return _train(args, Path(tmp), procs, out)
            except (RuntimeError, OnnxpsError) as exc:
                print(f"onnxps demo: {exc}", file=sys.stderr)
                return 1
            finally:
                # Stop workers first, then the server, each within its own bound.
                stop_processes(procs[1:])
                stop_processes(procs[:1])
    except _Interrupted as exc:
        stop_processes(procs[1:])
        stop_processes(procs[:1])
        print(f"\nonnxps demo: {exc}: stopped the server and workers", file=sys.stderr)
        return 128 + exc.signum
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="onnxps demo")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
