"""Optimizer hyper-parameters: one small immutable record per ONNX operator.

ONNX stores FLOAT attributes as 32-bit floats, so every value is rounded to float32 on
the way in: ``alpha=0.9`` becomes 0.8999999761581421, as an ONNX runtime sees it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from ..errors import InvalidArgument

__all__ = [
    "OPERATORS",
    "AdagradAttrs",
    "AdamAttrs",
    "MomentumAttrs",
    "OptimizerAttrs",
    "make_attrs",
]


def f32(value: float) -> float:
    """``value`` rounded to the nearest float32, as ONNX stores a FLOAT attribute."""
    return float(np.float32(value))


@dataclass(frozen=True)
class AdagradAttrs:
    epsilon: float = f32(1e-6)
    decay_factor: float = 0.0
    norm_coefficient: float = 0.0

    op: ClassVar[str] = "Adagrad"
    state_names: ClassVar[tuple[str, ...]] = ("H",)
    non_negative_states: ClassVar[tuple[str, ...]] = ("H",)  # sums of squares


@dataclass(frozen=True)
class MomentumAttrs:
    alpha: float
    beta: float
    mode: str
    norm_coefficient: float

    op: ClassVar[str] = "Momentum"
    state_names: ClassVar[tuple[str, ...]] = ("V",)
    non_negative_states: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class AdamAttrs:
    alpha: float = f32(0.9)
    beta: float = f32(0.999)
    epsilon: float = f32(1e-6)
    norm_coefficient: float = 0.0
    norm_coefficient_post: float = 0.0

    op: ClassVar[str] = "Adam"
    state_names: ClassVar[tuple[str, ...]] = ("V", "H")
    non_negative_states: ClassVar[tuple[str, ...]] = ("H",)


OptimizerAttrs = AdagradAttrs | MomentumAttrs | AdamAttrs

OPERATORS: dict[str, type[AdagradAttrs] | type[MomentumAttrs] | type[AdamAttrs]] = {
    "Adagrad": AdagradAttrs,
    "Momentum": MomentumAttrs,
    "Adam": AdamAttrs,
}

_MOMENTUM_MODES = ("standard", "nesterov")


def make_attrs(op: str, attrs: Mapping[str, Any] | None = None) -> OptimizerAttrs:
    """Validate ONNX attributes by their ONNX names and fill in the schema defaults."""
    cls = OPERATORS.get(op)
    if cls is None:
        raise InvalidArgument(
            f"unknown operator {op!r}: expected one of {', '.join(OPERATORS)}"
        )
    given = dict(attrs or {})
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InvalidArgument(
            f"{op} has no attribute {', '.join(map(repr, unknown))}: "
            f"expected only {', '.join(names)}"
        )
    values: dict[str, Any] = {}
    for name in names:
        if name not in given:
            if cls is MomentumAttrs:
                raise InvalidArgument(
                    f"Momentum attribute {name!r} is required "
                    "(alpha, beta, mode and norm_coefficient have no default)"
                )
            continue
        value = given[name]
        if name == "mode":
            if value not in _MOMENTUM_MODES:
                raise InvalidArgument(
                    f"Momentum mode must be 'standard' or 'nesterov', got {value!r}"
                )
            values[name] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
            raise InvalidArgument(
                f"{op} attribute {name!r} must be a float, got {type(value).__name__}"
            )
        try:
            number = float(value)
        except OverflowError:  # an int beyond float64
            number = math.inf if value > 0 else -math.inf
        with np.errstate(over="ignore"):
            stored = f32(number)
        if not math.isfinite(stored):  # 1e39 is finite, but inf as a FLOAT
            raise InvalidArgument(
                f"{op} attribute {name!r} must be finite as a float32, got {number!r}"
            )
        if name == "epsilon" and number < 0:
            raise InvalidArgument(f"{op} epsilon must be >= 0, got {number!r}")
        values[name] = stored
    return cls(**values)
