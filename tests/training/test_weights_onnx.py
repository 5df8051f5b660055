"""An ONNX model's float initializers become a group, are trained through onnxps,
and are written back into a copy of the model that ONNX Runtime runs: every byte of
the copy but the initializers' data is the model's (docs/weights.md)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxps import cli
from onnxps.client import Adagrad, Adam, Client, ExportFileError
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.wire.onnx_weights import initializer_spans, read_onnx, write_onnx
from onnxps.wire.weights import WeightsFileError

Array = np.ndarray[Any, Any]
NAMES = ["W1", "b1", "W2", "b2"]


def _initial(dtype: Any = np.float32) -> dict[str, Array]:
    rng = np.random.default_rng(7)
    return {
        "W1": (rng.standard_normal((4, 8)) * 0.5).astype(dtype),
        "b1": np.zeros(8, dtype),
        "W2": (rng.standard_normal((8, 3)) * 0.5).astype(dtype),
        "b2": np.zeros(3, dtype),
    }


def mlp(
    path: Path, values: dict[str, Array] | None = None, raw: bool = True
) -> dict[str, Array]:
    """x (N, 4) -> MatMul W1, Add b1, Relu, MatMul W2, Add b2, Reshape (-1, 3): an
    int64 initializer (the shape) between the float ones."""
    values = values or _initial()

    def tensor(name: str) -> TensorProto:
        a = values[name]
        if raw:
            return numpy_helper.from_array(a, name)
        kind = TensorProto.FLOAT if a.dtype == np.float32 else TensorProto.DOUBLE
        return helper.make_tensor(name, kind, a.shape, a.ravel().tolist())

    elem = TensorProto.FLOAT if values["W1"].dtype == np.float32 else TensorProto.DOUBLE
    shape = numpy_helper.from_array(np.array([-1, 3], np.int64), "shape")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"]),
            helper.make_node("Add", ["h", "b1"], ["h1"]),
            helper.make_node("Relu", ["h1"], ["a"]),
            helper.make_node("MatMul", ["a", "W2"], ["o"]),
            helper.make_node("Add", ["o", "b2"], ["o2"]),
            helper.make_node("Reshape", ["o2", "shape"], ["y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", elem, [None, 4])],
        [helper.make_tensor_value_info("y", elem, [None, 3])],
        [tensor("W1"), tensor("b1"), shape, tensor("W2"), tensor("b2")],
        doc_string="a two-layer perceptron",
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17)],
        producer_name="onnxps tests",
    )
    helper.set_model_props(model, {"trained_by": "nobody yet"})
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return values


def forward(w: dict[str, Array], x: Array) -> tuple[Array, Array, Array]:
    h1 = x @ w["W1"] + w["b1"]
    a = np.maximum(h1, 0)
    return h1, a, a @ w["W2"] + w["b2"]


def gradients(w: dict[str, Array], x: Array, t: Array) -> list[Array]:
    """Of the mean squared error, in the group's order W1, b1, W2, b2."""
    h1, a, y = forward(w, x)
    dy = 2 * (y - t) / y.size
    dh = (dy @ w["W2"].T) * (h1 > 0)
    return [x.T @ dh, dh.sum(0), a.T @ dy, dy.sum(0)]


def _data() -> tuple[Array, Array]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    return x, np.tanh(x[:, :3] * 2).astype(np.float32)


def train(ps: Client, group: str, steps: int) -> tuple[dict[str, Array], float, float]:
    """``steps`` pushes of NumPy gradients; the pulled weights, first and last
    loss."""
    x, t = _data()
    losses = []
    for _ in range(steps):
        w = dict(zip(NAMES, ps.pull(group), strict=True))
        losses.append(float(np.mean((forward(w, x)[2] - t) ** 2)))
        ps.push(group, *[g.astype(np.float32) for g in gradients(w, x, t)])
    w = dict(zip(NAMES, ps.pull(group), strict=True))
    return w, losses[0], float(np.mean((forward(w, x)[2] - t) ** 2))


def run_onnx(path: Path, x: Array) -> Array:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["y"], {"x": x})[0])


def assert_only_data_differs(base: Path, out: Path) -> None:
    """The bytes of ``out`` are those of ``base`` outside its initializers' data,
    and both parse to the same model once that data is cleared."""
    a, b = base.read_bytes(), out.read_bytes()
    assert len(a) == len(b)
    spans = initializer_spans(a)
    inside = np.zeros(len(a), bool)
    for start, end, _ in spans.values():
        inside[start:end] = True
    differ = np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)
    assert differ.any() and not (differ & ~inside).any()
    models = [onnx.load_model_from_string(blob) for blob in (a, b)]
    for m in models:
        for t in m.graph.initializer:
            if t.data_type != TensorProto.INT64:
                for data in ("raw_data", "float_data", "double_data"):
                    t.ClearField(data)
    assert models[0].SerializeToString() == models[1].SerializeToString()
    assert models[0].graph.node == models[1].graph.node


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.onnx"
    mlp(path)
    return path


def test_an_onnx_model_trained_through_onnxps_runs_in_onnx_runtime(
    client: Client, model: Path, tmp_path: Path
) -> None:
    assert client.import_(model, optimizer=Adam(), learning_rate=0.05) == ["mlp"]
    info = client.describe_group("mlp")
    assert info.tensors == [("W1", (4, 8)), ("b1", (8,)), ("W2", (8, 3)), ("b2", (3,))]
    w, first, last = train(client, "mlp", 5)
    assert last < first
    assert not np.array_equal(w["W1"], _initial()["W1"])
    out = tmp_path / "trained.onnx"
    assert client.export(out, model=model) == ["mlp"]
    x = np.random.default_rng(11).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(run_onnx(out, x), forward(w, x)[2], rtol=1e-5, atol=1e-6)
    assert_only_data_differs(model, out)
    for t in onnx.load(out).graph.initializer:
        if t.name in w:
            np.testing.assert_array_equal(numpy_helper.to_array(t), w[t.name])
    assert onnx.load(out).metadata_props[0].value == "nobody yet"


def test_values_stored_as_float_data_and_double_data_are_written_in_place(
    client: Client, tmp_path: Path
) -> None:
    for dtype in (np.float32, np.float64):
        base = tmp_path / f"{np.dtype(dtype)}.onnx"
        mlp(base, _initial(dtype), raw=False)
        kinds = {
            t.name: t.HasField("raw_data") for t in onnx.load(base).graph.initializer
        }
        assert kinds["W1"] is False  # float_data / double_data
        group = f"g{np.dtype(dtype).itemsize}"
        client.import_(base, group=group, optimizer=Adagrad(), learning_rate=0.1)
        assert client.describe_group(group).dtype == dtype
        client.push(group, *[np.ones_like(a) for a in client.pull(group)])
        w = dict(zip(NAMES, client.pull(group), strict=True))
        out = tmp_path / f"out-{np.dtype(dtype)}.onnx"
        client.export(out, group=group, model=base)
        assert_only_data_differs(base, out)
        x = np.ones((2, 4), dtype)
        np.testing.assert_allclose(run_onnx(out, x), forward(w, x)[2], rtol=1e-6)


def test_the_copy_keeps_bytes_a_reserialization_would_change(
    client: Client, model: Path, tmp_path: Path
) -> None:
    """The model's fields written out of field-number order (valid protobuf, as
    another writer may do): parsing and serializing again would reorder them; the
    copy keeps them where they are."""
    m = onnx.load(model)
    graph_only = onnx.ModelProto()
    graph_only.graph.CopyFrom(m.graph)
    m.ClearField("graph")
    odd = tmp_path / "odd.onnx"
    odd.write_bytes(m.SerializeToString() + graph_only.SerializeToString())
    assert onnx.load(odd).SerializeToString() != odd.read_bytes()
    client.import_(odd, optimizer=Adam(), learning_rate=0.05)
    w, _, _ = train(client, "odd", 2)
    out = tmp_path / "out.onnx"
    client.export(out, model=odd)
    assert_only_data_differs(odd, out)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(run_onnx(out, x), forward(w, x)[2], rtol=1e-5)


def test_an_import_into_the_group_of_the_model_writes_its_values(
    client: Client, model: Path, tmp_path: Path
) -> None:
    client.import_(model, optimizer=Adam(), learning_rate=0.05)
    train(client, "mlp", 2)
    t, before = client.pull_versioned("mlp", state=True)
    assert client.import_(model) == ["mlp"]  # the model's initial values again
    t_after, after = client.pull_versioned("mlp", state=True)
    assert t_after == t == 2
    for got, name in zip(after[:4], NAMES, strict=True):
        np.testing.assert_array_equal(got, _initial()[name])
    for got, kept in zip(after[4:], before[4:], strict=True):
        np.testing.assert_array_equal(got, kept)


def test_the_int64_initializer_is_left_out_and_kept(
    server: ServerHandle,
    model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    weights = read_onnx(model)
    assert [n for n, _ in weights.tensors] == NAMES
    assert weights.left_out == [("shape", "int64")]
    argv = ["import", server.address, str(model), "--optimizer", "adagrad"]
    assert cli.main([*argv, "--learning-rate", "0.1"]) == 0
    assert capsys.readouterr().out == (
        f"imported 1 group from {model} (created mlp; left out 1 tensor: "
        "shape (int64))\n"
    )
    with Client(server.address) as ps:
        assert type(ps.describe_group("mlp").optimizer) is Adagrad
        w, _, _ = train(ps, "mlp", 2)
    out = tmp_path / "out.onnx"
    argv = ["export", server.address, str(out), "--model", str(model)]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == (
        f"exported 1 group to {out} (4 initializers written into a copy of {model})\n"
    )
    shape = {t.name: t for t in onnx.load(out).graph.initializer}["shape"]
    assert numpy_helper.to_array(shape).tolist() == [-1, 3]
    x = np.ones((3, 4), np.float32)
    np.testing.assert_allclose(run_onnx(out, x), forward(w, x)[2], rtol=1e-5)


def _with_training(path: Path, nodes: list[tuple[str, list[str]]]) -> None:
    """Add to the model at ``path`` a training algorithm of ONNX optimizer nodes
    (ai.onnx.preview.training), each updating the named initializers, with R a
    constant 0.05."""
    m = onnx.load(path)
    made = []
    outputs = []
    for k, (op, xs) in enumerate(nodes):
        per = ["G", "H"] + (["V"] if op == "Adam" else [])
        inputs = ["R", "T", *xs] + [f"{s}{k}_{x}" for s in per for x in xs]
        outs = [f"{x}_new{k}" for x in xs] + [
            f"{s}{k}_{x}_new" for s in per[1:] for x in xs
        ]
        attrs: dict[str, Any] = (
            {"epsilon": 1e-5, "norm_coefficient": 0.001} if op == "Adagrad" else {}
        )
        made.append(
            helper.make_node(
                op, inputs, outs, domain="ai.onnx.preview.training", **attrs
            )
        )
        outputs += outs
    algorithm = helper.make_graph(
        made,
        "algorithm",
        [],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [
            numpy_helper.from_array(np.array(0.05, np.float32), "R"),
            numpy_helper.from_array(np.array(0, np.int64), "T"),
        ],
    )
    bindings = [(x, f"{x}_new{k}") for k, (_, xs) in enumerate(nodes) for x in xs]
    m.training_info.append(helper.make_training_info(algorithm, bindings, None, None))
    m.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    onnx.save(m, path)


def test_a_model_that_says_how_it_trains_makes_its_group_so(
    client: Client, model: Path, tmp_path: Path
) -> None:
    _with_training(model, [("Adagrad", ["W2", "W1"])])
    assert client.import_(model) == ["mlp"]
    info = client.describe_group("mlp")
    assert info.tensors == [("W2", (8, 3)), ("W1", (4, 8))]  # the node's order
    assert type(info.optimizer) is Adagrad
    assert info.learning_rate == float(np.float32(0.05))  # R, a float32 constant
    assert info.optimizer.epsilon == pytest.approx(1e-5)
    assert info.optimizer.norm_coefficient == pytest.approx(0.001)
    client.delete_group("mlp")
    assert client.import_(model, optimizer=Adam(), learning_rate=0.1) == ["mlp"]
    info = client.describe_group("mlp")
    assert type(info.optimizer) is Adam and info.learning_rate == 0.1
    assert [n for n, _ in info.tensors] == ["W2", "W1"]
    out = tmp_path / "out.onnx"
    client.push("mlp", np.ones((8, 3), np.float32), np.ones((4, 8), np.float32))
    client.export(out, model=model)
    assert_only_data_differs(model, out)
    assert len(onnx.load(out).training_info) == 1


def test_the_left_out_floats_and_several_optimizer_nodes(
    server: ServerHandle,
    client: Client,
    model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _with_training(model, [("Adagrad", ["W1", "W2", "b2"])])
    assert cli.main(["import", server.address, str(model)]) == 0
    assert capsys.readouterr().out == (
        f"imported 1 group from {model} (created mlp; left out 2 tensors: shape "
        "(int64), b1 (float32, not updated by the model's Adagrad))\n"
    )
    client.delete_group("mlp")
    _with_training(model, [("Adam", ["b1"])])  # a second training info
    line = _one_line(capsys, ["import", server.address, str(model)], 1)
    assert line == (
        f"onnxps import: {model} trains with 2 optimizer nodes (Adagrad, Adam); a "
        "group has one: give the optimizer and learning rate to import every float "
        "initializer as one group (optimizer=, learning_rate=; --optimizer, "
        "--learning-rate)"
    )
    assert client.list_groups() == []
    argv = ["import", server.address, str(model), "--optimizer", "adam"]
    assert cli.main([*argv, "--learning-rate", "0.1"]) == 0
    assert [n for n, _ in client.describe_group("mlp").tensors] == NAMES


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], status: int) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    assert code == status
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.strip()


def test_a_model_that_does_not_fit_is_refused(
    server: ServerHandle,
    client: Client,
    model: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    half = tmp_path / "half.onnx"
    values = _initial()
    values["b2"] = values["b2"].astype(np.float16)
    mlp(half, values)
    with pytest.raises(ExportFileError, match="'b2' is float16; an onnxps group holds"):
        client.import_(half, optimizer=Adam(), learning_rate=0.1)
    mixed = tmp_path / "mixed.onnx"
    values["b2"] = values["b2"].astype(np.float64)
    mlp(mixed, values)
    with pytest.raises(ExportFileError, match="mixes float32 .* and float64"):
        client.import_(mixed, optimizer=Adam(), learning_rate=0.1)
    line = _one_line(capsys, ["import", server.address, str(model)], 1)
    assert line == (
        f"onnxps import: {model} does not say how to train group 'mlp', which the "
        "server does not have: give the optimizer and learning rate to create it "
        "with (optimizer=Adam(), learning_rate=0.01; onnxps import --optimizer adam "
        "--learning-rate 0.01)"
    )
    assert client.list_groups() == []
    client.create_group(
        "other",
        Adam(),
        learning_rate=0.1,
        tensors={"W1": np.zeros((4, 8), np.float32), "w9": np.zeros(2, np.float32)},
    )
    out = tmp_path / "out.onnx"
    line = _one_line(
        capsys, ["export", server.address, str(out), "--model", str(model)], 1
    )
    assert line.startswith(
        f"onnxps export: {model} has no initializer 'w9': the tensors written into a "
        "model are its initializers, by name (the model has 'W1', 'b1', 'shape'"
    )
    client.delete_group("other")
    client.create_group(
        "other", Adam(), learning_rate=0.1, tensors={"W1": np.ones((4, 8), np.float32)}
    )
    argv = ["export", server.address, str(out), "--model", str(model)]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == (
        f"exported 1 group to {out} (1 initializer written into a copy of {model}; 3 "
        "float initializers left as they were: b1, W2, b2)\n"
    )
    written = {
        t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer
    }
    assert written["W1"].tolist() == np.ones((4, 8)).tolist()
    np.testing.assert_array_equal(written["W2"], _initial()["W2"])
    out.unlink()
    client.delete_group("other")
    client.create_group(
        "other", Adam(), learning_rate=0.1, tensors={"W1": np.zeros((8, 4), np.float32)}
    )
    line = _one_line(
        capsys, ["export", server.address, str(out), "--model", str(model)], 1
    )
    assert line == (
        f"onnxps export: {model}: initializer 'W1' is float32 (4, 8), the value to "
        "write is float32 (8, 4): write a group made from this model (onnxps import "
        "MODEL.onnx)"
    )
    assert not out.exists() and not Path(f"{out}.tmp").exists()
    line = _one_line(capsys, ["export", server.address, str(out)], 2)
    assert line == (
        f"onnxps export: an export to {out} writes the trained values into a copy of "
        "an ONNX model: name that model with --model BASE.onnx"
    )


def test_initializers_in_an_external_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "external.onnx"
    mlp(path)
    m = onnx.load(path)
    onnx.save(m, path, save_as_external_data=True, size_threshold=0, location="w.bin")
    with pytest.raises(WeightsFileError, match="stored in an external file"):
        read_onnx(path)
    with pytest.raises(WeightsFileError, match="stored in an external file"):
        write_onnx(path, tmp_path / "out.onnx", {"W1": np.zeros((4, 8), np.float32)})


def test_without_the_onnx_package_the_error_names_the_extra(
    model: Path, tmp_path: Path
) -> None:
    script = (
        "import sys\n"
        "sys.modules['onnx'] = None  # as if it were not installed\n"
        "from onnxps.wire.onnx_weights import read_onnx\n"
        "from onnxps.wire.weights import MissingExtraError\n"
        "try:\n"
        f"    read_onnx({str(model)!r})\n"
        "except MissingExtraError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert run.stdout == (
        "reading an .onnx model needs the onnx package: pip install 'onnxps[onnx]'\n"
    ), run.stderr
    command = (
        "import sys\n"
        "sys.modules['onnx'] = None\n"
        "from onnxps.cli import main\n"
        f"sys.exit(main(['import', '127.0.0.1:1', {str(model)!r}]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", command], capture_output=True, text=True, timeout=60
    )
    assert (run.returncode, run.stderr) == (
        1,
        "onnxps import: reading an .onnx model needs the onnx package: pip install "
        "'onnxps[onnx]'\n",
    )


@pytest.fixture
def cluster(servers: Callable[..., ServerHandle]) -> Iterator[list[str]]:
    handles = [
        servers(ServerConfig(address="127.0.0.1:0", durability="none", shard=f"{i}/2"))
        for i in range(2)
    ]
    yield [h.address for h in handles]


def test_a_split_group_on_a_cluster_is_exported_joined(
    cluster: list[str], model: Path, tmp_path: Path
) -> None:
    with Client(cluster, timeout=30, split_bytes=64) as ps:
        ps.import_(model, optimizer=Adam(), learning_rate=0.05)
        assert len(ps.describe_group("mlp").parts) == 2
        w, first, last = train(ps, "mlp", 3)
        assert last < first
        out = tmp_path / "cluster.onnx"
        assert ps.export(out, model=model) == ["mlp"]
    assert_only_data_differs(model, out)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(run_onnx(out, x), forward(w, x)[2], rtol=1e-5)


@pytest.mark.slow
def test_a_64_mib_model_shows_its_progress_unasked(
    server: ServerHandle, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "wide.onnx"
    w = np.random.default_rng(1).standard_normal((4096, 4096)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4096])],
        [numpy_helper.from_array(w, "W")],
    )
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), base
    )
    argv = ["import", server.address, str(base), "--optimizer", "adagrad"]
    assert cli.main([*argv, "--learning-rate", "0.1", "--timeout", "60"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"imported 1 group from {base} (created wide)")
    assert captured.err.splitlines()[-1].startswith(
        "progress 100%  128.0 MiB/128.0 MiB  "
    )
    with Client(server.address, timeout=60) as ps:
        ps.push("wide", np.ones_like(w))
        (trained,) = ps.pull("wide")
    out = tmp_path / "trained.onnx"
    argv = ["export", server.address, str(out), "--model", str(base)]
    assert cli.main([*argv, "--timeout", "60"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1].startswith(
        "progress 100%  128.0 MiB/128.0 MiB  "
    )
    assert_only_data_differs(base, out)
    x = np.random.default_rng(2).standard_normal((2, 4096)).astype(np.float32)
    np.testing.assert_allclose(run_onnx(out, x), x @ trained, rtol=1e-4, atol=1e-4)
