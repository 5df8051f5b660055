"""The production path (``Stepper``, in place, blocked, threaded) is the reference.

Bit for bit against ``apply_onnx`` and the reference's float32 emulation, on groups
that span many blocks and the threaded path, on many small tensors, and on random
cases; and a step allocates nothing proportional to the group's size.
"""

from __future__ import annotations

import tracemalloc
from typing import Any, Literal

import numpy as np
import onnx_reference as ref
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from kernel_paths import each_kernel_path  # noqa: F401
from onnxps.server.kernels import (
    BLOCK_ELEMENTS,
    PARALLEL_MIN_ELEMENTS,
    Stepper,
    _fused,
    apply_onnx,
    make_attrs,
)

Array = np.ndarray[Any, Any]

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "adagrad": ("Adagrad", {"decay_factor": 0.1, "norm_coefficient": 0.01}),
    "momentum": (
        "Momentum",
        {"alpha": 0.9, "beta": 0.5, "mode": "standard", "norm_coefficient": 0.0},
    ),
    "nesterov": (
        "Momentum",
        {"alpha": 0.9, "beta": 0.5, "mode": "nesterov", "norm_coefficient": 0.01},
    ),
    "adam": ("Adam", {}),
    "adam-all": (
        "Adam",
        {"alpha": 0.8, "norm_coefficient": 0.01, "norm_coefficient_post": 0.001},
    ),
}

STATES = {"Adagrad": ("H",), "Momentum": ("V",), "Adam": ("V", "H")}


class Group:
    """Flat X, G, V, H for a list of tensor sizes, as a store would hold them."""

    def __init__(self, op: str, sizes: list[int], dtype: Any, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.op = op
        self.sizes = sizes
        self.dtype = np.dtype(dtype)

        def draw(positive: bool = False) -> list[Array]:
            arrays = [rng.standard_normal(n).astype(dtype) for n in sizes]
            return [np.abs(a) + dtype(0.01) if positive else a for a in arrays]

        self.xs, self.gs = draw(), draw()
        self.vs = draw() if "V" in STATES[op] else None
        self.hs = draw(positive=True) if "H" in STATES[op] else None

    def copy(self) -> Group:
        other = object.__new__(Group)
        other.__dict__.update(self.__dict__)
        other.xs = [np.copy(a) for a in self.xs]
        other.vs = None if self.vs is None else [np.copy(a) for a in self.vs]
        other.hs = None if self.hs is None else [np.copy(a) for a in self.hs]
        return other

    def onnx_inputs(self, r: float, t: int) -> list[Any]:
        states = [s for s in (self.vs, self.hs) if s is not None]
        flat = [a for group in states for a in group]
        return [np.float64(r), np.int64(t), *self.xs, *self.gs, *flat]

    def state(self) -> list[Array]:
        """``X..., V..., H...``: the ONNX output order."""
        return self.xs + (self.vs or []) + (self.hs or [])


def assert_bit_exact(got: list[Array], expected: list[Array]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype
        assert g.shape == e.shape
        assert np.array_equal(g, e)


def step_in_place(group: Group, attrs: Any, r: float, t: int, **kw: Any) -> Stepper:
    stepper = Stepper(attrs, group.dtype, group.sizes, **kw)
    stepper.step(r, t, group.xs, group.gs, group.vs, group.hs)
    return stepper


def test_each_run_of_this_module_takes_its_kernel_path(kernels: str) -> None:
    assert Stepper(make_attrs("Adam", {}), np.float32, [3]).kernels == kernels


# Blocks of 32 Ki elements, so the threaded group spans many blocks per thread.
SMALL_BLOCK = 32 * 1024
BIG_SIZES = [600_000 - (3 * SMALL_BLOCK + 17) - 1, 3 * SMALL_BLOCK + 17, 1, 0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_threaded_multi_block_group_is_bit_exact(config: str, dtype: Any) -> None:
    op, attr_values = CONFIGS[config]
    attrs = make_attrs(op, attr_values)
    assert sum(BIG_SIZES) >= PARALLEL_MIN_ELEMENTS
    threaded = Group(op, BIG_SIZES, dtype, seed=1)
    one_block = threaded.copy()
    default_blocks = threaded.copy()
    for t in (0, 3):
        inputs = [np.copy(a) for a in threaded.onnx_inputs(0.01, t)]
        expected = ref.run(op, attr_values, inputs)
        assert_bit_exact(apply_onnx(op, attr_values, inputs), expected)
        stepper = step_in_place(threaded, attrs, 0.01, t, block=SMALL_BLOCK)
        if _fused._THREADS > 1:  # the group really takes the threaded path
            assert len(stepper._slices) > 1
        assert_bit_exact(threaded.state(), expected)
        step_in_place(one_block, attrs, 0.01, t, block=sum(BIG_SIZES))
        assert_bit_exact(one_block.state(), expected)
        step_in_place(default_blocks, attrs, 0.01, t)
        assert_bit_exact(default_blocks.state(), expected)


@pytest.mark.parametrize("config", CONFIGS.keys())
def test_many_small_tensors_threaded(config: str) -> None:
    op, attr_values = CONFIGS[config]
    attrs = make_attrs(op, attr_values)
    rng = np.random.default_rng(2)
    sizes = [int(n) for n in rng.integers(0, 200, size=6000)]
    assert sum(sizes) >= PARALLEL_MIN_ELEMENTS
    group = Group(op, sizes, np.float32, seed=3)
    expected = ref.run(op, attr_values, group.onnx_inputs(0.02, 5))
    step_in_place(group, attrs, 0.02, 5)
    assert_bit_exact(group.state(), expected)


@pytest.mark.parametrize("block", [1, 3, 16, BLOCK_ELEMENTS])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_many_small_tensors_any_block_size(config: str, block: int) -> None:
    op, attr_values = CONFIGS[config]
    attrs = make_attrs(op, attr_values)
    sizes = [1, 0, 17, 5, 64, 3, 2, 33, 1, 9] * 5
    group = Group(op, sizes, np.float64, seed=4)
    expected = ref.run(op, attr_values, group.onnx_inputs(0.02, 2))
    step_in_place(group, attrs, 0.02, 2, block=block)
    assert_bit_exact(group.state(), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("config", CONFIGS.keys())
def test_stepper_closed_loop_matches_apply_onnx(config: str, dtype: Any) -> None:
    """One stepper reused for eight steps (its scratch carries nothing over)."""
    op, attr_values = CONFIGS[config]
    sizes = [100, 1, 70, 0]
    group = Group(op, sizes, dtype, seed=5)
    stepper = Stepper(make_attrs(op, attr_values), dtype, sizes, block=32)
    state = [np.copy(a) for a in group.state()]
    rng = np.random.default_rng(6)
    n = len(sizes)
    for t in range(8):
        group.gs = [rng.standard_normal(k).astype(dtype) for k in sizes]
        stepper.step(0.01, t, group.xs, group.gs, group.vs, group.hs)
        inputs = [np.float64(0.01), np.int64(t), *state[:n], *group.gs, *state[n:]]
        state = apply_onnx(op, attr_values, inputs)
        assert_bit_exact(group.state(), state)


@pytest.mark.parametrize("config", ["adagrad", "nesterov", "adam-all"])
def test_step_allocates_nothing_proportional_to_size(config: str) -> None:
    op, attr_values = CONFIGS[config]
    size = 4 * 1024 * 1024
    group = Group(op, [size], np.float32, seed=7)
    stepper = Stepper(make_attrs(op, attr_values), np.float32, [size])
    stepper.step(0.01, 0, group.xs, group.gs, group.vs, group.hs)  # starts the pool
    tracemalloc.start()
    try:
        stepper.step(0.01, 1, group.xs, group.gs, group.vs, group.hs)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024, peak  # a float32 copy of the group is 16 MiB


def test_tracemalloc_sees_numpy_temporaries() -> None:
    """The check above means something: the naive transcription shows up."""
    size = 1024 * 1024
    group = Group("Adam", [size], np.float32, seed=8)
    tracemalloc.start()
    try:
        ref.run("Adam", {}, group.onnx_inputs(0.01, 1))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak > 4 * size * 4


# -- random cases ------------------------------------------------------------------


def attr_strategy(op: str) -> st.SearchStrategy[dict[str, Any]]:
    small = st.one_of(st.just(0.0), st.floats(0.0, 0.1))
    epsilon = st.floats(1e-8, 1e-2)
    if op == "Adagrad":
        return st.fixed_dictionaries(
            {},
            optional={
                "epsilon": epsilon,
                "decay_factor": st.floats(0.0, 1.0),
                "norm_coefficient": small,
            },
        )
    if op == "Momentum":
        return st.fixed_dictionaries(
            {
                "alpha": st.floats(0.0, 1.0),
                "beta": st.floats(0.0, 1.0),
                "mode": st.sampled_from(["standard", "nesterov"]),
                "norm_coefficient": small,
            }
        )
    return st.fixed_dictionaries(
        {},
        optional={
            "alpha": st.floats(0.0, 0.999),
            "beta": st.floats(0.0, 0.9999),
            "epsilon": epsilon,
            "norm_coefficient": small,
            "norm_coefficient_post": small,
        },
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, dict[str, Any], list[Any]]:
    """``op, attrs, inputs`` with 1 to 4 tensors of random shapes (0-d included)."""
    op = draw(st.sampled_from(["Adagrad", "Momentum", "Adam"]))
    attrs = draw(attr_strategy(op))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    width: Literal[32, 64] = 32 if dtype == np.float32 else 64
    shapes = draw(
        st.lists(
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
            min_size=1,
            max_size=4,
        )
    )
    r = draw(st.floats(1e-4, 1.0))
    r_dtype = draw(st.sampled_from([np.float32, np.float64]))
    t = draw(st.integers(0, 12) | st.integers(0, 2**40))

    def tensors(low: float) -> list[Array]:
        elements = st.floats(low, 100.0, width=width)
        return [draw(hnp.arrays(dtype, s, elements=elements)) for s in shapes]

    arrays = tensors(-100.0) + tensors(-100.0)
    for name in STATES[op]:
        arrays += tensors(0.0 if name == "H" else -100.0)
    return op, attrs, [np.asarray(r, r_dtype), np.int64(t), *arrays]


FAST = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@FAST
@given(cases())
def test_apply_onnx_equals_reference_emulation(
    case: tuple[str, dict[str, Any], list[Any]],
) -> None:
    op, attrs, inputs = case
    assert_bit_exact(apply_onnx(op, attrs, inputs), ref.run(op, attrs, inputs))


@FAST
@given(cases(), st.integers(1, 40))
def test_stepper_equals_reference_emulation(
    case: tuple[str, dict[str, Any], list[Any]], block: int
) -> None:
    op, attrs, inputs = case
    tensors = [np.array(a).reshape(-1) for a in inputs[2:]]
    n = len(tensors) // (2 + len(STATES[op]))
    xs, gs = tensors[:n], tensors[n : 2 * n]
    states = {
        name: tensors[(2 + k) * n : (3 + k) * n] for k, name in enumerate(STATES[op])
    }
    stepper = Stepper(make_attrs(op, attrs), xs[0].dtype, [x.size for x in xs], block)
    r, t = float(inputs[0]), int(inputs[1])
    stepper.step(r, t, xs, gs, states.get("V"), states.get("H"))
    expected = ref.run(op, attrs, inputs)
    got = xs + [a for name in STATES[op] for a in states[name]]
    assert_bit_exact(got, [e.reshape(-1) for e in expected])


@settings(max_examples=40, deadline=None)
@given(cases(), st.data())
def test_split_tensors_equal_the_concatenated_tensor(
    case: tuple[str, dict[str, Any], list[Any]], data: st.DataObject
) -> None:
    op, attrs, inputs = case
    k = 2 + len(STATES[op])
    n = (len(inputs) - 2) // k
    flat = [
        np.concatenate([np.reshape(a, -1) for a in inputs[2 + i * n : 2 + (i + 1) * n]])
        for i in range(k)
    ]
    cut = data.draw(st.integers(0, flat[0].size))
    halves = [part for a in flat for part in (a[:cut], a[cut:])]  # X_1, X_2, G_1...
    whole = apply_onnx(op, attrs, [*inputs[:2], *flat])
    split = apply_onnx(op, attrs, [*inputs[:2], *halves])
    joined = [np.concatenate(split[2 * i : 2 * i + 2]) for i in range(len(whole))]
    assert_bit_exact(joined, whole)
