"""The three ONNX training operators transcribed line by line, and the official tests.

An independent oracle for the kernels: it imports nothing from onnxps, and only NumPy
outside the node-test loader. Every function is the operator page's pseudo-code, one
expression per line, each allocating its result: easy to check against the spec, and
the naive baseline in ``benchmarks/kernels.py``.

Two precisions:

- ``EMULATE`` computes in the dtype of the state tensors as an ONNX runtime does: each
  scalar coefficient (``r``, ``1 - alpha``, ``R_adjusted``...) is computed in float64
  and rounded once to the state dtype, and every array operation runs in the state
  dtype. Float32 results can then be compared bit for bit.
- ``FLOAT64`` computes everything in float64 from the exact input values, with the
  attribute values exactly as given.

Every operation is NumPy's own, so G, V and H broadcast against X exactly as the
operators define (``run`` checks that they broadcast to X's shape, which the outputs
then have).

Operations are grouped as the ONNX reference implementation groups them (Adam:
``(1 - beta) * (G * G)`` and ``R_adjusted * (V_new / H_sqrt)``). ``literal=True``
groups them strictly left to right as the pseudo-code is written instead, which
differs for Adam only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DEFAULTS",
    "EMULATE",
    "FLOAT64",
    "NODE_TESTS",
    "NodeTest",
    "adagrad",
    "adam",
    "f32",
    "load_node_test",
    "momentum",
    "node_tests_dir",
    "run",
    "state_count",
]

Array = np.ndarray[Any, Any]

EMULATE = "emulate"
FLOAT64 = "float64"

NODE_TESTS = (
    "test_adagrad",
    "test_adagrad_multiple",
    "test_adam",
    "test_adam_multiple",
    "test_momentum",
    "test_momentum_multiple",
    "test_nesterov_momentum",
)


def f32(value: float) -> float:
    """``value`` rounded to float32, as ONNX stores a FLOAT attribute."""
    return float(np.float32(value))


# The operator schemas' defaults, as stored (float32). Momentum has none.
DEFAULTS: dict[str, dict[str, Any]] = {
    "Adagrad": {"epsilon": f32(1e-6), "decay_factor": 0.0, "norm_coefficient": 0.0},
    "Momentum": {},
    "Adam": {
        "alpha": f32(0.9),
        "beta": f32(0.999),
        "epsilon": f32(1e-6),
        "norm_coefficient": 0.0,
        "norm_coefficient_post": 0.0,
    },
}


def state_count(op: str) -> int:
    """How many state tensors (V, H) each optimized tensor carries."""
    return {"Adagrad": 1, "Momentum": 1, "Adam": 2}[op]


@dataclass(frozen=True)
class _Arithmetic:
    """Where a transcription computes: the array dtype and how scalars round."""

    dtype: np.dtype[Any]

    def scalar(self, value: float) -> np.floating[Any]:
        scalar: np.floating[Any] = self.dtype.type(value)
        return scalar

    def tensor(self, value: Any) -> Array:
        return np.asarray(value, dtype=self.dtype)


def _arithmetic(precision: str, state_dtype: np.dtype[Any]) -> _Arithmetic:
    if precision == EMULATE:
        return _Arithmetic(np.dtype(state_dtype))
    if precision == FLOAT64:
        return _Arithmetic(np.dtype(np.float64))
    raise ValueError(f"precision must be {EMULATE!r} or {FLOAT64!r}: {precision!r}")


def adagrad(
    R: float,
    T: int,
    X: Array,
    G: Array,
    H: Array,
    *,
    epsilon: float,
    decay_factor: float,
    norm_coefficient: float,
    precision: str = EMULATE,
) -> tuple[Array, Array]:
    k = _arithmetic(precision, X.dtype)
    X, G, H = k.tensor(X), k.tensor(G), k.tensor(H)
    r = k.scalar(R / (1 + T * decay_factor))
    G_regularized = k.scalar(norm_coefficient) * X + G
    H_new = H + G_regularized * G_regularized
    H_adaptive = np.sqrt(H_new) + k.scalar(epsilon)
    X_new = X - r * G_regularized / H_adaptive
    return k.tensor(X_new), k.tensor(H_new)


def momentum(
    R: float,
    T: int,
    X: Array,
    G: Array,
    V: Array,
    *,
    alpha: float,
    beta: float,
    mode: str,
    norm_coefficient: float,
    precision: str = EMULATE,
) -> tuple[Array, Array]:
    k = _arithmetic(precision, X.dtype)
    X, G, V = k.tensor(X), k.tensor(G), k.tensor(V)
    G_regularized = k.scalar(norm_coefficient) * X + G
    beta_adjusted = k.scalar(beta if T > 0 else 1)
    V_new = k.scalar(alpha) * V + beta_adjusted * G_regularized
    if mode == "standard":
        X_new = X - k.scalar(R) * V_new
    elif mode == "nesterov":
        X_new = X - k.scalar(R) * (G_regularized + k.scalar(alpha) * V_new)
    else:
        raise ValueError(f"mode must be 'standard' or 'nesterov': {mode!r}")
    return k.tensor(X_new), k.tensor(V_new)


def adam(
    R: float,
    T: int,
    X: Array,
    G: Array,
    V: Array,
    H: Array,
    *,
    alpha: float,
    beta: float,
    epsilon: float,
    norm_coefficient: float,
    norm_coefficient_post: float,
    precision: str = EMULATE,
    literal: bool = False,
) -> tuple[Array, Array, Array]:
    k = _arithmetic(precision, X.dtype)
    X, G, V, H = k.tensor(X), k.tensor(G), k.tensor(V), k.tensor(H)
    G_regularized = k.scalar(norm_coefficient) * X + G
    V_new = k.scalar(alpha) * V + k.scalar(1 - alpha) * G_regularized
    if literal:
        H_new = k.scalar(beta) * H + k.scalar(1 - beta) * G_regularized * G_regularized
    else:
        H_new = k.scalar(beta) * H + k.scalar(1 - beta) * (
            G_regularized * G_regularized
        )
    H_sqrt = np.sqrt(H_new) + k.scalar(epsilon)
    if T > 0:
        R_adjusted = k.scalar(R * math.sqrt(1 - beta**T) / (1 - alpha**T))
    else:
        R_adjusted = k.scalar(R)
    if literal:
        X_new = X - R_adjusted * V_new / H_sqrt
    else:
        X_new = X - R_adjusted * (V_new / H_sqrt)
    X_final = k.scalar(1 - norm_coefficient_post) * X_new
    return k.tensor(X_final), k.tensor(V_new), k.tensor(H_new)


def run(
    op: str,
    attrs: Mapping[str, Any],
    inputs: Sequence[Any],
    *,
    precision: str = EMULATE,
    float32_attributes: bool = True,
    literal: bool = False,
) -> list[Array]:
    """One node: ``R, T, X..., G..., V..., H...`` in, ``X..., V..., H...`` out.

    Missing attributes take the schema defaults; FLOAT attributes are rounded to
    float32 as ONNX stores them unless ``float32_attributes`` is false. Several
    tensors are stepped one by one (the operators are element-wise). G_i, V_i, H_i
    may have any shape that NumPy broadcasts to X_i's; the outputs have X_i's.
    """
    values = {**DEFAULTS[op], **attrs}
    if float32_attributes:
        values = {
            name: value if isinstance(value, str) else f32(value)
            for name, value in values.items()
        }
    R = float(np.asarray(inputs[0]))
    T = int(np.asarray(inputs[1]))
    tensors = [np.asarray(a) for a in inputs[2:]]
    groups = 2 + state_count(op)
    if not tensors or len(tensors) % groups:
        raise ValueError(f"{op}: {len(inputs)} inputs is not 2 + {groups}*n")
    n = len(tensors) // groups
    per_tensor = [tensors[i::n] for i in range(n)]  # (X_i, G_i, V_i, H_i)
    for i, (x, *others) in enumerate(per_tensor):
        for other in others:
            _check_broadcast(op, i, x.shape, other.shape)
    results: list[tuple[Array, ...]]
    if op == "Adagrad":
        results = [adagrad(R, T, *t, **values, precision=precision) for t in per_tensor]
    elif op == "Momentum":
        results = [
            momentum(R, T, *t, **values, precision=precision) for t in per_tensor
        ]
    elif op == "Adam":
        results = [
            adam(R, T, *t, **values, precision=precision, literal=literal)
            for t in per_tensor
        ]
    else:
        raise ValueError(f"unknown operator {op!r}")
    return [result[j] for j in range(len(results[0])) for result in results]


def _check_broadcast(
    op: str, i: int, x_shape: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    try:
        joint = np.broadcast_shapes(x_shape, shape)
    except ValueError:
        joint = None
    if joint != x_shape:
        raise ValueError(
            f"{op}: a tensor of shape {shape} does not broadcast to X_{i + 1}'s "
            f"shape {x_shape}"
        )


@dataclass(frozen=True)
class NodeTest:
    """One official ONNX backend node test: a single node and one data set."""

    name: str
    op: str
    attrs: dict[str, Any]
    inputs: list[Array]
    outputs: list[Array]


def node_tests_dir() -> Path:
    """``tests/data/onnx-node-tests``: the official tests, with their license."""
    return Path(__file__).resolve().parent / "data" / "onnx-node-tests"


def _load_tensors(directory: Path, prefix: str) -> list[Array]:
    import onnx
    from onnx import numpy_helper

    paths = sorted(
        directory.glob(f"{prefix}_*.pb"),
        key=lambda p: int(p.stem.rsplit("_", 1)[1]),
    )
    return [numpy_helper.to_array(onnx.load_tensor(str(p))) for p in paths]


def load_node_test(name: str, root: Path | None = None) -> NodeTest:
    """The model's single node (op type, attributes with strings decoded) and data."""
    # Imported here so the transcriptions run (in benchmarks) without onnx installed.
    import onnx
    from onnx import helper

    directory = (root or node_tests_dir()) / name
    if not directory.is_dir():
        raise FileNotFoundError(
            f"official ONNX node test {name!r} not found at {directory}: expected one "
            f"of {', '.join(NODE_TESTS)} under tests/data/onnx-node-tests"
        )
    model = onnx.load(str(directory / "model.onnx"))
    (node,) = model.graph.node
    attrs: dict[str, Any] = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        attrs[attribute.name] = value.decode() if isinstance(value, bytes) else value
    data = directory / "test_data_set_0"
    return NodeTest(
        name=name,
        op=node.op_type,
        attrs=attrs,
        inputs=_load_tensors(data, "input"),
        outputs=_load_tensors(data, "output"),
    )
