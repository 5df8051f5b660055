"""onnxps.torch: RemoteOptimizer on a real server, compared with the plain client."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _procs import StartServer

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed: pip install 'torch==2.13.0+cpu'"
)

import torch_workers as tw  # noqa: E402
from onnxps.client import (  # noqa: E402
    Async,
    Client,
    FailedPreconditionError,
    Momentum,
    Sync,
)
from onnxps.server.app import ServerHandle  # noqa: E402
from onnxps.torch import RemoteOptimizer, run_workers, shard  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
Array = np.ndarray[Any, Any]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the worker processes use: the same gradients."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def params_np(model: Any) -> list[Array]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def grads_np(model: Any) -> list[Array]:
    return [p.grad.detach().numpy().copy() for p in model.parameters()]


def assert_same(a: list[Array], b: list[Array]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@contextlib.contextmanager
def _stopped(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def backward(model: Any, step: int, rank: int = 0) -> None:
    model.zero_grad()
    tw.loss_of(model, *tw.batch(1, rank, step)).backward()  # type: ignore[no-untyped-call]


def test_import_torch_is_pytorch_not_the_repo_folder() -> None:
    assert hasattr(torch.optim, "Optimizer")
    assert Path(torch.__file__).parent != ROOT / "torch"
    assert not (ROOT / "torch").exists()


def test_step_is_one_push_and_pull_bit_for_bit(client: Client) -> None:
    model = tw.make_model(seed=1)
    initial = params_np(model)
    opt = RemoteOptimizer(
        model.named_parameters(), client, group="opt", lr=tw.LR, optimizer=tw.SPEC
    )
    names = [n for n, _ in model.named_parameters()]
    info = client.describe_group("opt")
    assert [n for n, _ in info.tensors] == names
    client.create_group(
        "plain",
        tw.SPEC,
        learning_rate=tw.LR,
        tensors=list(zip(names, initial, strict=True)),
    )
    for step in range(4):
        backward(model, step)
        grads = grads_np(model)
        opt.step()
        client.push("plain", *grads, learning_rate=tw.LR)
        assert_same(params_np(model), client.pull("plain"))
        assert_same(params_np(model), client.pull("opt"))
        assert opt.version == step + 1
    assert client.describe_group("opt").update_count == 4


def test_step_runs_the_closure_and_returns_its_loss(client: Client) -> None:
    model = tw.make_model(seed=1)
    opt = RemoteOptimizer(model.parameters(), client, group="g", lr=tw.LR)
    x, y = tw.batch(1, 0, 0)

    def closure() -> float:
        opt.zero_grad()
        loss = tw.loss_of(model, x, y)
        loss.backward()  # type: ignore[no-untyped-call]
        return float(loss.detach())

    expected = float(tw.loss_of(model, x, y).detach())
    assert opt.step(closure) == expected
    assert client.describe_group("g").update_count == 1
    assert [n for n, _ in client.describe_group("g").tensors] == [
        "p0",
        "p1",
        "p2",
        "p3",
    ]


def test_a_second_worker_starts_from_the_servers_x(client: Client) -> None:
    first, second = tw.make_model(seed=1), tw.make_model(seed=2)
    opt1 = RemoteOptimizer(first.named_parameters(), client, group="g", lr=tw.LR)
    backward(first, 0)
    opt1.step()
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(params_np(first), params_np(second), strict=True)
    )
    opt2 = RemoteOptimizer(second.named_parameters(), client, group="g", lr=tw.LR)
    assert_same(params_np(second), params_np(first))
    assert opt2.version == 1


def test_joining_a_group_of_other_shapes_or_optimizer_is_refused(
    client: Client,
) -> None:
    model = tw.make_model(seed=1)
    RemoteOptimizer(model.named_parameters(), client, group="g", lr=tw.LR)
    other = torch.nn.Linear(6, 5)
    with pytest.raises(ValueError, match=r"group 'g' exists with float32 tensors"):
        RemoteOptimizer(other.named_parameters(), client, group="g", lr=tw.LR)
    with pytest.raises(
        ValueError, match=r"exists with optimizer Adam.*not the Momentum"
    ):
        RemoteOptimizer(
            model.named_parameters(),
            client,
            group="g",
            lr=tw.LR,
            optimizer=Momentum(0.9, 1.0),
        )


def test_state_dict_round_trip_restores_v_h_and_t(client: Client) -> None:
    model = tw.make_model(seed=1)
    opt = RemoteOptimizer(model.parameters(), client, group="g", lr=tw.LR)
    for step in range(3):
        backward(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    saved_state = client.pull("g", state=True)  # X..., V..., H...
    for step in range(3, 5):
        backward(model, step)
        opt.step()
    continued = params_np(model)

    buffer.seek(0)
    checkpoint = torch.load(buffer)
    sd = checkpoint["opt"]
    assert sd["onnxps"]["update_count"] == 3
    assert sd["onnxps"]["optimizer"] == "Adam"
    assert sorted(sd["state"][0]) == ["H", "V"]
    assert sd["param_groups"][0]["lr"] == tw.LR

    restored = tw.make_model(seed=99)  # another process, another init
    restored.load_state_dict(checkpoint["model"])
    opt2 = RemoteOptimizer(restored.parameters(), client, group="g2", lr=0.5)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == tw.LR
    assert opt2.version == 3
    info = client.describe_group("g2")
    assert info.update_count == 3 and info.learning_rate == pytest.approx(tw.LR)
    assert_same(client.pull("g2", state=True), saved_state)
    for step in range(3, 5):
        backward(restored, step)
        opt2.step()
    assert_same(params_np(restored), continued)


def test_load_state_dict_refuses_a_plain_torch_checkpoint(client: Client) -> None:
    model = tw.make_model(seed=1)
    opt = RemoteOptimizer(model.parameters(), client, group="g", lr=tw.LR)
    plain = torch.optim.Adam(model.parameters(), lr=tw.LR).state_dict()
    with pytest.raises(ValueError, match="no 'onnxps' entry"):
        opt.load_state_dict(plain)
    sd = opt.state_dict()
    sd["onnxps"]["format_version"] = 99
    with pytest.raises(ValueError, match="format_version 99: this version reads 1"):
        opt.load_state_dict(sd)


def _expected_step(
    client: Client, group: str, grads: list[Array], lr: float
) -> list[Array]:
    """X after one step of ``group`` with R=lr, by the stateless Apply RPC."""
    t, state = client.pull_versioned(group, state=True)
    n = len(grads)
    xs, vs, hs = state[:n], state[n : 2 * n], state[2 * n :]
    r = np.asarray(lr, dtype=np.float64)  # the push carries R as a double
    return client.apply(tw.SPEC, r, np.int64(t), *xs, *grads, *vs, *hs)[:n]


@pytest.mark.parametrize("consistency", [Async(), Sync(1)], ids=["async", "sync"])
def test_an_lr_scheduler_sets_the_r_of_the_step(
    client: Client, consistency: Async | Sync
) -> None:
    model = tw.make_model(seed=1)
    opt = RemoteOptimizer(
        model.parameters(),
        client,
        group="g",
        lr=0.1,
        optimizer=tw.SPEC,
        consistency=consistency,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25)
    for step, lr in enumerate([0.1, 0.025, 0.00625]):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr)
        backward(model, step)
        grads = grads_np(model)
        expected = _expected_step(client, "g", grads, lr)
        unscheduled = _expected_step(client, "g", grads, 0.1)
        opt.step()
        scheduler.step()
        assert_same(params_np(model), expected)
        if step:
            assert not np.array_equal(params_np(model)[0], unscheduled[0])


@pytest.mark.slow
def test_two_sync_workers_equal_one_process_with_averaged_gradients(
    server: ServerHandle, client: Client, one_thread: None
) -> None:
    steps = 5
    run_workers(tw.sync_worker, 2, server.address, "sync", steps)
    assert client.describe_group("sync").update_count == steps

    model = tw.make_model(seed=7)
    opt = RemoteOptimizer(model.parameters(), client, group="ref", lr=tw.LR)
    for step in range(steps):
        per_rank = []
        for rank in range(2):
            model.zero_grad()
            tw.loss_of(model, *tw.batch(7, rank, step)).backward()  # type: ignore[no-untyped-call]
            per_rank.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for p, g0, g1 in zip(model.parameters(), *per_rank, strict=True):
            p.grad = (g0 + g1) / 2
        opt.step()
    assert_same(client.pull("sync"), params_np(model))


def test_a_parameter_without_grad_pushes_zeros(client: Client) -> None:
    model = tw.make_model(seed=1)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    unused = torch.nn.Parameter(torch.full((3,), 0.5))
    params = [("frozen", frozen), *model.named_parameters(), ("unused", unused)]
    spec = Momentum(alpha=0.9, beta=1.0, norm_coefficient=0.1)
    opt = RemoteOptimizer(params, client, group="g", lr=tw.LR, optimizer=spec)
    names = [n for n, _ in client.describe_group("g").tensors]
    assert names == [n for n, _ in model.named_parameters()] + ["unused"]
    zeros = np.zeros(3, np.float32)
    client.create_group(
        "plain",
        spec,
        learning_rate=tw.LR,
        tensors=list(
            zip(names, [*params_np(model), unused.detach().numpy()], strict=True)
        ),
    )
    backward(model, 0)
    grads = grads_np(model)
    opt.step()
    client.push("plain", *grads, zeros, learning_rate=tw.LR)
    assert_same([*params_np(model), unused.detach().numpy()], client.pull("plain"))
    # norm_coefficient decays it: the operator ran on the zero gradient
    assert unused.detach().numpy().tolist() == pytest.approx([0.5 * (1 - 0.001)] * 3)
    assert frozen.tolist() == [1.0, 1.0]

    strict = RemoteOptimizer(
        [("w", unused)], client, group="strict", lr=tw.LR, missing_grad="error"
    )
    with pytest.raises(ValueError, match=r"parameter 'w' has no gradient this step"):
        strict.step()
    assert client.describe_group("strict").update_count == 0


def test_a_parameter_whose_shape_changed_is_a_clear_error(client: Client) -> None:
    model = tw.make_model(seed=1)
    opt = RemoteOptimizer(model.named_parameters(), client, group="g", lr=tw.LR)
    backward(model, 0)
    layer = model[2]  # type: ignore[index]
    layer.weight.data = torch.zeros(4, 8)  # e.g. a layer rebuilt in place
    layer.weight.grad = torch.zeros(4, 8)
    message = (
        r"parameter '2.weight' is now torch.float32 \(4, 8\), but group 'g' holds it "
        r"as float32 \(3, 8\): a group's tensors keep their shapes"
    )
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert client.describe_group("g").update_count == 0


def test_parameters_of_one_float_dtype_in_one_group(client: Client) -> None:
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="one dtype, float32 or float64"):
        RemoteOptimizer([a, b], client, group="g", lr=0.1)
    with pytest.raises(ValueError, match="one parameter group"):
        RemoteOptimizer([{"params": [a]}], client, group="g", lr=0.1)  # type: ignore[arg-type]
    opt = RemoteOptimizer([a], client, group="g", lr=0.1)
    with pytest.raises(ValueError, match="fixed when its group is created"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


@pytest.mark.parametrize("on_stale", ["raise", "skip"])
def test_a_stale_push_raises_or_resyncs(client: Client, on_stale: str) -> None:
    fast, slow = tw.make_model(seed=1), tw.make_model(seed=1)
    staleness = Async(max_staleness=0)
    opt_fast = RemoteOptimizer(
        fast.parameters(), client, group="g", lr=tw.LR, consistency=staleness
    )
    opt_slow = RemoteOptimizer(
        slow.parameters(),
        client,
        group="g",
        lr=tw.LR,
        on_stale=on_stale,  # type: ignore[arg-type]
    )
    backward(fast, 0)
    opt_fast.step()
    backward(slow, 0)
    if on_stale == "raise":
        with pytest.raises(FailedPreconditionError) as info:
            opt_slow.step()
        assert info.value.reason == "STALE_PUSH"
        return
    opt_slow.step()
    assert opt_slow.skipped_steps == 1 and opt_slow.version == 1
    assert_same(params_np(slow), params_np(fast))
    assert client.describe_group("g").update_count == 1


def test_shard_gives_each_rank_every_nth_item() -> None:
    assert list(shard(range(7), 1, 3)) == [1, 4]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 3\), got 3"):
        shard([1, 2], 3, 3)


@pytest.mark.slow
def test_example_digits_reaches_095_with_four_workers() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "torch_digits.py")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(r"held-out accuracy (\d\.\d+)", proc.stdout)
    assert found, proc.stdout
    assert float(found.group(1)) >= 0.95


@pytest.mark.slow
def test_example_digits_reused_reports_the_groups_mode_and_its_own_steps(
    server_processes: StartServer,
    tmp_path: Path,
) -> None:
    """Run twice against one server: the second run (sync by default) trains the
    async group the first made, and says so, with its own steps, not the whole T.
    2 workers, 1 epoch: 22 full batches of 32 each, one async step per push."""

    proc, address = server_processes(tmp_path / "server.log")
    example = [sys.executable, str(ROOT / "examples" / "torch_digits.py")]
    small = ["--address", address, "--workers", "2", "--epochs", "1"]
    outs = []
    for flags in (["--async"], []):
        run = subprocess.run(
            [*example, *small, *flags], capture_output=True, text=True, timeout=240
        )
        assert run.returncode == 0, run.stdout + run.stderr
        outs.append(run.stdout.splitlines())
    assert outs[0][0].startswith("2 workers (async), 44 server steps in ")
    assert len(outs[0]) == 1
    assert outs[1][0].startswith("2 workers (async), 44 server steps in ")
    assert outs[1][1] == (
        "(group digits-cnn existed at T=44: trained on from there, in its async "
        "mode; now T=88)"
    )


@pytest.mark.parametrize("shared_memory", ["off", "auto"])
def test_step_writes_x_straight_into_the_parameters(
    tmp_path: Path, shared_memory: str
) -> None:
    """X lands in the parameters' own storage: over gRPC the reply's chunks are
    assembled in them, through shared memory it is copied in once; either way no
    array of X's size is made in this process (tracemalloc sees NumPy's arrays,
    not torch's tensors; the server runs in a process of its own), and the
    parameters stay the same tensors."""
    import tracemalloc

    from onnxps.cli.process import start_server_process

    model = torch.nn.Linear(2048, 2048)  # 16 MiB of X: a streamed push
    proc, address = start_server_process(log=tmp_path / "server.log")
    with (
        Client(address, timeout=30.0, shared_memory=shared_memory) as c,  # type: ignore[arg-type]
        _stopped(proc),
    ):
        opt = RemoteOptimizer(model.parameters(), c, group="big", lr=0.01)
        ptrs = [p.data_ptr() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.25)
        opt.step()  # warm up
        tracemalloc.start()
        try:
            opt.step()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert [p.data_ptr() for p in model.parameters()] == ptrs
        assert_same(params_np(model), c.pull("big"))
    assert peak < 8 << 20  # half of X: a fresh X would exceed it
