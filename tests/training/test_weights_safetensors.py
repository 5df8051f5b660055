"""Groups to and from .safetensors files: the tensors by name, read by the
safetensors library; an import creates a group or writes into one whose tensors are
the file's, and refuses anything else before it changes anything
(docs/weights.md)."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnxps import cli
from onnxps.cli._bytes_progress import BIG, BytesProgress, size
from onnxps.client import (
    Adagrad,
    Adam,
    AsyncClient,
    Client,
    ExportFileError,
    IdsTable,
    Momentum,
    Nesterov,
    Sync,
)
from onnxps.server.app import ServerConfig, ServerHandle
from onnxps.wire.weights import read_safetensors, write_safetensors
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

Array = np.ndarray[Any, Any]


def _tensors(seed: int = 0, dtype: Any = np.float32) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {
        "encoder.weight": rng.standard_normal((6, 4)).astype(dtype),
        "encoder.bias": rng.standard_normal(6).astype(dtype),
        "head.weight": rng.standard_normal((2, 6)).astype(dtype),
    }


def _pushed(ps: Client, group: str, tensors: dict[str, Array]) -> list[Array]:
    ps.create_group(group, Adam(), learning_rate=0.1, tensors=tensors)
    ps.push(group, *[np.full_like(a, 0.5) for a in tensors.values()])
    return ps.pull(group)


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], status: int) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    assert code == status
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.strip()


def test_an_export_is_read_by_the_safetensors_library(
    client: Client, tmp_path: Path
) -> None:
    pulled = _pushed(client, "net", _tensors())
    path = tmp_path / "net.safetensors"
    assert client.export(path) == ["net"]
    loaded = load_file(path)
    assert sorted(loaded) == sorted(_tensors())
    for name, value in zip(_tensors(), pulled, strict=True):
        np.testing.assert_array_equal(loaded[name], value, strict=True)
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "onnxps-weights"
    (group,) = json.loads(meta["groups"])
    assert (group["name"], group["optimizer"], group["learning_rate"]) == (
        "net",
        "Adam",
        pytest.approx(0.1),
    )
    assert [n for n, _ in read_safetensors(path).tensors] == list(_tensors())


def test_an_export_imports_again_with_its_optimizer_and_settings(
    client: Client, tmp_path: Path
) -> None:
    tensors = _tensors(1, np.float64)
    client.create_group(
        "s",
        Momentum(alpha=0.9, beta=1.0),
        learning_rate=0.25,
        tensors=tensors,
        consistency=Sync(2),
        lease_seconds=30.0,
    )
    path = tmp_path / "s.safetensors"
    client.export(path, group="s")
    client.delete_group("s")
    assert client.import_(path) == ["s"]
    info = client.describe_group("s")
    assert isinstance(info.optimizer, Momentum) and info.learning_rate == 0.25
    assert info.consistency == Sync(2) and info.lease_seconds == 30.0
    assert (info.dtype, info.update_count) == (np.dtype(np.float64), 0)
    for got, want in zip(client.pull("s"), tensors.values(), strict=True):
        np.testing.assert_array_equal(got, want, strict=True)


def test_an_import_writes_into_a_group_with_the_same_tensors_keeping_its_state(
    client: Client, tmp_path: Path
) -> None:
    _pushed(client, "net", _tensors())
    t, before = client.pull_versioned("net", state=True)
    path = tmp_path / "new.safetensors"
    fresh = _tensors(5)
    save_file(dict(reversed(fresh.items())), str(path))  # another order: by name
    assert client.import_(path, group="net") == ["net"]
    t_after, after = client.pull_versioned("net", state=True)
    assert t_after == t == 1
    for got, want in zip(after[:3], fresh.values(), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(after[3:], before[3:], strict=True):  # V, H
        np.testing.assert_array_equal(got, want)


def test_an_import_into_a_group_whose_tensors_differ_is_refused_unchanged(
    server: ServerHandle,
    client: Client,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _pushed(client, "net", _tensors())
    t, before = client.pull_versioned("net", state=True)
    wrong = _tensors(2)
    wrong["head.weight"] = wrong["head.weight"].T.copy()
    path = tmp_path / "net.safetensors"
    save_file(wrong, str(path))
    line = _one_line(capsys, ["import", server.address, str(path)], 1)
    assert line == (
        "onnxps import: group 'net' on the server holds float32 encoder.weight (6, "
        "4), encoder.bias (6,), head.weight (2, 6); "
        f"{path} holds float32 encoder.bias (6,), encoder.weight (6, 4), head.weight "
        "(6, 2): nothing was imported (import into a new group: --group NAME, "
        "group=NAME)"
    )
    save_file({"encoder.weight": wrong["encoder.weight"]}, str(path))
    with pytest.raises(ExportFileError, match="nothing was imported"):
        client.import_(path)
    save_file({k: v.astype(np.float64) for k, v in _tensors().items()}, str(path))
    with pytest.raises(ExportFileError, match="holds float64 encoder.bias"):
        client.import_(path)
    t_after, after = client.pull_versioned("net", state=True)
    assert t_after == t
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_models_file_makes_a_group_named_after_it(
    server: ServerHandle, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bert-tiny.safetensors"
    tensors = _tensors(3)
    save_file(
        {**tensors, "position_ids": np.arange(4, dtype=np.int64)},
        str(path),
        metadata={"format": "pt"},
    )
    argv = ["import", server.address, str(path), "--optimizer", "nesterov"]
    assert cli.main([*argv, "--learning-rate", "0.001"]) == 0
    assert capsys.readouterr().out == (
        f"imported 1 group from {path} (created bert-tiny; left out 1 tensor: "
        "position_ids (int64))\n"
    )
    with Client(server.address) as ps:
        info = ps.describe_group("bert-tiny")
        assert info.optimizer == Nesterov(alpha=float(np.float32(0.9)), beta=1.0)
        assert info.learning_rate == 0.001
        assert sorted(n for n, _ in info.tensors) == sorted(tensors)
        for (name, _), got in zip(info.tensors, ps.pull("bert-tiny"), strict=True):
            np.testing.assert_array_equal(got, tensors[name])


def _bfloat16_file(path: Path) -> None:
    header = {"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + b"\x80\x3f\x00\x40")


def test_floats_a_group_cannot_hold_are_refused(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "half.safetensors"
    _bfloat16_file(path)
    with pytest.raises(ExportFileError, match="'w' is BF16; an onnxps group holds"):
        client.import_(path, optimizer=Adam(), learning_rate=0.1)
    save_file({"w": np.zeros(2, np.float16)}, str(path))
    with pytest.raises(ExportFileError, match="'w' is float16; an onnxps group holds"):
        client.import_(path, optimizer=Adam(), learning_rate=0.1)
    save_file({"a": np.zeros(2, np.float32), "b": np.zeros(2)}, str(path))
    with pytest.raises(ExportFileError, match="mixes float32 .* and float64"):
        client.import_(path, optimizer=Adam(), learning_rate=0.1)
    (tmp_path / "text.safetensors").write_text("not a safetensors file\n")
    with pytest.raises(ExportFileError, match="is not a safetensors file"):
        client.import_(tmp_path / "text.safetensors")
    assert client.list_groups() == []


def test_what_a_model_file_cannot_hold_is_refused(
    server: ServerHandle,
    client: Client,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client.create_group("a", Adam(), learning_rate=0.1, tensors={"w": np.zeros(2)})
    client.create_group("b", Adam(), learning_rate=0.1, tensors={"w": np.ones(2)})
    path = tmp_path / "x.safetensors"
    line = _one_line(capsys, ["export", server.address, str(path)], 1)
    assert line == (
        "onnxps export: tensor 'w' is in groups 'a' and 'b'; a model file holds each "
        "name once: export one group (--group, group=)"
    )
    assert cli.main(["export", server.address, str(path), "--group", "b"]) == 0
    assert capsys.readouterr().out == f"exported 1 group (1 tensor) to {path}\n"
    assert load_file(path)["w"].tolist() == [1.0, 1.0]
    client.create_group(
        "emb", Adagrad(), learning_rate=0.1, tables={"ids": IdsTable(dim=2)}
    )
    with pytest.raises(ExportFileError, match="group emb has ids tables"):
        client.export(path, group="emb")
    line = _one_line(capsys, ["export", server.address, str(path), "--group", "z"], 1)
    assert (
        line == "onnxps export: the server has no group 'z' (onnxps status lists them)"
    )
    for argv, message in (
        (
            ["import", server.address, str(path), "--replace"],
            "--replace is for .npz files: a .safetensors or .onnx import writes into "
            "a group the server has (same tensors) or refuses",
        ),
        (
            ["export", server.address, str(path), "--model", "m.onnx"],
            "--model is for an export to an .onnx file",
        ),
        (
            ["import", server.address, str(tmp_path / "g.npz"), "--optimizer", "adam"],
            f"{tmp_path / 'g.npz'} says how its groups are trained: --optimizer and "
            "--learning-rate are for .safetensors and .onnx files",
        ),
    ):
        assert _one_line(capsys, argv, 2) == f"onnxps {argv[0]}: {message}"


def test_the_asyncio_client_exports_and_imports_the_same(
    server: ServerHandle, tmp_path: Path
) -> None:
    path = tmp_path / "net.safetensors"

    async def main() -> list[Array]:
        async with AsyncClient(server.address, timeout=10) as ps:
            await ps.create_group("net", Adam(), learning_rate=0.1, tensors=_tensors())
            assert await ps.export(path) == ["net"]
            await ps.delete_group("net")
            assert await ps.import_(path) == ["net"]
            return await ps.pull("net")

    for got, want in zip(asyncio.run(main()), _tensors().values(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert sorted(load_file(path)) == sorted(_tensors())


def test_npz_export_and_import_take_one_group(client: Client, tmp_path: Path) -> None:
    for name in ("a", "b"):
        client.create_group(name, Adam(), learning_rate=0.1, tensors={"w": np.ones(2)})
    path = tmp_path / "b.npz"
    assert client.export(path, group="b") == ["b"]
    client.delete_group("b")
    with pytest.raises(ExportFileError, match="holds no group 'a'"):
        client.import_(path, group="a")
    assert client.import_(path, group="b") == ["b"]


def test_progress_is_counted_in_bytes_and_drawn_for_big_models(
    server: ServerHandle,
    client: Client,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client.create_group(
        "big", Adam(), learning_rate=0.1, tensors={"w": np.ones((256, 1024))}
    )  # 2 MiB
    seen: list[tuple[int, int]] = []
    path = tmp_path / "big.safetensors"
    client.export(path, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (4 << 20, 4 << 20)  # pulled, then written
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    seen.clear()
    client.import_(path, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (4 << 20, 4 << 20)
    capsys.readouterr()
    assert cli.main(["export", server.address, str(path)]) == 0
    assert capsys.readouterr().err == ""  # under 64 MiB: no progress unless asked
    assert cli.main(["import", server.address, str(path), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["export", server.address, str(path), "--progress"]) == 0
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith("progress 100%  4.0 MiB/4.0 MiB  ")
    )
    bar = io.StringIO()
    BytesProgress(bar, shown=True, tty=True)(3 << 20, 4 << 20)
    assert bar.getvalue().startswith("\r\x1b[K[") and " 75%  3.0 MiB/4.0 MiB" in (
        bar.getvalue()
    )
    hidden = io.StringIO()
    BytesProgress(hidden)(1, 2)
    BytesProgress(hidden, shown=False)(BIG, BIG)
    assert hidden.getvalue() == ""
    big = io.StringIO()
    BytesProgress(big)(BIG, BIG)  # 64 MiB and more: shown unless --no-progress
    assert big.getvalue().startswith("progress 100%  64.0 MiB/64.0 MiB  ")
    assert [size(n) for n in (512, 1536, 5 << 20, 3 << 30)] == [
        "512 B",
        "1.5 KiB",
        "5.0 MiB",
        "3.0 GiB",
    ]


def test_the_writer_is_the_format_the_library_reads(tmp_path: Path) -> None:
    tensors: list[tuple[str, Array]] = [
        ("b", np.arange(3, dtype=np.float64)),
        ("a", np.ones((2, 0), np.float32)),
        ("scalar", np.array(2.5, np.float32)),
        ("ids", np.arange(5, dtype=np.int64)),
    ]
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors, {"k": "v"})
    loaded = load_file(path)
    for name, a in tensors:
        np.testing.assert_array_equal(loaded[name], a, strict=True)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
    floats: list[tuple[str, Array]] = [
        ("b", np.arange(3, dtype=np.float32)),
        ("a", np.ones((2, 0), np.float32)),
        ("scalar", np.array(2.5, np.float32)),
        ("m", np.arange(6, dtype=np.float32).reshape(2, 3)),
    ]
    write_safetensors(path, floats)
    read = read_safetensors(path)
    assert [n for n, _ in read.tensors] == ["b", "a", "scalar", "m"]
    for (_, got), (_, want) in zip(read.tensors, floats, strict=True):
        np.testing.assert_array_equal(got, want, strict=True)


def test_without_the_safetensors_package_the_error_names_the_extra(
    tmp_path: Path,
) -> None:
    path = tmp_path / "w.safetensors"
    write_safetensors(path, [("w", np.zeros(2, np.float32))])  # needs no package
    script = (
        "import sys\n"
        "sys.modules['safetensors'] = None  # as if it were not installed\n"
        "from onnxps.wire.weights import MissingExtraError, read_safetensors\n"
        "try:\n"
        f"    read_safetensors({str(path)!r})\n"
        "except MissingExtraError as exc:\n"
        "    print(exc)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert run.stdout == (
        "reading a .safetensors file needs the safetensors package: pip install "
        "'onnxps[safetensors]'\n"
    ), run.stderr


def test_the_extras_load_only_when_a_file_needs_them() -> None:
    """Importing the weights modules (and the ``onnxps`` command) loads neither
    grpc (the wire layer) nor onnx, onnxruntime or safetensors."""
    script = (
        "import json, sys\n"
        "import onnxps.wire.weights, onnxps.wire.onnx_weights\n"
        "wire = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "    ('grpc', 'onnx', 'onnxruntime', 'safetensors') or\n"
        "    m.startswith('onnxps.client'))\n"
        "import onnxps.cli._main, onnxps.client\n"
        "extras = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "    ('onnx', 'onnxruntime', 'safetensors'))\n"
        "print(json.dumps([wire, extras]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert json.loads(out) == [[], []]


@pytest.fixture
def cluster(servers: Callable[..., ServerHandle]) -> Iterator[list[str]]:
    handles = [
        servers(ServerConfig(address="127.0.0.1:0", durability="none", shard=f"{i}/3"))
        for i in range(3)
    ]
    yield [h.address for h in handles]


def test_a_split_group_is_exported_joined_and_imported_split(
    cluster: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "net.safetensors"
    with Client(cluster, timeout=30, split_bytes=40) as ps:
        pulled = _pushed(ps, "net", _tensors())
        assert len(ps.describe_group("net").parts) == 3
    assert cli.main(["export", ",".join(cluster), str(path)]) == 0
    loaded = load_file(path)
    for name, value in zip(_tensors(), pulled, strict=True):
        np.testing.assert_array_equal(loaded[name], value)
    fresh = _tensors(9)
    save_file(fresh, str(path))
    with Client(cluster, timeout=30, split_bytes=40) as ps:
        assert ps.import_(path, group="net") == ["net"]
        info = ps.describe_group("net")
        assert info.update_count == 1 and len(info.parts) == 3
        for got, want in zip(ps.pull("net"), fresh.values(), strict=True):
            np.testing.assert_array_equal(got, want)
