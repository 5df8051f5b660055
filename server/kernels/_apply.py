"""``apply_onnx``: one ONNX training node, functional, with full input validation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ._attrs import OptimizerAttrs, make_attrs
from ._fused import Stepper

__all__ = ["STATE_DTYPES", "apply_onnx", "check_scalars", "split_inputs"]

STATE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

Array = np.ndarray[Any, Any]


def check_scalars(r: Any, t: Any) -> tuple[float, int]:
    """R (float32/float64 scalar) and T (int64 scalar, >= 0) as Python numbers."""
    r_arr = np.asarray(r)
    t_arr = np.asarray(t)
    if r_arr.dtype not in STATE_DTYPES:
        raise InvalidArgument(f"R must be float32 or float64, got {r_arr.dtype}")
    if r_arr.shape != ():
        raise InvalidArgument(f"R must be a scalar (shape ()), got shape {r_arr.shape}")
    if t_arr.dtype != np.int64:
        raise InvalidArgument(f"T must be int64, got {t_arr.dtype}")
    if t_arr.shape != ():
        raise InvalidArgument(f"T must be a scalar (shape ()), got shape {t_arr.shape}")
    t_val = int(t_arr)
    if t_val < 0:
        raise InvalidArgument(
            f"T counts the updates already applied: >= 0, got {t_val}"
        )
    return float(r_arr), t_val


def split_inputs(
    attrs: OptimizerAttrs, inputs: Sequence[Any]
) -> tuple[list[Array], list[Array], list[list[Array]]]:
    """Split ``X..., G..., V..., H...`` (R and T removed) and check their agreement.

    Returns (xs, gs, states) with ``states`` in the operator's order (V, H).
    """
    k = 2 + len(attrs.state_names)
    names = ["X", "G", *attrs.state_names]
    count = len(inputs)
    if count == 0 or count % k:
        raise InvalidArgument(
            f"{attrs.op} takes R, T and then {k} tensors per optimized tensor "
            f"({', '.join(names)}): 2 + {k}*n inputs with n >= 1, got {count + 2}"
        )
    n = count // k
    arrays = [np.asarray(a) for a in inputs]
    dtype = arrays[0].dtype
    if dtype not in STATE_DTYPES:
        raise InvalidArgument(f"X_1 must be float32 or float64, got {dtype}")
    for j, a in enumerate(arrays):
        name = f"{names[j // n]}_{j % n + 1}"
        if a.dtype != dtype:
            raise InvalidArgument(
                f"all of X, G, V, H must share one dtype: X_1 is {dtype}, "
                f"{name} is {a.dtype}"
            )
        x_shape = arrays[j % n].shape
        if a.shape != x_shape:
            raise InvalidArgument(
                f"{name} must have the shape of X_{j % n + 1}, {x_shape}, got {a.shape}"
            )
    groups = [arrays[i * n : (i + 1) * n] for i in range(k)]
    return groups[0], groups[1], groups[2:]


def apply_onnx(
    op: str, attrs: Mapping[str, Any] | OptimizerAttrs | None, inputs: Sequence[Any]
) -> list[Array]:
    """Execute one ONNX ``ai.onnx.preview.training`` node.

    ``inputs`` is the ONNX input list ``R, T, X..., G..., V..., H...``; the result is
    the ONNX output list ``X_new..., V_new..., H_new...`` with the dtype of the state
    tensors. The inputs are never mutated.
    """
    spec = attrs if not isinstance(attrs, Mapping) and attrs is not None else None
    if spec is None:
        spec = make_attrs(op, attrs)  # type: ignore[arg-type]
    elif spec.op != op:
        raise InvalidArgument(f"attributes are for {spec.op}, operator is {op}")
    if len(inputs) < 2:
        raise InvalidArgument(
            f"{op} takes R, T and then the tensors: got {len(inputs)} inputs"
        )
    r, t = check_scalars(inputs[0], inputs[1])
    xs, gs, states = split_inputs(spec, inputs[2:])
    shapes = [x.shape for x in xs]
    new_x = [np.array(x, order="C", copy=True).reshape(-1) for x in xs]
    flat_g = [np.ascontiguousarray(g).reshape(-1) for g in gs]
    new_states = [
        [np.array(s, order="C", copy=True).reshape(-1) for s in group]
        for group in states
    ]
    by_name = dict(zip(spec.state_names, new_states, strict=True))
    stepper = Stepper(spec, xs[0].dtype, [x.size for x in new_x])
    stepper.step(r, t, new_x, flat_g, by_name.get("V"), by_name.get("H"))
    outs = new_x + [s for group in new_states for s in group]
    return [o.reshape(shapes[i % len(shapes)]) for i, o in enumerate(outs)]
