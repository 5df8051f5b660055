"""A PyTorch model trained through onnxps, to a .safetensors file that
``load_state_dict`` takes, and back (docs/weights.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed: pip install 'torch==2.13.0+cpu'"
)

from onnxps.client import Client  # noqa: E402
from onnxps.torch import (  # noqa: E402
    RemoteOptimizer,
    load_safetensors,
    save_safetensors,
)
from safetensors.torch import load_file, save_file  # noqa: E402


def _model(seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 2),
    )


def _steps(model: Any, opt: RemoteOptimizer, n: int) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for _ in range(n):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_a_groups_export_loads_into_a_torch_model(
    client: Client, tmp_path: Path
) -> None:
    model = _model(0)
    opt = RemoteOptimizer(model.named_parameters(), client, group="net", lr=0.01)
    _steps(model, opt, 3)
    path = tmp_path / "net.safetensors"
    assert client.export(path, group="net") == ["net"]
    state = load_file(path)  # the parameters: the buffers are not in the group
    assert sorted(state) == sorted(n for n, _ in model.named_parameters())
    fresh = _model(5)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # (BatchNorm fills a missing num_batches_tracked in itself)
    assert sorted(missing) == ["1.running_mean", "1.running_var"]
    assert unexpected == []
    pulled = dict(zip(opt.names, client.pull("net"), strict=True))
    for name, p in fresh.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), pulled[name])


def test_save_safetensors_writes_the_whole_state_dict_with_the_servers_values(
    client: Client, tmp_path: Path
) -> None:
    model = _model(0)
    opt = RemoteOptimizer(model.named_parameters(), client, group="net", lr=0.01)
    _steps(model, opt, 2)
    with torch.no_grad():
        model[0].weight.zero_()  # the server's values are written, not these
    path = tmp_path / "model.safetensors"
    save_safetensors(model, path, opt)
    fresh = _model(5)
    assert fresh.load_state_dict(load_file(path)) is not None  # strict: every key
    pulled = dict(zip(opt.names, client.pull("net"), strict=True))
    assert not np.all(pulled["0.weight"] == 0)
    for name, value in fresh.state_dict().items():
        want = pulled[name] if name in pulled else model.state_dict()[name].numpy()
        np.testing.assert_array_equal(value.numpy(), want)


def test_load_safetensors_makes_the_files_values_the_servers(
    client: Client, tmp_path: Path
) -> None:
    model = _model(0)
    opt = RemoteOptimizer(model.named_parameters(), client, group="net", lr=0.01)
    _steps(model, opt, 2)
    t, before = client.pull_versioned("net", state=True)
    other = _model(9)
    path = tmp_path / "other.safetensors"
    save_file(other.state_dict(), str(path))
    assert load_safetensors(model, path, opt) == ([], [])
    t_after, after = client.pull_versioned("net", state=True)
    assert t_after == t == 2
    n = len(opt.names)
    wanted = dict(other.named_parameters())
    for name, got in zip(opt.names, after[:n], strict=True):
        np.testing.assert_array_equal(got, wanted[name].detach().numpy())
    for got, kept in zip(after[n:], before[n:], strict=True):  # Adam's V and H
        np.testing.assert_array_equal(got, kept)
    _steps(model, opt, 1)  # and training goes on from there
    assert opt.version == 3
