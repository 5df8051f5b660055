"""Optimizer step throughput: line by line, onnxps NumPy and fused paths, memcpy, torch.

For Adagrad, Momentum and Adam on one float32 tensor of 1e4, 1e6 and 1e7 elements it
prints ns per element and GB/s, counting the bytes a step must move: X, G and the
state read once, X and the state written once (Adagrad and Momentum 20 B/element,
Adam 28 B/element). The rows are

- naive: ``tests/onnx_reference.py``, one expression per line, a temporary each;
- onnxps numpy: ``Stepper.step`` on the NumPy path, in place, blocked, threaded above
  PARALLEL_MIN_ELEMENTS;
- onnxps numba: ``Stepper.step`` on the fused numba path (when numba is installed),
  one compiled pass per block, same threads;
- np.copyto: a plain copy moving the same number of bytes (the memory roofline);
- torch foreach and fused, at torch's default thread count and at 1, when torch is
  importable.

The contenders of one operator and size run alternately, round after round, so drift
and neighbours' load hit them alike; each row shows the median over the rounds and
the spread (min-max). Figures only, nothing is asserted. ``--quick`` for a fast run.
A full run ends with Adam at 1e7 elements by Stepper block size, both paths.

    python benchmarks/kernels.py [--quick] [--rounds N] [--block-sweep]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.server.kernels import (
    BLOCK_ELEMENTS,
    PARALLEL_MIN_ELEMENTS,
    Stepper,
    fused_kernels,
    make_attrs,
)
from onnxps.server.kernels import _fused as fused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import onnx_reference as ref  # noqa: E402

try:
    import torch
except ImportError:  # the numbers without torch are still worth printing
    torch = None

try:
    import numba
except ImportError:  # the NumPy path alone
    numba = None

HAVE_NUMBA = numba is not None
FUSED_BLOCK_ELEMENTS = fused.FUSED_BLOCK_BYTES // 4
TORCH_DEFAULT_THREADS = torch.get_num_threads() if torch is not None else 0

Array = np.ndarray[Any, Any]

OPERATORS: dict[str, dict[str, Any]] = {
    "Adagrad": {},
    "Momentum": {
        "alpha": 0.9,
        "beta": 1.0,
        "mode": "standard",
        "norm_coefficient": 0.0,
    },
    "Adam": {},
}
# Bytes a step reads plus writes per element: X, G, state in; X, state out.
BYTES_PER_ELEMENT = {"Adagrad": 5 * 4, "Momentum": 5 * 4, "Adam": 7 * 4}
STATE_NAMES = {"Adagrad": ("H",), "Momentum": ("V",), "Adam": ("V", "H")}
SIZES = (10_000, 1_000_000, 10_000_000)
LEARNING_RATE = 1e-3


@dataclass
class Timing:
    label: str
    seconds: list[float]  # one step, per round

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def ns_per_element(self, n: int) -> str:
        """Median and spread (min-max) in ns per element."""
        lo, hi = min(self.seconds) / n * 1e9, max(self.seconds) / n * 1e9
        return f"{self.median / n * 1e9:7.3f} ({lo:.3f}-{hi:.3f})"

    def gbps(self, n: int, bytes_per_element: int) -> float:
        return n * bytes_per_element / self.median / 1e9


def calibrate(fn: Callable[[], object], min_seconds: float) -> int:
    """Calls per timed batch, so that a batch lasts about ``min_seconds``."""
    fn()  # warm up: page faults, thread pool start, torch lazy state
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        if time.perf_counter() - start >= min_seconds or number >= 1 << 16:
            return number
        number *= 2


def alternate(
    fns: dict[str, Callable[[], object]], rounds: int, min_seconds: float
) -> dict[str, list[float]]:
    """Seconds per call of each function, one batch each per round, interleaved."""
    numbers = {label: calibrate(fn, min_seconds) for label, fn in fns.items()}
    seconds: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            number = numbers[label]
            start = time.perf_counter()
            for _ in range(number):
                fn()
            seconds[label].append((time.perf_counter() - start) / number)
    return seconds


class Problem:
    """One tensor's X, G, V, H of float32, shared (as copies) by every contender."""

    def __init__(self, op: str, n: int) -> None:
        rng = np.random.default_rng(n)
        self.op, self.n = op, n
        self.x = rng.standard_normal(n, dtype=np.float32)
        self.g = rng.standard_normal(n, dtype=np.float32)
        self.states = {
            name: (
                np.abs(rng.standard_normal(n, dtype=np.float32))
                if name == "H"
                else rng.standard_normal(n, dtype=np.float32)
            )
            for name in STATE_NAMES[op]
        }

    def naive(self) -> Callable[[], object]:
        r, x, g = np.float32(LEARNING_RATE), self.x, self.g
        states = list(self.states.values())
        inputs = [r, np.int64(5), x, g, *states]
        attrs = OPERATORS[self.op]
        return lambda: ref.run(self.op, attrs, inputs)

    def production(
        self, kernels: str, block: int | None = None
    ) -> Callable[[], object]:
        x, g = self.x.copy(), self.g
        states = {k: v.copy() for k, v in self.states.items()}
        attrs = make_attrs(self.op, OPERATORS[self.op])
        stepper = Stepper(attrs, np.float32, [self.n], block, kernels=kernels)
        vs = [states["V"]] if "V" in states else None
        hs = [states["H"]] if "H" in states else None
        counter = iter(range(1, 1 << 62))
        return lambda: stepper.step(LEARNING_RATE, next(counter), [x], [g], vs, hs)

    def copy(self) -> Callable[[], object]:
        half = self.n * BYTES_PER_ELEMENT[self.op] // 2  # read half, write half
        src = np.ones(half, np.uint8)
        dst = np.empty_like(src)
        return lambda: np.copyto(dst, src)

    def torch_step(self, **flavour: bool) -> Callable[[], object]:
        assert torch is not None
        p = torch.nn.Parameter(torch.from_numpy(self.x.copy()))
        p.grad = torch.from_numpy(self.g.copy())
        if self.op == "Adagrad":
            opt: Any = torch.optim.Adagrad([p], lr=LEARNING_RATE, eps=1e-6, **flavour)
        elif self.op == "Momentum":
            opt = torch.optim.SGD([p], lr=LEARNING_RATE, momentum=0.9, **flavour)
        else:
            opt = torch.optim.Adam(
                [p], lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-6, **flavour
            )
        opt.step()  # creates the state; fails here if the flavour is unsupported
        return opt.step


def torch_thread_counts() -> list[int]:
    """Torch's default thread count, and 1: OpenMP barriers suffer on a busy box."""
    if torch is None:
        return []
    return sorted({TORCH_DEFAULT_THREADS, 1}, reverse=True)


def contenders(
    problem: Problem,
) -> list[tuple[str, Callable[[], Callable[[], object]]]]:
    rows: list[tuple[str, Callable[[], Callable[[], object]]]] = [
        ("naive (line by line)", problem.naive),
        ("onnxps numpy", lambda: problem.production("numpy")),
    ]
    if HAVE_NUMBA:
        rows.append(("onnxps numba", lambda: problem.production("numba")))
    rows.append(("np.copyto same bytes", problem.copy))
    for threads in torch_thread_counts():
        for flavour in ("foreach", "fused"):

            def make(threads: int = threads, flavour: str = flavour) -> Any:
                assert torch is not None
                torch.set_num_threads(threads)
                return problem.torch_step(**{flavour: True})

            rows.append((f"torch {flavour} {threads}T", make))
    return rows


def header() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    lines = [
        f"machine: {platform.node()} {platform.machine()}, {model}",
        f"cpus: {os.cpu_count()} (usable {affinity}); onnxps kernel threads "
        f"{fused._THREADS}, BLOCK_ELEMENTS {BLOCK_ELEMENTS}, "
        f"PARALLEL_MIN_ELEMENTS {PARALLEL_MIN_ELEMENTS}",
        f"python {platform.python_version()}, numpy {np.__version__}, "
        + (f"numba {numba.__version__}, " if numba is not None else "no numba, ")
        + (
            f"torch {torch.__version__} (rows nT: n intra-op threads)"
            if torch is not None
            else "torch not importable: torch rows skipped"
        ),
        "bytes counted per element: X, G, state read + X, state written "
        "(Adagrad, Momentum 20 B; Adam 28 B); float32",
    ]
    return "\n".join(lines)


def pinned_threads(label: str, fn: Callable[[], object]) -> Callable[[], object]:
    """Torch's thread count is process-wide: set it before each torch row's step."""
    if torch is None or not label.startswith("torch"):
        return fn
    threads = int(label.rsplit(" ", 1)[1].rstrip("T"))

    def step() -> object:
        assert torch is not None
        torch.set_num_threads(threads)
        return fn()

    return step


def run_table(sizes: tuple[int, ...], rounds: int, min_seconds: float) -> None:
    print(
        f"\n{'operator':<9} {'elements':>9}  {'implementation':<22}"
        f"{'ns/elem median (min-max)':>26} {'GB/s':>7} {'ms/step':>8}"
    )
    summary: list[tuple[str, int, dict[str, float]]] = []
    for op in OPERATORS:
        for n in sizes:
            problem = Problem(op, n)
            fns: dict[str, Callable[[], object]] = {}
            for label, make in contenders(problem):
                try:
                    fns[label] = pinned_threads(label, make())
                except (RuntimeError, TypeError, ValueError) as exc:
                    print(f"{op:<9} {n:>9.0e}  {label:<22}skipped: {exc}"[:110])
            seconds = alternate(fns, rounds, min_seconds)
            timings = {label: Timing(label, s) for label, s in seconds.items()}
            for label, t in timings.items():
                print(
                    f"{op:<9} {n:>9.0e}  {label:<22}{t.ns_per_element(n):>26} "
                    f"{t.gbps(n, BYTES_PER_ELEMENT[op]):>7.2f} "
                    f"{t.median * 1e3:>8.3f}",
                    flush=True,
                )
            medians = {label: t.median for label, t in timings.items()}
            for flavour in ("foreach", "fused"):
                mine = [
                    m for k, m in medians.items() if k.startswith(f"torch {flavour}")
                ]
                if mine:  # the best thread count: the fairest figure for torch
                    medians[f"best torch {flavour}"] = min(mine)
            summary.append((op, n, medians))
            del problem, fns
    print_ratios(summary)


def print_ratios(summary: list[tuple[str, int, dict[str, float]]]) -> None:
    """Each onnxps path's median step time over the others' (< 1: onnxps faster)."""
    others = ["np.copyto same bytes", "best torch foreach", "best torch fused"]
    for path in ("onnxps numpy", "onnxps numba"):
        if not any(path in medians for _, _, medians in summary):
            continue
        print(f"\n{path}: its median time / the other's (< 1: onnxps faster)")
        print(
            f"{'operator':<9} {'elements':>9}  " + "".join(f"{o:>22}" for o in others)
        )
        for op, n, medians in summary:
            cells = "".join(
                f"{medians[path] / medians[o]:>21.2f}x"
                if o in medians
                else f"{'-':>22}"
                for o in others
            )
            print(f"{op:<9} {n:>9.0e}  {cells}")


def run_block_sweep(n: int, blocks: tuple[int, ...], rounds: int) -> None:
    """Adam at ``n`` elements by block size and path, interleaved against drift."""
    print(f"\nAdam, {n:.0e} float32 elements, by Stepper block size ({rounds} rounds)")
    problem = Problem("Adam", n)
    paths = ("numpy", "numba") if HAVE_NUMBA else ("numpy",)
    steps = {
        (path, b): problem.production(path, block=b) for path in paths for b in blocks
    }
    seconds = alternate(
        {f"{path} {b}": fn for (path, b), fn in steps.items()}, rounds, 0.0
    )
    for path, b in steps:
        t = Timing(str(b), seconds[f"{path} {b}"])
        default = BLOCK_ELEMENTS if path == "numpy" else FUSED_BLOCK_ELEMENTS
        mark = "  (default)" if b == default else ""
        print(
            f"  {path:<5} block {b // 1024:>5} Ki  {t.ns_per_element(n)} ns/elem "
            f"{t.gbps(n, BYTES_PER_ELEMENT['Adam']):>7.2f} GB/s{mark}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1e4 and 1e6, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (7)")
    parser.add_argument(
        "--block-sweep", action="store_true", help="only Adam at 1e7 by block size"
    )
    args = parser.parse_args(argv)
    sizes = SIZES[:2] if args.quick else SIZES
    rounds = args.rounds or (3 if args.quick else 7)
    min_seconds = 0.02 if args.quick else 0.1
    if HAVE_NUMBA:  # compile, or load numba's cache, before anything is timed
        start = time.perf_counter()
        fused_kernels()
        print(f"numba kernels ready in {time.perf_counter() - start:.2f} s")
    print(header())
    if not args.block_sweep:
        run_table(sizes, rounds, min_seconds)
    if args.block_sweep or not args.quick:
        blocks = tuple(k * 1024 for k in (64, 256, 1024, 4096))
        run_block_sweep(SIZES[-1], blocks, rounds)


if __name__ == "__main__":
    main()
