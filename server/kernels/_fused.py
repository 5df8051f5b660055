"""In-place optimizer steps: the production path.

Each step walks the group's tensors in cache-sized blocks and updates X, V and H in
place with two scratch rows that a ``Stepper`` allocates once and reuses, so a step
allocates nothing proportional to the tensor size. NumPy releases the GIL inside every
ufunc, so large groups are split between the calling thread and a small shared pool.

The operation order inside a block is the ONNX reference implementation's, so the
result is bit-identical to ``apply_onnx`` and to a line-by-line transcription that
groups its operations the same way. Scalar coefficients (the adjusted learning rate,
``1 - alpha``...) are computed in float64 and rounded once to the state dtype, as the
ONNX reference does under NumPy's value-based casting.

When numba is installed (``onnxps[fast]``) a step takes the fused path instead: one
compiled pass per block that reads and writes each element once (``_numba``), with
the same operations in the same order, so the same bits. ``_select`` chooses.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from onnxps.wire._pageout import page_out

from ..errors import InvalidArgument
from ._attrs import AdagradAttrs, AdamAttrs, MomentumAttrs, OptimizerAttrs
from ._select import current_path, fused_kernels

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_ELEMENTS",
    "FUSED_BLOCK_BYTES",
    "PARALLEL_MIN_ELEMENTS",
    "Stepper",
]

# 1 MiB of each array per block (256 Ki float32, 128 Ki float64). Smaller blocks fit
# L2 but pay NumPy's per-call cost ~12 times per block: measured on 2 cores, Adam at
# 1e7 float32 took 1.5-1.7 ns/element with 32 Ki blocks and 1.06-1.08 with 256 Ki.
BLOCK_BYTES = 1 << 20
BLOCK_ELEMENTS = BLOCK_BYTES // 4  # float32
# The fused path makes one pass whatever the block size: its blocks only share a step
# between threads, and larger ones cost fewer calls.
FUSED_BLOCK_BYTES = 4 << 20
# Below this a step runs on the calling thread: the hand-off would cost more.
PARALLEL_MIN_ELEMENTS = 512 * 1024

_THREADS = max(1, min(8, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(
            max_workers=max(1, _THREADS - 1), thread_name_prefix="onnxps-kernel"
        )
    return _pool


Array = np.ndarray[Any, Any]
Block = tuple[int, int, int]  # tensor index, start, stop
BlockFn = Callable[..., None]


def _regularized(c: dict[str, Any], x: Array, g: Array, out: Array) -> Array:
    """G_regularized = norm_coefficient * X + G, in ``out``; G itself when nc is 0."""
    if c["nc"] is None:
        return g
    np.multiply(x, c["nc"], out=out)
    np.add(out, g, out=out)
    return out


def _adagrad_block(
    c: dict[str, Any], x: Array, g: Array, v: None, h: Array, t1: Array, t2: Array
) -> None:
    gr = _regularized(c, x, g, t2)
    np.multiply(gr, gr, out=t1)
    np.add(h, t1, out=h)
    np.sqrt(h, out=t1)
    np.add(t1, c["eps"], out=t1)
    np.multiply(gr, c["r"], out=t2)  # r * G_reg, then / H_adaptive (ONNX order)
    np.divide(t2, t1, out=t2)
    np.subtract(x, t2, out=x)


def _momentum_block(
    c: dict[str, Any], x: Array, g: Array, v: Array, h: None, t1: Array, t2: Array
) -> None:
    gr = _regularized(c, x, g, t2)
    np.multiply(v, c["alpha"], out=v)
    np.multiply(gr, c["beta"], out=t1)
    np.add(v, t1, out=v)
    if c["nesterov"]:
        np.multiply(v, c["alpha"], out=t1)
        np.add(gr, t1, out=t1)
        np.multiply(t1, c["r"], out=t1)
    else:
        np.multiply(v, c["r"], out=t1)
    np.subtract(x, t1, out=x)


def _adam_block(
    c: dict[str, Any], x: Array, g: Array, v: Array, h: Array, t1: Array, t2: Array
) -> None:
    gr = _regularized(c, x, g, t2)
    np.multiply(v, c["alpha"], out=v)
    np.multiply(gr, c["one_minus_alpha"], out=t1)
    np.add(v, t1, out=v)
    np.multiply(gr, gr, out=t1)  # (1 - beta) * (G_reg * G_reg): the reference's order
    np.multiply(t1, c["one_minus_beta"], out=t1)
    np.multiply(h, c["beta"], out=h)
    np.add(h, t1, out=h)
    np.sqrt(h, out=t1)
    np.add(t1, c["eps"], out=t1)
    np.divide(v, t1, out=t1)  # R_adjusted * (V_new / H_sqrt)
    np.multiply(t1, c["r"], out=t1)
    np.subtract(x, t1, out=x)
    if c["post"] is not None:
        np.multiply(x, c["post"], out=x)


def coefficients(
    attrs: OptimizerAttrs, r: float, t: int, dtype: np.dtype[Any]
) -> dict[str, Any]:
    """The step's scalars, computed in float64 and rounded once to ``dtype``.

    A coefficient whose operation is the identity (a zero ``norm_coefficient``) is
    ``None`` and its pass is skipped; that is bit-exact except where X holds inf or
    NaN (where ``0 * X`` would be NaN). A coefficient that is undefined or not finite
    in ``dtype`` (Adam with ``alpha = 1`` at T > 0, Adagrad with ``1 + T *
    decay_factor = 0``...) raises ``InvalidArgument`` before anything is touched.
    """
    try:
        exact = _float64_coefficients(attrs, r, t)
    except (ArithmeticError, ValueError) as exc:  # division by zero, sqrt(<0), pow
        raise InvalidArgument(
            f"{attrs.op} step coefficients are undefined at T={t} with R={r!r} "
            f"and {attrs}: {exc}"
        ) from exc
    s = dtype.type
    largest = _LARGEST.get(dtype.char)
    c: dict[str, Any] = {}
    for name, value in exact.items():
        if value is None or isinstance(value, bool):
            c[name] = value
        elif largest is not None and -largest <= value <= largest:
            c[name] = s(value)  # finite, and rounds without overflow: no checks
        else:
            return _rounded_checked(attrs, r, t, dtype, exact)
    return c


# The largest finite value per state dtype: a float64 coefficient within it rounds
# to a finite value of that dtype (NaN and inf are outside it).
_LARGEST = {np.dtype(d).char: float(np.finfo(d).max) for d in (np.float32, np.float64)}


def _rounded_checked(
    attrs: OptimizerAttrs,
    r: float,
    t: int,
    dtype: np.dtype[Any],
    exact: dict[str, float | bool | None],
) -> dict[str, Any]:
    """``exact`` rounded to ``dtype`` when a value may overflow or is not finite:
    an overflow rounds to inf silently, and a coefficient not finite raises."""
    s = dtype.type
    with np.errstate(over="ignore"):
        c = {
            name: value if value is None or isinstance(value, bool) else s(value)
            for name, value in exact.items()
        }
    for name, value in c.items():
        if isinstance(value, np.floating) and not math.isfinite(value):
            raise InvalidArgument(
                f"{attrs.op} step coefficient {name!r} is {exact[name]!r} at T={t} "
                f"with R={r!r}: not finite in {dtype}"
            )
    return c


def _float64_coefficients(
    attrs: OptimizerAttrs, r: float, t: int
) -> dict[str, float | bool | None]:
    nc = attrs.norm_coefficient
    c: dict[str, float | bool | None] = {"nc": nc if nc != 0.0 else None}
    if isinstance(attrs, AdagradAttrs):
        c["r"] = r / (1.0 + t * attrs.decay_factor)
        c["eps"] = attrs.epsilon
    elif isinstance(attrs, MomentumAttrs):
        c["alpha"] = attrs.alpha
        c["beta"] = attrs.beta if t > 0 else 1.0
        c["r"] = r
        c["nesterov"] = attrs.mode == "nesterov"
    else:
        assert isinstance(attrs, AdamAttrs)
        a, b = attrs.alpha, attrs.beta
        c["r"] = r * math.sqrt(1.0 - b**t) / (1.0 - a**t) if t > 0 else r
        c["alpha"] = a
        c["one_minus_alpha"] = 1.0 - a
        c["beta"] = b
        c["one_minus_beta"] = 1.0 - b
        c["eps"] = attrs.epsilon
        post = attrs.norm_coefficient_post
        c["post"] = 1.0 - post if post != 0.0 else None
    return c


_BLOCK_FNS: dict[str, BlockFn] = {
    "Adagrad": _adagrad_block,
    "Momentum": _momentum_block,
    "Adam": _adam_block,
}


class Stepper:
    """Steps one group's tensors in place; owns the group's scratch buffers.

    ``kernels`` chooses the path (``"numpy"``, ``"numba"`` or ``"auto"``; None reads
    ``ONNXPS_KERNELS``, see ``kernel_path``); ``self.kernels`` says which one it
    took. On the auto path while a server loads the fused kernels in the
    background (``current_path``), it steps with NumPy and takes them at its first
    step after they are in: the same bits. Not thread-safe: the owner (a group,
    under its lock) calls ``step`` serially.
    """

    def __init__(
        self,
        attrs: OptimizerAttrs,
        dtype: np.dtype[Any] | type,
        sizes: Sequence[int],
        block: int | None = None,
        kernels: str | None = None,
    ) -> None:
        self.attrs = attrs
        self.dtype = np.dtype(dtype)
        self.sizes = [int(n) for n in sizes]
        self._requested = kernels
        self._block = block
        path = current_path(kernels)
        # None: the fused kernels are loading; NumPy (the same bits) until they are
        self._later = path is None
        self._take(path or "numpy")

    def _take(self, path: str) -> None:
        """Step on ``path`` from now on: its kernels, blocks and scratch."""
        self.kernels = path
        self._kernel = _compiled_kernel(path, self.attrs.op)
        self._row_kernel = _compiled_kernel(path, f"{self.attrs.op}_rows")
        total = sum(self.sizes)
        parallel = total >= PARALLEL_MIN_ELEMENTS and _THREADS > 1
        block = self._block
        if block is None:
            block = self._default_block(total, parallel)
        self.block = block
        self._fn = _BLOCK_FNS[self.attrs.op]
        self._blocks: list[Block] = [
            (i, start, min(start + block, n))
            for i, n in enumerate(self.sizes)
            for start in range(0, n, block)
        ]
        slots = min(_THREADS, len(self._blocks)) if parallel else 1
        self._slices = [self._blocks[k::slots] for k in range(slots)]
        self._row = min(block, max(self.sizes, default=0)) or 1
        # The fused path needs scratch only for an array it was not compiled for.
        self._scratch: list[Array | None] = [None] * slots
        if self._kernel is None:
            self._scratch = [self._new_scratch() for _ in range(slots)]

    def _loaded_yet(self) -> None:
        """Take the fused kernels once they are loaded (a step's first thing)."""
        path = current_path(self._requested)
        if path is not None:
            self._later = False
            if path != self.kernels:
                self._take(path)

    def _default_block(self, total: int, parallel: bool) -> int:
        size = BLOCK_BYTES if self._kernel is None else FUSED_BLOCK_BYTES
        block = size // self.dtype.itemsize
        if parallel:  # at least two blocks per thread, so the threads stay even
            block = max(4096, min(block, -(-total // (2 * _THREADS))))
        return block

    def _new_scratch(self) -> Array:
        return np.empty((2, self._row), self.dtype)

    def step(
        self,
        r: float,
        t: int,
        xs: Sequence[Array],
        gs: Sequence[Array],
        vs: Sequence[Array] | None,
        hs: Sequence[Array] | None,
    ) -> None:
        """One ONNX step on flat, C-contiguous arrays of this stepper's dtype."""
        if self._later:
            self._loaded_yet()
        c = coefficients(self.attrs, float(r), int(t), self.dtype)
        run = self._run if self._kernel is None else self._run_fused
        args = (c, xs, gs, vs, hs)
        if len(self._slices) == 1:
            run(0, *args)
            return
        pool = _shared_pool()
        futures = [pool.submit(run, k, *args) for k in range(1, len(self._slices))]
        run(0, *args)
        for f in futures:
            f.result()

    def step_rows(
        self,
        r: float,
        t: int,
        x: Array,
        g: Array,
        v: Array | None,
        h: Array | None,
        indices: Array,
        row: int,
    ) -> bool:
        """One ONNX step in place on the rows ``indices`` (unique) of the flat
        (rows, row) tensors X, V, H, with G holding one row per index, in one fused
        pass. False, touching nothing, when there is no fused row kernel (the caller
        gathers the rows and calls ``step``): the same bits either way."""
        if self._later:
            self._loaded_yet()
        kernel = self._row_kernel
        arrays = [a for a in (x, g, v, h) if a is not None]
        if kernel is None or not all(
            a.flags.c_contiguous and a.flags.aligned and a.dtype == self.dtype
            for a in arrays
        ):
            return False
        c = coefficients(self.attrs, float(r), int(t), self.dtype)
        idx = indices.view()
        idx.flags.writeable = False  # one compiled variant, whatever the caller's
        compiled = len(getattr(kernel, "overloads", ()))
        kernel(*arrays, idx, row, *_fused_scalars(self.attrs.op, c, self.dtype))
        if len(getattr(kernel, "overloads", ())) != compiled:  # its first call
            page_out()  # LLVM's code, not needed again until a compile
        return True

    def step_in_order(
        self,
        r: float,
        t: int,
        xs: Sequence[Array],
        gs: Sequence[Array],
        vs: Sequence[Array] | None,
        hs: Sequence[Array] | None,
        done: Callable[[int, int, int], None],
    ) -> None:
        """``step``, calling ``done(i, start, stop)`` as soon as elements
        ``start:stop`` of tensor ``i`` are final, blocks in order (the same blocks
        and kernels as ``step``, so the same bits). The threads take one block each
        at a time; ``done`` runs on the caller's thread between them."""
        if self._later:
            self._loaded_yet()
        c = coefficients(self.attrs, float(r), int(t), self.dtype)
        run = self._run if self._kernel is None else self._run_fused
        width = len(self._slices)
        pool = _shared_pool() if width > 1 else None
        for k in range(0, len(self._blocks), width):
            wave = self._blocks[k : k + width]
            futures = [
                pool.submit(run, j, c, xs, gs, vs, hs, [block])
                for j, block in enumerate(wave[1:], start=1)
                if pool is not None
            ]
            run(0, c, xs, gs, vs, hs, wave[:1])
            for f in futures:
                f.result()
            for i, a, b in wave:
                done(i, a, b)

    def _run(
        self,
        slot: int,
        c: dict[str, Any],
        xs: Sequence[Array],
        gs: Sequence[Array],
        vs: Sequence[Array] | None,
        hs: Sequence[Array] | None,
        blocks: Sequence[Block] | None = None,
    ) -> None:
        # NaN/inf in, NaN/inf out, as IEEE says and the operator is defined: no
        # RuntimeWarning (an error under filterwarnings=error). errstate is
        # per-thread, hence here, where every pool thread runs.
        with np.errstate(all="ignore"):
            for block in self._slices[slot] if blocks is None else blocks:
                self._run_block(slot, c, xs, gs, vs, hs, block)

    def _run_block(
        self,
        slot: int,
        c: dict[str, Any],
        xs: Sequence[Array],
        gs: Sequence[Array],
        vs: Sequence[Array] | None,
        hs: Sequence[Array] | None,
        block: Block,
    ) -> None:
        scratch = self._scratch[slot]
        if scratch is None:
            scratch = self._scratch[slot] = self._new_scratch()
        i, a, b = block
        n = b - a
        self._fn(
            c,
            xs[i][a:b],
            gs[i][a:b],
            vs[i][a:b] if vs is not None else None,
            hs[i][a:b] if hs is not None else None,
            scratch[0, :n],
            scratch[1, :n],
        )

    def _run_fused(
        self,
        slot: int,
        c: dict[str, Any],
        xs: Sequence[Array],
        gs: Sequence[Array],
        vs: Sequence[Array] | None,
        hs: Sequence[Array] | None,
        blocks: Sequence[Block] | None = None,
    ) -> None:
        kernel = self._kernel
        assert kernel is not None
        scalars = _fused_scalars(self.attrs.op, c, self.dtype)
        tensors = [a for a in (xs, gs, vs, hs) if a is not None]
        for block in self._slices[slot] if blocks is None else blocks:
            i, a, b = block
            try:
                kernel(*[arrays[i] for arrays in tensors], a, b, *scalars)
            except TypeError:  # a strided or unaligned view: the NumPy block
                with np.errstate(all="ignore"):
                    self._run_block(slot, c, xs, gs, vs, hs, block)


def _compiled_kernel(path: str, op: str) -> Callable[..., None] | None:
    kernels = fused_kernels() if path == "numba" else None
    return None if kernels is None else kernels.get(op)


def _fused_scalars(op: str, c: dict[str, Any], dtype: np.dtype[Any]) -> tuple[Any, ...]:
    """The fused kernel's scalar arguments: ``c`` in its order, skips as flags."""
    zero = dtype.type(0)
    nc = c["nc"]
    head = (zero if nc is None else nc, nc is not None)
    if op == "Adagrad":
        return (*head, c["r"], c["eps"])
    if op == "Momentum":
        return (*head, c["alpha"], c["beta"], c["r"], c["nesterov"])
    post = c["post"]
    return (
        *head,
        c["alpha"],
        c["one_minus_alpha"],
        c["beta"],
        c["one_minus_beta"],
        c["eps"],
        c["r"],
        zero if post is None else post,
        post is not None,
    )
