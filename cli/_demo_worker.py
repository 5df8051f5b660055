"""The demo's worker: a small NumPy MLP trained on one shard of scikit-learn's digits.

Run by ``onnxps demo`` (one process per worker) and by the docker-compose worker
services. Every setting has an ``ONNXPS_*`` environment default so a container needs
no command-line flags. The worker creates the group if it is missing (every worker
builds the same initial parameters from the seed, so whichever create wins is the same),
then repeats: compute gradients on a minibatch of its shard, push them, and take the
parameters the server returns after its step.

Output, one line at a time (``onnxps demo`` parses it):

    worker 0/4 step 50/300 loss 0.4321
    worker 0/4 done: 300 steps, held-out accuracy 0.9722

A worker started before its server waits for it, up to ``--timeout``
(``ONNXPS_TIMEOUT``): compose under podman older than 4.6 starts the workers with
the server, its ``depends_on: service_healthy`` ignored.

Exit status: 0 when trained, 3 when the server is unreachable (after that wait) or
goes away, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnxps.client import (
    Adagrad,
    Adam,
    AlreadyExistsError,
    Async,
    Client,
    DeadlineExceededError,
    Momentum,
    OnnxpsError,
    OptimizerSpec,
    RpcError,
    Sync,
    UnavailableError,
)
from onnxps.client._cluster import parse_target

from ._args import Parser, at_least, positive_float

__all__ = [
    "LEARNING_RATES",
    "OPTIMIZERS",
    "Dataset",
    "accuracy",
    "init_params",
    "load_dataset",
    "loss_and_grads",
    "loss_text",
    "main",
    "optimizer_spec",
]

Array = np.ndarray[Any, Any]

HIDDEN = 64
TEST_FRACTION = 0.2
OPTIMIZERS = ("adam", "adagrad", "momentum", "nesterov")
# Tuned so that 4 async workers reach > 0.9 held-out accuracy in a few hundred steps.
LEARNING_RATES = {"adam": 0.003, "adagrad": 0.05, "momentum": 0.02, "nesterov": 0.03}
EXIT_SERVER_GONE = 3


def loss_text(loss: float) -> str:
    """A loss to read: four decimals, or two significant digits below 0.001 (a
    long run's loss is not ``0.0000``)."""
    if loss == 0 or abs(loss) >= 0.001 or not np.isfinite(loss):
        return f"{loss:.4f}"
    return f"{loss:.2e}"


def optimizer_spec(name: str) -> OptimizerSpec:
    """The ONNX optimizer node for ``name`` (momentum/nesterov: alpha 0.9, beta 1)."""
    if name == "adam":
        return Adam()
    if name == "adagrad":
        return Adagrad()
    if name == "momentum":
        return Momentum(alpha=0.9, beta=1.0, mode="standard", norm_coefficient=0.0)
    if name == "nesterov":
        return Momentum(alpha=0.9, beta=1.0, mode="nesterov", norm_coefficient=0.0)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


@dataclass(frozen=True)
class Dataset:
    x_train: Array
    y_train: Array
    x_test: Array
    y_test: Array

    def shard(self, index: int, count: int) -> tuple[Array, Array]:
        """Worker ``index`` of ``count`` trains on every count-th training example."""
        return self.x_train[index::count], self.y_train[index::count]


def load_dataset(seed: int = 0) -> Dataset:
    """Digits (8x8 images, 10 classes; shipped inside scikit-learn), split 80/20."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = int(len(x) * TEST_FRACTION)
    return Dataset(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def init_params(seed: int, n_in: int = 64, n_out: int = 10) -> dict[str, Array]:
    """W1, b1, W2, b2 in the ONNX order the group keeps (Glorot-scaled weights)."""
    rng = np.random.default_rng(seed)
    w1 = rng.normal(0.0, np.sqrt(2.0 / (n_in + HIDDEN)), (n_in, HIDDEN))
    w2 = rng.normal(0.0, np.sqrt(2.0 / (HIDDEN + n_out)), (HIDDEN, n_out))
    return {
        "w1": w1.astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": w2.astype(np.float32),
        "b2": np.zeros(n_out, np.float32),
    }


def _forward(params: Sequence[Array], x: Array) -> tuple[Array, Array]:
    w1, b1, w2, b2 = params
    hidden = np.tanh(x @ w1 + b1)
    logits = hidden @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    return hidden, probs


def loss_and_grads(
    params: Sequence[Array], x: Array, y: Array
) -> tuple[float, list[Array]]:
    """Mean cross-entropy and its gradients G_1..G_4 (same order as the params)."""
    w1, _, w2, _ = params
    hidden, probs = _forward(params, x)
    n = len(x)
    loss = float(-np.log(probs[np.arange(n), y] + 1e-12).mean())
    d_logits = probs
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= n
    g_w2 = hidden.T @ d_logits
    g_b2 = d_logits.sum(axis=0)
    d_hidden = (d_logits @ w2.T) * (1.0 - hidden * hidden)
    g_w1 = x.T @ d_hidden
    g_b1 = d_hidden.sum(axis=0)
    grads = [g_w1, g_b1, g_w2, g_b2]
    return loss, [
        g.astype(w.dtype, copy=False) for g, w in zip(grads, params, strict=True)
    ]


def accuracy(params: Sequence[Array], x: Array, y: Array) -> float:
    return float((_forward(params, x)[1].argmax(axis=1) == y).mean())


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(f"ONNXPS_{name}", default)


def _parser() -> argparse.ArgumentParser:
    # Defaults are the ONNXPS_* strings, checked by the flag's type like a flag.
    p = Parser(
        prog="python -m onnxps.cli._demo_worker",
        description="train the demo MLP on one shard of digits through onnxps",
    )
    p.add_argument("--address", default=_env("ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--group", default=_env("GROUP", "digits-mlp"))
    p.add_argument("--index", type=at_least(0), default=_env("WORKER_INDEX", "0"))
    p.add_argument("--workers", type=at_least(1), default=_env("WORKERS", "4"))
    p.add_argument("--steps", type=at_least(1), default=_env("STEPS", "300"))
    p.add_argument("--batch-size", type=at_least(1), default=_env("BATCH_SIZE", "32"))
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=_env("OPTIMIZER", "adam"))
    p.add_argument(
        "--learning-rate", type=positive_float, default=_env("LEARNING_RATE", None)
    )
    p.add_argument("--mode", choices=("async", "sync"), default=_env("MODE", "async"))
    p.add_argument("--seed", type=at_least(0), default=_env("SEED", "0"))
    p.add_argument("--log-every", type=at_least(1), default=_env("LOG_EVERY", "10"))
    p.add_argument("--timeout", type=positive_float, default=_env("TIMEOUT", "10"))
    p.add_argument("--token", default=_env("TOKEN", None))
    p.add_argument("--tls-ca", default=_env("TLS_CA", None))
    return p


def create_group_if_missing(
    client: Client,
    group: str,
    optimizer: str,
    learning_rate: float,
    mode: str,
    workers: int,
    seed: int,
) -> None:
    consistency = Sync(workers) if mode == "sync" else Async()
    try:
        client.create_group(
            group,
            optimizer_spec(optimizer),
            learning_rate=learning_rate,
            tensors=init_params(seed),
            consistency=consistency,
        )
    except AlreadyExistsError:
        pass


def wait_for_server(ps: Client, address: str, timeout: float, tag: str) -> None:
    """Return once the server answers (any answer: a refusal says it is up), or
    raise its UnavailableError or DeadlineExceededError after ``timeout`` seconds.
    Says once on stderr that it waits."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            ps.list_groups(timeout=max(0.5, min(2.0, deadline - time.monotonic())))
            return
        except (UnavailableError, DeadlineExceededError):
            if time.monotonic() >= deadline:
                raise
            if not said:
                _say(f"{tag}: waiting up to {timeout:g} s for the server at {address}")
                said = True
            time.sleep(0.5)
        except RpcError:
            return


def _train(args: argparse.Namespace, tag: str) -> None:
    lr = args.learning_rate
    if lr is None:
        lr = LEARNING_RATES[args.optimizer]
    data = load_dataset(args.seed)
    x, y = data.shard(args.index, args.workers)
    rng = np.random.default_rng(args.seed * 1000 + args.index + 1)
    roots = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            roots = f.read()
    with Client(
        parse_target(args.address),
        timeout=args.timeout,
        token=args.token,
        root_certificates=roots,
    ) as ps:
        wait_for_server(ps, args.address, args.timeout, tag)
        create_group_if_missing(
            ps, args.group, args.optimizer, lr, args.mode, args.workers, args.seed
        )
        if args.mode == "sync":
            ps.join(args.group)
        params = ps.pull(args.group)
        smoothed = None
        for step in range(1, args.steps + 1):
            batch = rng.choice(len(x), size=min(args.batch_size, len(x)), replace=False)
            loss, grads = loss_and_grads(params, x[batch], y[batch])
            smoothed = loss if smoothed is None else 0.9 * smoothed + 0.1 * loss
            # One call: push G_1..G_4 and get X_1..X_4 after the step (sync: after the
            # step this push took part in).
            params = ps.push(args.group, *grads, return_values=True)
            if step % args.log_every == 0 or step == args.steps:
                line = f"{tag} step {step}/{args.steps} loss {loss_text(smoothed)}"
                print(line, flush=True)
        if args.mode == "sync":
            ps.leave(args.group)
        acc = accuracy(ps.pull(args.group), data.x_test, data.y_test)
    print(f"{tag} done: {args.steps} steps, held-out accuracy {acc:.4f}", flush=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tag = f"worker {args.index}/{args.workers}"
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _train(args, tag)
    except (UnavailableError, DeadlineExceededError) as exc:
        _say(
            f"{tag}: the parameter server at {args.address} is unreachable or gone "
            f"({exc.details}); stopping"
        )
        return EXIT_SERVER_GONE
    except OnnxpsError as exc:
        _say(f"{tag}: {exc}; stopping")
        return 1
    except KeyboardInterrupt:
        _say(f"{tag}: interrupted")
        return 130
    return 0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
