"""Optimizer step throughput: line-by-line transcription, onnxps, memcpy, torch.

For Adagrad, Momentum and Adam on one float32 tensor of 1e4, 1e6 and 1e7 elements it
prints ns per element and GB/s, counting the bytes a step must move: X, G and the
state read once, X and the state written once (Adagrad and Momentum 20 B/element,
Adam 28 B/element). The rows are

- naive: ``tests/onnx_reference.py``, one expression per line, a temporary each;
- onnxps: ``Stepper.step``, in place, blocked, threaded above PARALLEL_MIN_ELEMENTS;
- np.copyto: a plain copy moving the same number of bytes (the memory roofline);
- torch foreach (and fused where this torch has it), when torch is importable.

Best of N repeats; figures only, nothing is asserted. ``--quick`` for a fast run. A
full run ends with Adam at 1e7 elements by Stepper block size (8 Ki to 128 Ki).

    python benchmarks/kernels.py [--quick] [--repeats N] [--block-sweep]
"""

from __future__ import annotations

import argparse
import os
import platform
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
    make_attrs,
)
from onnxps.server.kernels import _fused as fused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import onnx_reference as ref  # noqa: E402

try:
    import torch
except ImportError:  # the numbers without torch are still worth printing
    torch = None

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
    seconds: float  # best time of one step

    def ns_per_element(self, n: int) -> float:
        return self.seconds / n * 1e9

    def gbps(self, n: int, bytes_per_element: int) -> float:
        return n * bytes_per_element / self.seconds / 1e9


def best_of(fn: Callable[[], object], repeats: int, min_seconds: float) -> float:
    """Best seconds per call; each repeat loops long enough to be measurable."""
    fn()  # warm up: page faults, thread pool start, torch lazy state
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds or number >= 1 << 16:
            break
        number *= 2
    best = elapsed / number
    for _ in range(repeats - 1):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


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

    def production(self, block: int | None = None) -> Callable[[], object]:
        x, g = self.x.copy(), self.g
        states = {k: v.copy() for k, v in self.states.items()}
        stepper = Stepper(
            make_attrs(self.op, OPERATORS[self.op]), np.float32, [self.n], block
        )
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
        ("onnxps Stepper", problem.production),
        ("np.copyto same bytes", problem.copy),
    ]
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
        + (
            f"torch {torch.__version__} (rows nT: n intra-op threads)"
            if torch is not None
            else "torch not importable: torch rows skipped"
        ),
        "bytes counted per element: X, G, state read + X, state written "
        "(Adagrad, Momentum 20 B; Adam 28 B); float32",
    ]
    return "\n".join(lines)


def run_table(sizes: tuple[int, ...], repeats: int, min_seconds: float) -> None:
    print(
        f"\n{'operator':<9} {'elements':>9}  {'implementation':<22}"
        f"{'ns/elem':>9} {'GB/s':>8} {'ms/step':>9}"
    )
    speedups: list[tuple[str, int, dict[str, float]]] = []
    for op in OPERATORS:
        for n in sizes:
            problem = Problem(op, n)
            timings: dict[str, Timing] = {}
            for label, make in contenders(problem):
                try:
                    fn = make()
                except (RuntimeError, TypeError, ValueError) as exc:
                    print(f"{op:<9} {n:>9.0e}  {label:<22}skipped: {exc}"[:110])
                    continue
                timings[label] = Timing(label, best_of(fn, repeats, min_seconds))
                del fn
                t = timings[label]
                print(
                    f"{op:<9} {n:>9.0e}  {label:<22}"
                    f"{t.ns_per_element(n):>9.3f} "
                    f"{t.gbps(n, BYTES_PER_ELEMENT[op]):>8.2f} "
                    f"{t.seconds * 1e3:>9.3f}",
                    flush=True,
                )
            prod = timings["onnxps Stepper"].seconds
            ratios = {k: v.seconds / prod for k, v in timings.items()}
            for flavour in ("foreach", "fused"):
                mine = [
                    r for k, r in ratios.items() if k.startswith(f"torch {flavour}")
                ]
                if mine:  # the best thread count: the fairest figure for torch
                    ratios[f"best torch {flavour}"] = min(mine)
            speedups.append((op, n, ratios))
            del problem
    print("\nspeedup of onnxps Stepper (other's time / Stepper's time; > 1: faster)")
    others = [
        "naive (line by line)",
        "np.copyto same bytes",
        "best torch foreach",
        "best torch fused",
    ]
    print(f"{'operator':<9} {'elements':>9}  " + "".join(f"{o:>22}" for o in others))
    for op, n, ratio in speedups:
        cells = "".join(
            f"{ratio[o]:>21.2f}x" if o in ratio else f"{'-':>22}" for o in others
        )
        print(f"{op:<9} {n:>9.0e}  {cells}")


def run_block_sweep(n: int, blocks: tuple[int, ...], repeats: int) -> None:
    """Adam at ``n`` elements with several block sizes, interleaved against drift."""
    print(
        f"\nAdam, {n:.0e} float32 elements, by Stepper block size (best of {repeats})"
    )
    problem = Problem("Adam", n)
    steps = {b: problem.production(block=b) for b in blocks}
    best = dict.fromkeys(blocks, float("inf"))
    for _ in range(repeats):
        for b, fn in steps.items():
            best[b] = min(best[b], best_of(fn, 1, 0.0))
    for b in blocks:
        t = Timing(str(b), best[b])
        mark = "  (BLOCK_ELEMENTS)" if b == BLOCK_ELEMENTS else ""
        print(
            f"  block {b // 1024:>4} Ki  {t.ns_per_element(n):>7.3f} ns/elem "
            f"{t.gbps(n, BYTES_PER_ELEMENT['Adam']):>7.2f} GB/s{mark}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1e4 and 1e6, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="best of N")
    parser.add_argument(
        "--block-sweep", action="store_true", help="only Adam at 1e7 by block size"
    )
    args = parser.parse_args(argv)
    sizes = SIZES[:2] if args.quick else SIZES
    repeats = args.repeats or (3 if args.quick else 7)
    min_seconds = 0.02 if args.quick else 0.1
    print(header())
    if not args.block_sweep:
        run_table(sizes, repeats, min_seconds)
    if args.block_sweep or not args.quick:
        blocks = tuple(k * 1024 for k in (32, 64, 128, 256, 512))
        run_block_sweep(SIZES[-1], blocks, repeats)


if __name__ == "__main__":
    main()
