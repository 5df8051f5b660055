"""``apply_onnx`` against the official ONNX node tests and the line-by-line reference.

Float32 results must equal the reference's float32 emulation bit for bit; float64
results must equal it bit for bit where the operations are grouped the same way.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx_reference as ref
import pytest
from kernel_paths import each_kernel_path  # noqa: F401
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnxps.server.errors import InvalidArgument
from onnxps.server.kernels import Stepper, apply_onnx, make_attrs

Array = np.ndarray[Any, Any]

TRAINING_DOMAIN = "ai.onnx.preview.training"

# Every non-default attribute appears in at least one configuration.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "adagrad-defaults": ("Adagrad", {}),
    "adagrad-decay": ("Adagrad", {"decay_factor": 0.1, "epsilon": 1e-8}),
    "adagrad-all": (
        "Adagrad",
        {"decay_factor": 0.25, "norm_coefficient": 0.01, "epsilon": 1e-5},
    ),
    "momentum-standard": (
        "Momentum",
        {"alpha": 0.9, "beta": 0.1, "mode": "standard", "norm_coefficient": 0.0},
    ),
    "momentum-standard-l2": (
        "Momentum",
        {"alpha": 0.95, "beta": 0.85, "mode": "standard", "norm_coefficient": 0.01},
    ),
    "momentum-nesterov": (
        "Momentum",
        {"alpha": 0.9, "beta": 1.0, "mode": "nesterov", "norm_coefficient": 0.0},
    ),
    "momentum-nesterov-l2": (
        "Momentum",
        {"alpha": 0.8, "beta": 0.5, "mode": "nesterov", "norm_coefficient": 0.02},
    ),
    "adam-defaults": ("Adam", {}),
    "adam-l2": ("Adam", {"norm_coefficient": 0.01}),
    "adam-post": ("Adam", {"norm_coefficient_post": 0.01}),
    "adam-all": (
        "Adam",
        {
            "alpha": 0.8,
            "beta": 0.95,
            "epsilon": 1e-7,
            "norm_coefficient": 0.001,
            "norm_coefficient_post": 0.02,
        },
    ),
}

SHAPE_SETS = {
    "one": [(5,)],
    "scalar+vector": [(), (7,)],
    "three": [(2, 3), (), (4, 1, 5)],
    "four-with-empty": [(3,), (2, 2), (), (0,)],
}

DTYPES = [np.float32, np.float64]


def make_inputs(
    op: str,
    shapes: list[tuple[int, ...]],
    dtype: Any,
    *,
    r: Any = 0.05,
    t: int = 0,
    seed: int = 0,
) -> list[Any]:
    """``R, T, X..., G..., V..., H...`` with non-negative H and values near 1."""
    rng = np.random.default_rng(seed)
    kinds = ["X", "G"] + {"Adagrad": ["H"], "Momentum": ["V"], "Adam": ["V", "H"]}[op]
    tensors = []
    for kind in kinds:
        for shape in shapes:
            a = rng.standard_normal(shape)
            if kind == "H":
                a = np.abs(a) + 0.01
            tensors.append(np.asarray(a, dtype=dtype))
    return [np.asarray(r, dtype=np.float32), np.array(t, dtype=np.int64), *tensors]


def assert_bit_exact(got: list[Array], expected: list[Array]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype
        assert g.shape == e.shape
        assert np.array_equal(g, e), np.max(np.abs(g - e))


def test_each_run_of_this_module_takes_its_kernel_path(kernels: str) -> None:
    assert Stepper(make_attrs("Adagrad", {}), np.float64, [3]).kernels == kernels


# -- the official ONNX backend node tests ------------------------------------------

# test_adam_multiple's outputs were generated from the Python floats 0.95, 0.85...
# before ONNX stored them as float32 (1 - 0.85 in float64 is not 1 - f32(0.85)):
# they agree to an ulp or two, not bit for bit. The other six agree bit for bit.
OFFICIAL_NOT_BIT_EXACT = {"test_adam_multiple"}


@pytest.mark.parametrize("name", ref.NODE_TESTS)
def test_official_node_test(name: str) -> None:
    case = ref.load_node_test(name)
    got = apply_onnx(case.op, case.attrs, case.inputs)
    assert len(got) == len(case.outputs)
    for g, e in zip(got, case.outputs, strict=True):
        assert g.dtype == np.float32
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)
        if name not in OFFICIAL_NOT_BIT_EXACT:
            assert np.array_equal(g, e)


@pytest.mark.parametrize("name", ref.NODE_TESTS)
def test_official_node_test_equals_reference_emulation(name: str) -> None:
    case = ref.load_node_test(name)
    got = apply_onnx(case.op, case.attrs, case.inputs)
    assert_bit_exact(got, ref.run(case.op, case.attrs, case.inputs))


def test_official_adam_multiple_came_from_unrounded_attributes() -> None:
    case = ref.load_node_test("test_adam_multiple")
    assert case.attrs["beta"] == ref.f32(0.85) != 0.85
    unrounded = {"alpha": 0.95, "beta": 0.85, "epsilon": 0.01, "norm_coefficient": 1e-3}
    generated = ref.run("Adam", unrounded, case.inputs, float32_attributes=False)
    assert_bit_exact(generated, case.outputs)
    as_stored = ref.run("Adam", case.attrs, case.inputs)
    assert not all(map(np.array_equal, as_stored, case.outputs))


def test_official_node_tests_are_the_seven_expected() -> None:
    found = sorted(
        p.name for p in ref.node_tests_dir().iterdir() if (p / "model.onnx").exists()
    )
    assert found == sorted(ref.NODE_TESTS)
    ops = {ref.load_node_test(name).op for name in found}
    assert ops == {"Adagrad", "Momentum", "Adam"}


# -- onnx.reference.ReferenceEvaluator -----------------------------------------------


def run_onnx_reference(
    op: str, attrs: dict[str, Any], inputs: list[Any]
) -> list[Array]:
    k = 2 + ref.state_count(op)
    n = (len(inputs) - 2) // k
    names = ["R", "T"] + [f"in{i}" for i in range(len(inputs) - 2)]
    outputs = [f"out{i}" for i in range(len(inputs) - 2 - n)]
    elem = {
        np.dtype(np.float32): TensorProto.FLOAT,
        np.dtype(np.float64): TensorProto.DOUBLE,
    }
    types = [elem[np.asarray(inputs[0]).dtype], TensorProto.INT64]
    types += [elem[inputs[2].dtype]] * (len(inputs) - 2)
    node = helper.make_node(op, names, outputs, domain=TRAINING_DOMAIN, **attrs)
    graph = helper.make_graph(
        [node],
        "step",
        list(map(helper.make_tensor_value_info, names, types, [None] * len(names))),
        [helper.make_tensor_value_info(nm, types[2], None) for nm in outputs],
    )
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", 21),
            helper.make_opsetid(TRAINING_DOMAIN, 1),
        ],
    )
    feeds = dict(zip(names, inputs, strict=True))
    return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]


# The evaluator computes the bias-corrected or decayed learning rate as a float64
# NumPy scalar, which promotes the float32 update to float64 (under NumPy 2), and
# casts multi-tensor Adam results to float32 whatever the input dtype. So: compare
# values at the precision of the state dtype, never the evaluator's dtypes.
EVALUATOR_CASES = [
    ("Adam", CONFIGS["adam-all"][1], [(4,)], np.float32, 3),
    ("Adam", CONFIGS["adam-l2"][1], [(2, 3)], np.float64, 7),
    ("Adam", CONFIGS["adam-defaults"][1], [(3,), (2,)], np.float32, 1000),
    ("Adagrad", CONFIGS["adagrad-all"][1], [(3,), (2, 2)], np.float32, 5),
    ("Adagrad", CONFIGS["adagrad-decay"][1], [(6,)], np.float64, 9),
    ("Momentum", CONFIGS["momentum-nesterov-l2"][1], [(3,), (2,)], np.float64, 2),
    ("Momentum", CONFIGS["momentum-standard-l2"][1], [(5,)], np.float32, 0),
]


@pytest.mark.parametrize(("op", "attrs", "shapes", "dtype", "t"), EVALUATOR_CASES)
def test_matches_onnx_reference_evaluator(
    op: str, attrs: dict[str, Any], shapes: list[tuple[int, ...]], dtype: Any, t: int
) -> None:
    inputs = make_inputs(op, shapes, dtype, t=t, seed=t)
    got = apply_onnx(op, attrs, inputs)
    expected = run_onnx_reference(op, attrs, inputs)
    multi_adam_quirk = op == "Adam" and len(shapes) > 1
    rtol = 1e-6 if dtype == np.float32 or multi_adam_quirk else 1e-12
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype
        np.testing.assert_allclose(g, e.astype(np.float64), rtol=rtol, atol=1e-7)


# -- own cases against the line-by-line reference -------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("t", [0, 1, 7, 1000])
@pytest.mark.parametrize("shapes", SHAPE_SETS.values(), ids=SHAPE_SETS.keys())
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_step_equals_reference(
    config: str, shapes: list[tuple[int, ...]], t: int, dtype: Any
) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_inputs(op, shapes, dtype, t=t, seed=t + len(shapes))
    got = apply_onnx(op, attrs, inputs)
    assert_bit_exact(got, ref.run(op, attrs, inputs))
    assert [g.shape for g in got] == [np.shape(a) for a in inputs[2 : 2 + len(got)]]


@pytest.mark.parametrize("t", [0, 1, 7, 1000])
@pytest.mark.parametrize("config", ["adam-defaults", "adam-all"])
def test_float64_adam_close_to_literal_grouping(config: str, t: int) -> None:
    """The pseudo-code read left to right groups Adam's products differently."""
    op, attrs = CONFIGS[config]
    inputs = make_inputs(op, [(50,), (3, 4)], np.float64, t=t, seed=t)
    got = apply_onnx(op, attrs, inputs)
    literal = ref.run(op, attrs, inputs, precision=ref.FLOAT64, literal=True)
    for g, e in zip(got, literal, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=0)


@pytest.mark.parametrize("t", [0, 1, 7, 1000])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_float32_close_to_pure_float64(config: str, t: int) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_inputs(op, [(40,), (2, 5)], np.float32, t=t, seed=t + 1)
    got = apply_onnx(op, attrs, inputs)
    exact = ref.run(op, attrs, inputs, precision=ref.FLOAT64)
    for g, e in zip(got, exact, strict=True):
        assert e.dtype == np.float64
        np.testing.assert_allclose(g, e, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_closed_loop_sequence(config: str, dtype: Any) -> None:
    """Six steps, each feeding X, V, H back in with T = 0, 1, 2, ..."""
    op, attrs = CONFIGS[config]
    shapes = [(6,), (), (2, 3)]
    n = len(shapes)
    inputs = make_inputs(op, shapes, dtype, seed=11)
    state = inputs[2 : 2 + n] + inputs[2 + 2 * n :]  # X..., V..., H...
    expected_state = list(state)
    rng = np.random.default_rng(12)
    for t in range(6):
        grads = [np.asarray(rng.standard_normal(s), dtype=dtype) for s in shapes]
        r = np.float32(0.05)
        step = [r, np.int64(t)]
        state = apply_onnx(op, attrs, [*step, *state[:n], *grads, *state[n:]])
        expected_state = ref.run(
            op, attrs, [*step, *expected_state[:n], *grads, *expected_state[n:]]
        )
        assert_bit_exact(state, expected_state)
    assert not np.array_equal(state[0], inputs[2])


def test_adam_first_step_from_zero_moments() -> None:
    """T = 0: V = (1-a)G, H = (1-b)GG, X moves by R(1-a)G / (sqrt((1-b)GG) + eps)."""
    x = np.array([1.0, -2.0, 3.0], np.float32)
    g = np.array([0.5, -4.0, 1e-3], np.float32)
    zero = np.zeros(3, np.float32)
    x_new, v_new, h_new = apply_onnx(
        "Adam", {}, [np.float32(0.1), np.int64(0), x, g, zero, zero]
    )
    a, b, eps = ref.f32(0.9), ref.f32(0.999), ref.f32(1e-6)
    assert np.array_equal(v_new, np.float32(1 - a) * g)
    assert np.array_equal(h_new, np.float32(1 - b) * (g * g))
    g64 = g.astype(np.float64)
    step = 0.1 * (1 - a) * g64 / (np.sqrt((1 - b) * g64 * g64) + eps)
    np.testing.assert_allclose(x - x_new, step, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_zero_gradients(config: str, dtype: Any) -> None:
    op, attrs = CONFIGS[config]
    shapes = [(4,), ()]
    inputs = make_inputs(op, shapes, dtype, t=3, seed=5)
    n = len(shapes)
    inputs[2 + n : 2 + 2 * n] = [np.zeros(s, dtype) for s in shapes]
    got = apply_onnx(op, attrs, inputs)
    assert_bit_exact(got, ref.run(op, attrs, inputs))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("op", ["Adagrad", "Adam"])
def test_zero_gradients_from_zero_state_leave_everything_unchanged(
    op: str, dtype: Any
) -> None:
    x = np.array([[1.5, -2.0], [0.0, 3.0]], dtype)
    zero = np.zeros_like(x)
    states = [zero] * ref.state_count(op)
    out = apply_onnx(op, {}, [np.float32(0.1), np.int64(4), x, zero, *states])
    assert np.array_equal(out[0], x)
    for s in out[1:]:
        assert np.array_equal(s, zero)
    assert all(o.dtype == dtype for o in out)


def test_momentum_zero_gradient_decays_velocity() -> None:
    attrs = {"alpha": 0.5, "beta": 0.1, "mode": "standard", "norm_coefficient": 0.0}
    x = np.array([1.0, 2.0], np.float32)
    v = np.array([4.0, -8.0], np.float32)
    x_new, v_new = apply_onnx(
        "Momentum",
        attrs,
        [np.float32(0.25), np.int64(1), x, np.zeros(2, np.float32), v],
    )
    assert np.array_equal(v_new, np.array([2.0, -4.0], np.float32))
    assert np.array_equal(x_new, np.array([0.5, 3.0], np.float32))


@pytest.mark.parametrize("config", ["adagrad-all", "momentum-nesterov-l2", "adam-all"])
@pytest.mark.parametrize("t", [0, 7])
def test_float64_r_with_float32_state_gives_float32(config: str, t: int) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_inputs(op, [(5,), ()], np.float32, t=t, seed=3)
    inputs[0] = np.float64(0.1)  # not a float32 value: rounded once, in coefficients
    got = apply_onnx(op, attrs, inputs)
    assert all(g.dtype == np.float32 for g in got)
    assert_bit_exact(got, ref.run(op, attrs, inputs))


@pytest.mark.parametrize("config", ["adagrad-all", "momentum-standard", "adam-all"])
def test_float32_r_with_float64_state_gives_float64(config: str) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_inputs(op, [(5,)], np.float64, t=2, seed=4)
    got = apply_onnx(op, attrs, inputs)
    assert inputs[0].dtype == np.float32
    assert all(g.dtype == np.float64 for g in got)
    assert_bit_exact(got, ref.run(op, attrs, inputs))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_inputs_are_never_mutated(config: str, dtype: Any) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_inputs(op, [(3, 2), ()], dtype, t=2, seed=6)
    before = [np.copy(a) for a in inputs]
    for a in inputs:
        a.flags.writeable = False  # read-only inputs are accepted as they are
    got = apply_onnx(op, attrs, inputs)
    for a, b in zip(inputs, before, strict=True):
        assert np.array_equal(a, b)
    for g in got:
        assert g.flags.writeable
        assert not any(np.shares_memory(g, a) for a in inputs)


@pytest.mark.parametrize("config", ["adagrad-all", "momentum-nesterov-l2", "adam-all"])
def test_non_contiguous_inputs(config: str) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_inputs(op, [(4, 6), (3, 5)], np.float32, t=1, seed=8)
    strided = [a if a.ndim == 0 else np.asfortranarray(a)[:, ::-1] for a in inputs]
    got = apply_onnx(op, attrs, strided)
    assert_bit_exact(got, ref.run(op, attrs, strided))
    assert [g.shape for g in got][:2] == [(4, 6), (3, 5)]
    assert all(g.flags.c_contiguous for g in got)


def test_several_tensors_behave_as_one_concatenated_tensor() -> None:
    op, attrs = CONFIGS["adam-all"]
    sizes = [7, 1, 12]
    inputs = make_inputs(op, [(s,) for s in sizes], np.float32, t=5, seed=9)
    k = len(sizes)
    joined = inputs[:2] + [
        np.concatenate(inputs[2 + i * k : 2 + (i + 1) * k]) for i in range(4)
    ]
    split = apply_onnx(op, attrs, inputs)
    whole = apply_onnx(op, attrs, joined)
    for i, w in enumerate(whole):
        assert np.array_equal(np.concatenate(split[i * k : (i + 1) * k]), w)


def test_gradient_aliasing_x_is_read_before_any_write() -> None:
    op, attrs = CONFIGS["adam-all"]
    x = np.linspace(-1.0, 1.0, 9, dtype=np.float32)
    h = np.full(9, 0.5, np.float32)
    inputs = [np.float32(0.1), np.int64(2), x, x, x, h]
    assert_bit_exact(apply_onnx(op, attrs, inputs), ref.run(op, attrs, inputs))


def test_python_scalars_for_r_and_t() -> None:
    x = np.array([1.0, 2.0])
    got = apply_onnx("Adagrad", {}, [0.5, 3, x, x, x])
    assert_bit_exact(got, ref.run("Adagrad", {}, [0.5, 3, x, x, x]))


# -- NumPy broadcasting: G, V, H of a shape that broadcasts to X's ---------------------

# Per tensor: the shapes of (X, G, V, H); Adagrad takes (X, G, H), Momentum (X, G, V).
BroadcastShapes = tuple[tuple[int, ...], ...]
BROADCAST_SETS: dict[str, list[BroadcastShapes]] = {
    "g-row": [((2, 3), (3,), (2, 3), (2, 3))],
    "g-1x3": [((2, 3), (1, 3), (2, 3), (2, 3))],
    "g-column": [((2, 3), (2, 1), (2, 3), (2, 3))],
    "g-0d": [((4,), (), (4,), (4,))],
    "states": [((2, 3), (2, 3), (1, 3), (3,))],
    "all-1x1": [((3, 2), (1, 1), (1, 1), (1, 1))],
    "several": [
        ((2, 3), (3,), (1, 1), (2, 1)),
        ((), (), (), ()),
        ((4, 1, 5), (1, 5), (4, 1, 1), (5,)),
        ((0, 3), (3,), (1, 3), (0, 1)),
        ((7,), (7,), (7,), (7,)),
    ],
    # More elements than one block, so the blocked (and threaded) path runs too.
    "large": [((3, 300_000), (300_000,), (3, 1), (1, 300_000))],
}


def make_broadcast_inputs(
    op: str,
    tensors: list[BroadcastShapes],
    dtype: Any,
    *,
    t: int = 0,
    seed: int = 0,
) -> list[Any]:
    """``R, T, X..., G..., V..., H...`` with each tensor's roles in the given shapes."""
    rng = np.random.default_rng(seed)
    roles = {"Adagrad": [0, 1, 3], "Momentum": [0, 1, 2], "Adam": [0, 1, 2, 3]}[op]
    arrays = []
    for role in roles:
        for shapes in tensors:
            a = rng.standard_normal(shapes[role])
            if role == 3:  # H
                a = np.abs(a) + 0.01
            arrays.append(np.asarray(a, dtype=dtype))
    return [np.float32(0.05), np.int64(t), *arrays]


def expanded(op: str, inputs: list[Any]) -> list[Any]:
    """The same inputs with every G, V, H expanded (copied) to its X's shape."""
    tensors = inputs[2:]
    n = len(tensors) // (2 + ref.state_count(op))
    return inputs[:2] + [
        np.array(np.broadcast_to(a, tensors[j % n].shape))
        for j, a in enumerate(tensors)
    ]


def x_shapes(tensors: list[BroadcastShapes]) -> list[tuple[int, ...]]:
    return [shapes[0] for shapes in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("t", [0, 1, 7, 1000])
@pytest.mark.parametrize("tensors", BROADCAST_SETS.values(), ids=BROADCAST_SETS.keys())
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_broadcast_step_equals_reference(
    config: str, tensors: list[BroadcastShapes], t: int, dtype: Any
) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_broadcast_inputs(op, tensors, dtype, t=t, seed=t + len(tensors))
    got = apply_onnx(op, attrs, inputs)
    assert_bit_exact(got, ref.run(op, attrs, inputs))
    n = len(tensors)
    assert [g.shape for g in got] == x_shapes(tensors) * (len(got) // n)
    assert all(g.dtype == dtype for g in got)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_broadcast_equals_explicitly_expanded_inputs(config: str, dtype: Any) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_broadcast_inputs(op, BROADCAST_SETS["several"], dtype, t=3, seed=4)
    assert_bit_exact(
        apply_onnx(op, attrs, inputs), apply_onnx(op, attrs, expanded(op, inputs))
    )


@pytest.mark.parametrize("config", CONFIGS.keys())
def test_broadcast_closed_loop_sequence(config: str) -> None:
    """A broadcast gradient each step, X, V, H fed back (full shape) with T = 0..5."""
    op, attrs = CONFIGS[config]
    tensors = BROADCAST_SETS["several"]
    n = len(tensors)
    state = make_broadcast_inputs(op, tensors, np.float64, seed=12)[2:]
    ours, theirs = state, state
    for t in range(6):
        grads = make_broadcast_inputs(op, tensors, np.float64, seed=20 + t)[
            2 + n : 2 + 2 * n
        ]
        ours_in = [np.float64(0.1), np.int64(t), *ours[:n], *grads, *ours[2 * n :]]
        theirs_in = [np.float64(0.1), t, *theirs[:n], *grads, *theirs[2 * n :]]
        out = apply_onnx(op, attrs, ours_in)
        expected = ref.run(op, attrs, theirs_in)
        assert_bit_exact(out, expected)
        ours = out[:n] + [np.zeros(0)] * n + out[n:]
        theirs = expected[:n] + [np.zeros(0)] * n + expected[n:]


# float64 where the evaluator computes in float64 (its Adam applies
# norm_coefficient_post in float32, so adam-all is compared at float32 precision).
@pytest.mark.parametrize(
    ("config", "dtype", "rtol"),
    [
        ("adagrad-all", np.float64, 1e-12),
        ("momentum-nesterov-l2", np.float64, 1e-12),
        ("adam-l2", np.float64, 1e-12),
        ("adam-all", np.float32, 1e-6),
    ],
)
@pytest.mark.parametrize("name", ["g-row", "g-column", "states"])
def test_broadcast_matches_onnx_reference_evaluator(
    config: str, dtype: Any, rtol: float, name: str
) -> None:
    op, attrs = CONFIGS[config]
    inputs = make_broadcast_inputs(op, BROADCAST_SETS[name], dtype, t=4, seed=5)
    got = apply_onnx(op, attrs, inputs)
    evaluated = run_onnx_reference(op, attrs, inputs)
    assert [e.shape for e in evaluated] == [g.shape for g in got]
    for g, e in zip(got, evaluated, strict=True):
        np.testing.assert_allclose(g, e.astype(np.float64), rtol=rtol, atol=1e-7)


def test_broadcast_inputs_are_never_mutated_or_shared() -> None:
    op, attrs = CONFIGS["adam-all"]
    inputs = make_broadcast_inputs(op, BROADCAST_SETS["several"], np.float32, t=2)
    before = [np.array(a, copy=True) for a in inputs]
    got = apply_onnx(op, attrs, inputs)
    for a, b in zip(inputs, before, strict=True):
        assert np.array_equal(a, b)
    for g in got:
        assert g.flags.writeable and g.flags.c_contiguous
        assert not any(np.shares_memory(g, a) for a in inputs)


# (X's shape, the other tensor's shape): either would enlarge X or does not broadcast.
NOT_BROADCASTING = [
    ((3,), (2, 3)),
    ((), (1,)),
    ((2, 3), (2,)),
    ((2, 3), (3, 1)),
    ((2, 3), (1, 2, 3)),
    ((2, 1), (2, 3)),
    ((0, 3), (2, 3)),
    ((3,), (0,)),
]


@pytest.mark.parametrize(("x_shape", "shape"), NOT_BROADCASTING)
@pytest.mark.parametrize(("position", "name"), [(3, "G_1"), (4, "V_1"), (5, "H_1")])
def test_shape_that_does_not_broadcast_to_x_is_refused(
    x_shape: tuple[int, ...], shape: tuple[int, ...], position: int, name: str
) -> None:
    inputs = make_broadcast_inputs("Adam", [(x_shape,) * 4], np.float32)
    inputs[position] = np.ones(shape, np.float32)
    message = (
        f"{name} must have the shape of X_1, {x_shape}, or a shape that broadcasts "
        f"to it, got {shape}"
    )
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        apply_onnx("Adam", {}, inputs)
    with pytest.raises(ValueError, match="does not broadcast to X_1's shape"):
        ref.run("Adam", {}, inputs)


def test_refusal_names_the_tensor_of_the_second_group() -> None:
    tensors: list[BroadcastShapes] = [((2, 3),) * 4, ((4,),) * 4]
    inputs = make_broadcast_inputs("Momentum", tensors, np.float64)
    inputs[7] = np.ones((2, 4))  # R, T, X_1, X_2, G_1, G_2, V_1, V_2
    with pytest.raises(
        InvalidArgument, match=re.escape("V_2 must have the shape of X_2, (4,), or")
    ):
        apply_onnx("Momentum", CONFIGS["momentum-standard"][1], inputs)
