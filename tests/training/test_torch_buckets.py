"""onnxps.torch.BucketedOptimizer: pushes during backward, RemoteOptimizer's results."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed: pip install 'torch==2.13.0+cpu'"
)

import torch_workers as tw  # noqa: E402
from onnxps.client import Async, Client, FailedPreconditionError  # noqa: E402
from onnxps.torch import BucketedOptimizer, RemoteOptimizer  # noqa: E402
from onnxps.torch._buckets import _split  # noqa: E402

Array = np.ndarray[Any, Any]


def params_np(model: Any) -> list[Array]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def backward(model: Any, step: int) -> None:
    model.zero_grad()
    tw.loss_of(model, *tw.batch(1, 0, step)).backward()  # type: ignore[no-untyped-call]


def test_buckets_are_cut_from_the_last_parameter_back() -> None:
    assert _split([4, 4, 4, 4], 8) == [[2, 3], [0, 1]]
    assert _split([4, 4, 4, 4, 4], 8) == [[3, 4], [1, 2], [0]]
    assert _split([1, 1, 100], 8) == [[2], [0, 1]]
    assert _split([100, 1, 1], 8) == [[0, 1, 2]]
    assert _split([1, 1], 1000) == [[0, 1]]


def test_bucketed_steps_equal_remote_optimizer_bit_for_bit(client: Client) -> None:
    one, bucketed = tw.make_model(seed=1), tw.make_model(seed=1)
    plain = RemoteOptimizer(
        one.named_parameters(), client, group="one", lr=tw.LR, optimizer=tw.SPEC
    )
    opt = BucketedOptimizer(
        bucketed.named_parameters(),
        client,
        group="b",
        lr=tw.LR,
        optimizer=tw.SPEC,
        bucket_bytes=30,
    )
    # from the last: 2.bias (12 bytes) + 2.weight (96), 0.bias (32), 0.weight (192)
    assert [
        [n for n, _ in client.describe_group(f"b.{k}").tensors] for k in range(3)
    ] == [
        ["2.weight", "2.bias"],
        ["0.bias"],
        ["0.weight"],
    ]
    for step in range(5):
        backward(one, step)
        backward(bucketed, step)
        plain.step()
        opt.step()
        assert opt.versions == [step + 1] * 3
        for a, b in zip(params_np(one), params_np(bucketed), strict=True):
            assert a.tobytes() == b.tobytes()
    # the parameters hold the servers' X when step() returns
    x = [a for k in (2, 1, 0) for a in client.pull(f"b.{k}")]
    by_name = dict(
        zip(
            ["0.weight", "0.bias", "2.weight", "2.bias"],
            params_np(bucketed),
            strict=True,
        )
    )
    for name, value in zip(
        ["0.weight", "0.bias", "2.weight", "2.bias"], x, strict=True
    ):
        assert value.tobytes() == by_name[name].tobytes()


def test_a_bucket_is_pushed_during_backward_before_step(client: Client) -> None:
    model = tw.make_model(seed=1)
    opt = BucketedOptimizer(
        model.named_parameters(), client, group="b", lr=tw.LR, bucket_bytes=30
    )
    before = params_np(model)
    backward(model, 0)
    # step() is not called yet: every bucket's push was started by backward
    for k in range(3):
        t, _ = client.pull_versioned(f"b.{k}", min_version=1, timeout=30)
        assert t == 1
    opt.step()
    assert opt.versions == [1, 1, 1]
    assert all(
        not np.array_equal(a, b) for a, b in zip(before, params_np(model), strict=True)
    )


def test_a_parameter_without_gradient_is_pushed_as_zeros_at_step(
    client: Client,
) -> None:
    model = tw.make_model(seed=1)
    opt = BucketedOptimizer(
        model.named_parameters(), client, group="b", lr=tw.LR, bucket_bytes=30
    )
    model.zero_grad()
    first = model.get_submodule("0")  # the last layer takes no part
    first(tw.batch(1, 0, 0)[0]).sum().backward()
    opt.step()
    assert opt.versions == [1, 1, 1]
    assert client.describe_group("b.0").update_count == 1


def test_a_second_backward_before_step_raises(client: Client) -> None:
    model = tw.make_model(seed=1)
    BucketedOptimizer(model.parameters(), client, group="b", lr=tw.LR)
    backward(model, 0)
    with pytest.raises(RuntimeError, match=r"a second backward\(\) before step\(\)"):
        tw.loss_of(model, *tw.batch(1, 0, 1)).backward()  # type: ignore[no-untyped-call]


def test_learning_rate_follows_the_param_group(client: Client) -> None:
    one, bucketed = tw.make_model(seed=1), tw.make_model(seed=1)
    plain = RemoteOptimizer(one.parameters(), client, group="one", lr=tw.LR)
    opt = BucketedOptimizer(bucketed.parameters(), client, group="b", lr=tw.LR)
    for o in (plain, opt):
        o.param_groups[0]["lr"] = 0.5
    backward(one, 0)
    backward(bucketed, 0)
    plain.step()
    opt.step()
    for a, b in zip(params_np(one), params_np(bucketed), strict=True):
        assert a.tobytes() == b.tobytes()


def test_state_dict_round_trip_restores_every_bucket(client: Client) -> None:
    model = tw.make_model(seed=1)
    opt = BucketedOptimizer(
        model.parameters(), client, group="b", lr=tw.LR, bucket_bytes=30
    )
    for step in range(2):
        backward(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    for step in range(2, 4):
        backward(model, step)
        opt.step()
    continued = params_np(model)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    restored = tw.make_model(seed=5)
    restored.load_state_dict(checkpoint["model"])
    opt2 = BucketedOptimizer(
        restored.parameters(), client, group="c", lr=0.3, bucket_bytes=30
    )
    opt2.load_state_dict(checkpoint["opt"])
    assert opt2.versions == [2, 2, 2] and opt2.param_groups[0]["lr"] == tw.LR
    for step in range(2, 4):
        backward(restored, step)
        opt2.step()
    for a, b in zip(continued, params_np(restored), strict=True):
        assert a.tobytes() == b.tobytes()
    with pytest.raises(ValueError, match="it has no 'onnxps_buckets' entry"):
        opt2.load_state_dict({"state": {}, "param_groups": []})


def test_a_gradient_changed_after_its_push_makes_step_raise(client: Client) -> None:
    model = tw.make_model(seed=1)
    opt = BucketedOptimizer(model.parameters(), client, group="b", lr=tw.LR)
    backward(model, 0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=r"the gradient of 'p0' changed after"):
        opt.step()
    assert opt.versions == [1]  # the step was taken, with backward's gradients
    backward(model, 1)  # and the next step is a step as usual
    opt.step()
    assert opt.versions == [2]


def test_without_hooks_step_pushes_every_bucket_and_pull_reads_them(
    client: Client,
) -> None:
    model = tw.make_model(seed=1)
    opt = BucketedOptimizer(
        model.parameters(), client, group="b", lr=tw.LR, bucket_bytes=30
    )
    opt.remove_hooks()
    backward(model, 0)
    for k in range(3):  # nothing was pushed by backward
        assert client.describe_group(f"b.{k}").update_count == 0
    opt.step()
    assert opt.versions == [1, 1, 1]
    stepped = params_np(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert opt.pull() == [1, 1, 1]
    for a, b in zip(stepped, params_np(model), strict=True):
        assert a.tobytes() == b.tobytes()


def test_a_second_worker_joins_the_buckets_and_a_stale_push_raises(
    client: Client,
) -> None:
    first, second = tw.make_model(seed=1), tw.make_model(seed=2)
    kwargs: dict[str, Any] = {"lr": tw.LR, "consistency": Async(max_staleness=0)}
    opt1 = BucketedOptimizer(first.parameters(), client, group="b", **kwargs)
    opt2 = BucketedOptimizer(second.parameters(), client, group="b", **kwargs)
    for a, b in zip(params_np(first), params_np(second), strict=True):
        assert a.tobytes() == b.tobytes()  # the joiner copied the server's X
    backward(first, 0)
    opt1.step()
    backward(second, 0)
    with pytest.raises(FailedPreconditionError) as info:
        opt2.step()  # computed on T=0, the server is at T=1
    assert info.value.reason == "STALE_PUSH"
