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


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether an input of ``shape`` broadcasts to ``target`` without enlarging it.

    The ONNX operators are element-wise with NumPy broadcasting and their outputs
    have X's shape: G (3,) or (1, 3) fits X (2, 3); G (2, 3) does not fit X (3,),
    since it would broadcast X itself.
    """
    if len(shape) > len(target):
        return False
    tail = target[len(target) - len(shape) :]
    return all(d in (1, t) for d, t in zip(shape, tail, strict=True))


def split_inputs(
    attrs: OptimizerAttrs, inputs: Sequence[Any]
) -> tuple[list[Array], list[Array], list[list[Array]]]:
    """Split ``X..., G..., V..., H...`` (R and T removed) and check their agreement.

    One dtype for all; each G_i, V_i, H_i has X_i's shape or broadcasts to it.
    Returns (xs, gs, states), unexpanded, with ``states`` in the operator's order
    (V, H).
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
        if not _broadcasts_to(a.shape, x_shape):
            raise InvalidArgument(
                f"{name} must have the shape of X_{j % n + 1}, {x_shape}, or a shape "
                f"that broadcasts to it, got {a.shape}"
            )
    groups = [arrays[i * n : (i + 1) * n] for i in range(k)]
    return groups[0], groups[1], groups[2:]


def apply_onnx(
    op: str,
    attrs: Mapping[str, Any] | OptimizerAttrs | None,
    inputs: Sequence[Any],
    *,
    kernels: str | None = None,
) -> list[Array]:
    """Execute one ONNX ``ai.onnx.preview.training`` node.

    ``inputs`` is the ONNX input list ``R, T, X..., G..., V..., H...``; the result is
    the ONNX output list ``X_new..., V_new..., H_new...`` with the dtype of the state
    tensors and the shapes of X: G_i, V_i, H_i may broadcast to X_i's shape, as the
    operators' element-wise arithmetic does. The inputs are never mutated.
    ``kernels`` chooses the ``Stepper`` path (same bits either way).
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
    # A broadcasting input is expanded to X's shape first: every element then
    # meets the same operations in the same order as under NumPy broadcasting, so
    # the fused kernels stay bit-exact.
    flat_g = [
        np.ascontiguousarray(np.broadcast_to(g, shape)).reshape(-1)
        for g, shape in zip(gs, shapes, strict=True)
    ]
    new_states = [
        [
            np.array(np.broadcast_to(s, shape), order="C", copy=True).reshape(-1)
            for s, shape in zip(group, shapes, strict=True)
        ]
        for group in states
    ]
    by_name = dict(zip(spec.state_names, new_states, strict=True))
    stepper = Stepper(spec, xs[0].dtype, [x.size for x in new_x], kernels=kernels)
    stepper.step(r, t, new_x, flat_g, by_name.get("V"), by_name.get("H"))
    outs = new_x + [s for group in new_states for s in group]
    return [o.reshape(shapes[i % len(shapes)]) for i, o in enumerate(outs)]
