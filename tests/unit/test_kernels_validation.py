"""Every input the kernels refuse, each with the message that says why."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from kernel_paths import each_kernel_path  # noqa: F401
from onnxps.server.errors import InvalidArgument
from onnxps.server.kernels import (
    AdagradAttrs,
    AdamAttrs,
    MomentumAttrs,
    Stepper,
    apply_onnx,
    coefficients,
    make_attrs,
)

MOMENTUM = {"alpha": 0.9, "beta": 0.1, "mode": "standard", "norm_coefficient": 0.0}
STATE_COUNT = {"Adagrad": 1, "Momentum": 1, "Adam": 2}
ATTRS = {"Adagrad": {}, "Momentum": MOMENTUM, "Adam": {}}


def vec(*values: float, dtype: Any = np.float32) -> np.ndarray[Any, Any]:
    return np.array(values, dtype=dtype)


def inputs_for(op: str, n: int = 1, dtype: Any = np.float32) -> list[Any]:
    tensors = [vec(*range(1, i + 2), dtype=dtype) for i in range(n)]
    return [np.float32(0.1), np.int64(0)] + tensors * (2 + STATE_COUNT[op])


def test_invalid_argument_is_a_value_error() -> None:
    assert issubclass(InvalidArgument, ValueError)


# -- input count ---------------------------------------------------------------------


def test_adam_with_seven_inputs() -> None:
    inputs = inputs_for("Adam")
    inputs.append(vec(1.0))
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            "Adam takes R, T and then 4 tensors per optimized tensor (X, G, V, H): "
            "2 + 4*n inputs with n >= 1, got 7"
        ),
    ):
        apply_onnx("Adam", {}, inputs)


@pytest.mark.parametrize(
    ("op", "count", "names"),
    [
        ("Adagrad", 4, "X, G, H"),
        ("Adagrad", 6, "X, G, H"),
        ("Momentum", 7, "X, G, V"),
        ("Adam", 9, "X, G, V, H"),
        ("Adam", 11, "X, G, V, H"),
    ],
)
def test_input_count_not_two_plus_k_n(op: str, count: int, names: str) -> None:
    inputs = [np.float32(0.1), np.int64(0)] + [vec(1.0)] * (count - 2)
    k = 2 + STATE_COUNT[op]
    with pytest.raises(
        InvalidArgument, match=re.escape(f"({names}): 2 + {k}*n inputs with n >= 1")
    ) as info:
        apply_onnx(op, ATTRS[op], inputs)
    assert str(info.value).endswith(f"got {count}")


@pytest.mark.parametrize("op", ["Adagrad", "Momentum", "Adam"])
def test_no_tensors_at_all(op: str) -> None:
    with pytest.raises(InvalidArgument, match="n >= 1, got 2$"):
        apply_onnx(op, ATTRS[op], [np.float32(0.1), np.int64(0)])


@pytest.mark.parametrize("count", [0, 1])
def test_fewer_than_r_and_t(count: int) -> None:
    inputs = [np.float32(0.1), np.int64(0)][:count]
    with pytest.raises(
        InvalidArgument, match=f"Adam takes R, T and then the tensors: got {count}"
    ):
        apply_onnx("Adam", {}, inputs)


# -- dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize("position", [3, 4, 5])
def test_mixed_state_dtypes(position: int) -> None:
    inputs = inputs_for("Adam")
    inputs[position] = inputs[position].astype(np.float64)
    name = {3: "G_1", 4: "V_1", 5: "H_1"}[position]
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            f"all of X, G, V, H must share one dtype: X_1 is float32, {name} is float64"
        ),
    ):
        apply_onnx("Adam", {}, inputs)


def test_mixed_dtypes_across_tensors() -> None:
    inputs = inputs_for("Momentum", n=2)
    inputs[3] = inputs[3].astype(np.float64)  # X_2
    with pytest.raises(InvalidArgument, match="X_1 is float32, X_2 is float64"):
        apply_onnx("Momentum", MOMENTUM, inputs)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64, np.complex64])
def test_unsupported_state_dtype(dtype: Any) -> None:
    inputs = inputs_for("Adagrad", dtype=dtype)
    name = np.dtype(dtype).name
    with pytest.raises(
        InvalidArgument, match=f"^X_1 must be float32 or float64, got {name}$"
    ):
        apply_onnx("Adagrad", {}, inputs)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.int64])
def test_unsupported_r_dtype(dtype: Any) -> None:
    inputs = inputs_for("Adagrad")
    inputs[0] = np.array(1, dtype=dtype)
    name = np.dtype(dtype).name
    with pytest.raises(
        InvalidArgument, match=f"^R must be float32 or float64, got {name}$"
    ):
        apply_onnx("Adagrad", {}, inputs)


@pytest.mark.parametrize("dtype", [np.int32, np.uint64, np.float64, np.bool_])
def test_t_not_int64(dtype: Any) -> None:
    inputs = inputs_for("Adam")
    inputs[1] = np.array(1, dtype=dtype)
    name = np.dtype(dtype).name
    with pytest.raises(InvalidArgument, match=f"^T must be int64, got {name}$"):
        apply_onnx("Adam", {}, inputs)


# -- shapes and scalars ----------------------------------------------------------------


@pytest.mark.parametrize(("position", "name"), [(3, "G_1"), (4, "V_1"), (5, "H_1")])
def test_state_shape_differs_from_x(position: int, name: str) -> None:
    inputs = inputs_for("Adam")
    inputs[position] = vec(1.0, 2.0, 3.0)
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            f"{name} must have the shape of X_1, (1,), or a shape that broadcasts "
            "to it, got (3,)"
        ),
    ):
        apply_onnx("Adam", {}, inputs)


def test_shape_mismatch_names_the_second_tensor() -> None:
    inputs = inputs_for("Adagrad", n=2)  # X_1 (1,), X_2 (2,)
    inputs[7] = np.zeros((2, 1), np.float32)  # H_2
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            "H_2 must have the shape of X_2, (2,), or a shape that broadcasts to it, "
            "got (2, 1)"
        ),
    ):
        apply_onnx("Adagrad", {}, inputs)


def test_scalar_against_one_element_vector_is_a_mismatch() -> None:
    inputs = inputs_for("Momentum")
    inputs[2] = np.float32(1.0)  # X_1 is 0-d, G_1 has shape (1,)
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            "G_1 must have the shape of X_1, (), or a shape that broadcasts to it, "
            "got (1,)"
        ),
    ):
        apply_onnx("Momentum", MOMENTUM, inputs)


@pytest.mark.parametrize("shape", [(1,), (2,), (1, 1)])
def test_r_not_a_scalar(shape: tuple[int, ...]) -> None:
    inputs = inputs_for("Adam")
    inputs[0] = np.full(shape, 0.1, np.float32)
    with pytest.raises(
        InvalidArgument,
        match=re.escape(f"R must be a scalar (shape ()), got shape {shape}"),
    ):
        apply_onnx("Adam", {}, inputs)


@pytest.mark.parametrize("shape", [(1,), (0,), (2, 1)])
def test_t_not_a_scalar(shape: tuple[int, ...]) -> None:
    inputs = inputs_for("Adam")
    inputs[1] = np.zeros(shape, np.int64)
    with pytest.raises(
        InvalidArgument,
        match=re.escape(f"T must be a scalar (shape ()), got shape {shape}"),
    ):
        apply_onnx("Adam", {}, inputs)


@pytest.mark.parametrize("t", [-1, -(2**63)])
def test_negative_t(t: int) -> None:
    inputs = inputs_for("Adagrad")
    inputs[1] = np.int64(t)
    with pytest.raises(
        InvalidArgument, match=f"T counts the updates already applied: >= 0, got {t}$"
    ):
        apply_onnx("Adagrad", {}, inputs)


# -- attributes ------------------------------------------------------------------------


def test_unknown_operator() -> None:
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            "unknown operator 'Sgd': expected one of Adagrad, Momentum, Adam"
        ),
    ):
        apply_onnx("Sgd", {}, inputs_for("Adagrad"))


def test_operator_names_are_case_sensitive() -> None:
    with pytest.raises(InvalidArgument, match="unknown operator 'adam'"):
        make_attrs("adam", {})


def test_unknown_attribute() -> None:
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            "Adam has no attribute 'gamma': expected only alpha, beta, epsilon, "
            "norm_coefficient, norm_coefficient_post"
        ),
    ):
        apply_onnx("Adam", {"gamma": 0.5}, inputs_for("Adam"))


def test_attribute_of_another_operator() -> None:
    with pytest.raises(InvalidArgument, match="Adagrad has no attribute 'mode'"):
        make_attrs("Adagrad", {"mode": "standard"})


def test_several_unknown_attributes_are_all_named() -> None:
    with pytest.raises(InvalidArgument, match="Adagrad has no attribute 'a', 'b':"):
        make_attrs("Adagrad", {"b": 1.0, "a": 1.0})


@pytest.mark.parametrize("mode", ["Nesterov", "momentum", "", b"nesterov", None])
def test_bad_momentum_mode(mode: Any) -> None:
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            f"Momentum mode must be 'standard' or 'nesterov', got {mode!r}"
        ),
    ):
        apply_onnx("Momentum", {**MOMENTUM, "mode": mode}, inputs_for("Momentum"))


@pytest.mark.parametrize("missing", ["alpha", "beta", "mode", "norm_coefficient"])
def test_missing_momentum_attribute(missing: str) -> None:
    attrs = {k: v for k, v in MOMENTUM.items() if k != missing}
    with pytest.raises(
        InvalidArgument, match=re.escape(f"Momentum attribute {missing!r} is required")
    ):
        apply_onnx("Momentum", attrs, inputs_for("Momentum"))


def test_momentum_without_attributes() -> None:
    with pytest.raises(InvalidArgument, match="Momentum attribute 'alpha' is required"):
        make_attrs("Momentum", None)


@pytest.mark.parametrize("op", ["Adagrad", "Adam"])
@pytest.mark.parametrize("epsilon", [-1e-6, -1.0])
def test_negative_epsilon(op: str, epsilon: float) -> None:
    with pytest.raises(
        InvalidArgument, match=re.escape(f"{op} epsilon must be >= 0, got {epsilon!r}")
    ):
        apply_onnx(op, {"epsilon": epsilon}, inputs_for(op))


def test_zero_epsilon_is_allowed() -> None:
    attrs = make_attrs("Adagrad", {"epsilon": 0.0})
    assert isinstance(attrs, AdagradAttrs) and attrs.epsilon == 0.0


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize(
    ("op", "name"),
    [
        ("Adagrad", "decay_factor"),
        ("Adagrad", "epsilon"),
        ("Momentum", "alpha"),
        ("Momentum", "norm_coefficient"),
        ("Adam", "beta"),
        ("Adam", "norm_coefficient_post"),
    ],
)
def test_non_finite_attribute(op: str, name: str, value: float) -> None:
    attrs = {**ATTRS[op], name: value}
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            f"{op} attribute {name!r} must be finite as a float32, got {value!r}"
        ),
    ):
        apply_onnx(op, attrs, inputs_for(op))


@pytest.mark.parametrize(
    ("value", "shown"), [(1e39, "1e+39"), (-(10**400), "-inf"), (10**400, "inf")]
)
def test_attribute_overflowing_float32(value: float, shown: str) -> None:
    """1e39 is finite in float64 but inf once stored as an ONNX FLOAT."""
    with pytest.raises(
        InvalidArgument,
        match=re.escape(f"'decay_factor' must be finite as a float32, got {shown}"),
    ):
        make_attrs("Adagrad", {"decay_factor": value})


def test_largest_float32_attribute_is_accepted() -> None:
    largest = float(np.finfo(np.float32).max)
    attrs = make_attrs("Adagrad", {"decay_factor": largest})
    assert isinstance(attrs, AdagradAttrs) and attrs.decay_factor == largest


@pytest.mark.parametrize("value", ["0.9", None, True, [0.9], np.array([0.9])])
def test_attribute_not_a_float(value: Any) -> None:
    with pytest.raises(
        InvalidArgument,
        match=re.escape(
            f"Adam attribute 'alpha' must be a float, got {type(value).__name__}"
        ),
    ):
        make_attrs("Adam", {"alpha": value})


def test_integer_and_numpy_attributes_are_floats() -> None:
    attrs = make_attrs("Adam", {"alpha": 1, "beta": np.float64(0.5)})
    assert isinstance(attrs, AdamAttrs)
    assert (attrs.alpha, attrs.beta) == (1.0, 0.5)


def test_attributes_for_another_operator() -> None:
    with pytest.raises(
        InvalidArgument, match="^attributes are for Adam, operator is Adagrad$"
    ):
        apply_onnx("Adagrad", AdamAttrs(), inputs_for("Adagrad"))


def test_attributes_are_stored_as_float32() -> None:
    attrs = make_attrs("Momentum", {**MOMENTUM, "alpha": 0.9})
    assert attrs == MomentumAttrs(
        0.8999999761581421, 0.10000000149011612, "standard", 0.0
    )
    assert make_attrs("Adam") == AdamAttrs()
    assert AdamAttrs().beta == 0.9990000128746033


# -- step coefficients that do not exist -----------------------------------------------


@pytest.mark.parametrize(
    ("op", "attrs", "t", "cause"),
    [
        ("Adam", {"alpha": 1.0}, 1, "float division by zero"),
        ("Adagrad", {"decay_factor": -0.5}, 2, "float division by zero"),
        ("Adam", {"beta": 2.0}, 1, "math domain error"),
        ("Adam", {"beta": 2.0}, 4000, "out of range"),
    ],
)
def test_undefined_step_coefficient(
    op: str, attrs: dict[str, Any], t: int, cause: str
) -> None:
    inputs = inputs_for(op)
    inputs[1] = np.int64(t)
    with pytest.raises(
        InvalidArgument,
        match=rf"^{op} step coefficients are undefined at T={t} .*{cause}",
    ):
        apply_onnx(op, attrs, inputs)


def test_adam_alpha_one_is_fine_at_t_zero() -> None:
    inputs = inputs_for("Adam")
    x_new, v_new, h_new = apply_onnx("Adam", {"alpha": 1.0}, inputs)
    assert v_new[0] == inputs[4][0]  # V_new = 1 * V + 0 * G


@pytest.mark.parametrize("r", [1e39, float("inf"), float("nan")])
def test_learning_rate_not_finite_in_state_dtype(r: float) -> None:
    inputs = inputs_for("Momentum")
    inputs[0] = np.float64(r)
    with pytest.raises(
        InvalidArgument,
        match=r"^Momentum step coefficient 'r' is .* not finite in float32$",
    ):
        apply_onnx("Momentum", MOMENTUM, inputs)


def test_learning_rate_beyond_float32_is_fine_for_float64_state() -> None:
    inputs = inputs_for("Momentum", dtype=np.float64)
    inputs[0] = np.float64(1e39)
    x_new, v_new = apply_onnx("Momentum", MOMENTUM, inputs)
    assert x_new[0] == 1.0 - 1e39 * v_new[0]


def test_adam_bias_correction_overflowing_float32() -> None:
    """R_adjusted = R sqrt(1 - b) / (1 - a) is about 2.6e5 R at T = 1 here."""
    attrs = make_attrs("Adam", {"alpha": 1 - 2**-23})
    assert isinstance(attrs, AdamAttrs)
    assert attrs.alpha == 1 - 2**-23
    with pytest.raises(
        InvalidArgument,
        match=r"^Adam step coefficient 'r' is 2\.6\d*e\+39 at T=1 with R=1e\+34: "
        "not finite in float32$",
    ):
        coefficients(attrs, 1e34, 1, np.dtype(np.float32))
    assert np.isfinite(coefficients(attrs, 1e34, 1, np.dtype(np.float64))["r"])


def test_stepper_refuses_before_touching_state() -> None:
    attrs = make_attrs("Adam", {"alpha": 1.0})
    x, g, v, h = (vec(1.0, 2.0) for _ in range(4))
    before = [a.copy() for a in (x, g, v, h)]
    stepper = Stepper(attrs, np.float32, [2])
    with pytest.raises(InvalidArgument, match="undefined at T=3"):
        stepper.step(0.1, 3, [x], [g], [v], [h])
    for a, b in zip((x, g, v, h), before, strict=True):
        assert np.array_equal(a, b)


# -- validation happens before anything else -------------------------------------------


def test_attribute_errors_come_before_input_errors() -> None:
    with pytest.raises(InvalidArgument, match="no attribute 'gamma'"):
        apply_onnx("Adam", {"gamma": 1.0}, [])
