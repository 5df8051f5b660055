"""Ids tables: their definition and the initial value of a row (NumPy only).

An ids table is a named table of rows of ``dim`` elements keyed by arbitrary int64
ids; a row exists once a push touches its id, and starts as ``initial_rows``. The
initial row of an id is a pure function of (initializer, table name, id), so every
server, a restart and a replay give the same row, and another language can compute
it. The function, exactly (all arithmetic on uint64, wrapping mod 2**64):

    splitmix64(x):  x += 0x9E3779B97F4A7C15
                    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
                    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
                    return x ^ (x >> 31)
    fnv1a64(bytes): h = 0xCBF29CE484222325; for b in bytes: h = (h ^ b) * 0x100000001B3
    key     = splitmix64(seed ^ fnv1a64(utf8(table name)))
    row(id) = splitmix64(key ^ id)            (id as its two's-complement uint64)
    word(id, n) = splitmix64(row(id) + n)
    unit(w) = (w >> 11) * 2**-53              a float64 in [0, 1)

- ``Zeros``: every element 0.
- ``Uniform(low, high)``: element j = low + (high - low) * unit(word(id, j)), in
  float64, then rounded to the table's dtype.
- ``Normal(mean, std)``: element j by Box-Muller from attempt k = 0, 1, ...:
  u1 = 1 - unit(word(id, 2 * (k * dim + j))), u2 = unit(word(id, 2 * (k * dim + j)
  + 1)), z = sqrt(-2 ln u1) * cos(2 pi u2); with ``truncated`` an attempt with |z| > 2
  is drawn again with the next k (as TensorFlow's truncated normal: within two
  standard deviations); element = mean + std * z in float64, then rounded to the
  dtype. (log, sqrt and cos are the platform's float64 libm: another libm may differ
  in the last bit of z.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "IdsTable",
    "Initializer",
    "Normal",
    "Uniform",
    "Zeros",
    "fnv1a64",
    "initial_rows",
    "initializer_from_json",
    "splitmix64",
]

Array = np.ndarray[Any, Any]
_U64 = np.uint64


@dataclass(frozen=True)
class Zeros:
    """Every new row is zeros."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "zeros"}


@dataclass(frozen=True)
class Uniform:
    """Every new row uniform in [low, high), seeded per (seed, table, id)."""

    low: float = -0.05
    high: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        _check_seed(self.seed)
        if not (np.isfinite(self.low) and np.isfinite(self.high)):
            raise ValueError(
                f"Uniform bounds must be finite, got {self.low}, {self.high}"
            )
        if self.low > self.high:
            raise ValueError(f"Uniform needs low <= high, got {self.low} > {self.high}")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "uniform",
            "low": self.low,
            "high": self.high,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Normal:
    """Every new row normal(mean, std), optionally truncated at two std."""

    mean: float = 0.0
    std: float = 0.01
    seed: int = 0
    truncated: bool = False

    def __post_init__(self) -> None:
        _check_seed(self.seed)
        if not (np.isfinite(self.mean) and np.isfinite(self.std)) or self.std < 0:
            raise ValueError(
                f"Normal needs a finite mean and a finite std >= 0, got {self.mean}, "
                f"{self.std}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "normal",
            "mean": self.mean,
            "std": self.std,
            "seed": self.seed,
            "truncated": self.truncated,
        }


Initializer = Zeros | Uniform | Normal


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(
            f"an initializer's seed must be an int in [0, 2**64), got {seed!r}"
        )


@dataclass(frozen=True)
class IdsTable:
    """A table keyed by arbitrary int64 ids (``create_group(..., tables=...)``).

    ``dim``: elements per row; ``initializer``: a new row's value; ``max_rows``: the
    most rows it may hold (0: no limit but the server's byte limits); ``dtype``: the
    group's (float32 or float64; None: that of the group's tensors, else float32).
    """

    dim: int
    initializer: Initializer = field(default_factory=Zeros)
    max_rows: int = 0
    dtype: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"an ids table needs dim >= 1, got {self.dim!r}")
        if not isinstance(self.initializer, (Zeros, Uniform, Normal)):
            raise TypeError(
                "initializer must be Zeros(), Uniform(...) or Normal(...), got "
                f"{self.initializer!r}"
            )
        if isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int):
            raise TypeError(f"max_rows must be an int, got {self.max_rows!r}")
        if self.max_rows < 0:
            raise ValueError(
                f"max_rows must be >= 0 (0: no limit), got {self.max_rows}"
            )


def initializer_from_json(doc: Mapping[str, Any]) -> Initializer:
    """The initializer of a ``to_json`` document; ValueError for another."""
    kind = doc.get("kind")
    if kind == "zeros":
        return Zeros()
    if kind == "uniform":
        return Uniform(float(doc["low"]), float(doc["high"]), int(doc["seed"]))
    if kind == "normal":
        return Normal(
            float(doc["mean"]),
            float(doc["std"]),
            int(doc["seed"]),
            bool(doc["truncated"]),
        )
    raise ValueError(f"unknown row initializer {kind!r}: zeros, uniform or normal")


def splitmix64(x: Array) -> Array:
    """SplitMix64's output function of uint64 values (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=_U64) + _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return np.asarray(z ^ (z >> _U64(31)), dtype=_U64)


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def _unit(words: Array) -> Array:
    return (words >> _U64(11)).astype(np.float64) * 2.0**-53


def initial_rows(
    init: Initializer, table: str, ids: Array, dim: int, dtype: Any
) -> Array:
    """The initial rows (len(ids), dim) of ``ids`` in table ``table`` (see above)."""
    ids = np.asarray(ids, dtype=np.int64)
    if isinstance(init, Zeros) or ids.size == 0:
        return np.zeros((ids.size, dim), dtype)
    seed = init.seed
    key = splitmix64(np.array([seed ^ fnv1a64(table.encode("utf-8"))], _U64))[0]
    rows = splitmix64(ids.view(_U64) ^ key)[:, None]  # (k, 1)
    cols = np.arange(dim, dtype=_U64)[None, :]
    with np.errstate(over="ignore"):
        if isinstance(init, Uniform):
            u = _unit(splitmix64(rows + cols))
            return np.asarray(init.low + (init.high - init.low) * u).astype(dtype)
        z = np.empty((ids.size, dim), np.float64)
        todo = np.ones((ids.size, dim), bool)
        k = 0
        while todo.any():
            n = _U64(2) * (_U64(k * dim) + cols)
            u1 = 1.0 - _unit(splitmix64(rows + n))
            u2 = _unit(splitmix64(rows + n + _U64(1)))
            draw = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
            take = todo & (np.abs(draw) <= 2.0) if init.truncated else todo
            z[take] = draw[take]
            todo &= ~take
            k += 1
    return np.asarray(init.mean + init.std * z).astype(dtype)
