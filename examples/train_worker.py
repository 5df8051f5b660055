"""A worker you can copy: softmax regression on scikit-learn's digits through onnxps.

Start a server, then one process per worker (each trains on its own shard):

    onnxps serve &
    python examples/train_worker.py --index 0 --workers 2 &
    python examples/train_worker.py --index 1 --workers 2

Everything onnxps-specific is in ``main``: create the group (the tensor order given here
is the ONNX order X_1..X_n from then on), push gradients G_1..G_n in that order, and
take back X_1..X_n after the server's Adam step.
"""

from __future__ import annotations

import argparse

import numpy as np
from onnxps.client import Adam, AlreadyExistsError, Client
from sklearn.datasets import load_digits


def softmax_regression_grads(
    w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    """Mean cross-entropy of softmax(x @ w + b) and its gradients for w and b."""
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(x)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    p[np.arange(n), y] -= 1.0
    p /= n
    return loss, (x.T @ p).astype(w.dtype), p.sum(axis=0).astype(b.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--group", default="digits-softmax")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--learning-rate", type=float, default=0.01)
    args = ap.parse_args()

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    order = np.random.default_rng(0).permutation(len(x))  # same split in every worker
    x, y = x[order], y[order]
    x_test, y_test, x_train, y_train = x[:360], y[:360], x[360:], y[360:]
    x_mine, y_mine = (
        x_train[args.index :: args.workers],
        y_train[args.index :: args.workers],
    )

    with Client(args.address) as ps:
        try:
            ps.create_group(
                args.group,
                Adam(),  # ONNX defaults: alpha 0.9, beta 0.999, epsilon 1e-6
                learning_rate=args.learning_rate,
                tensors={
                    "w": np.zeros((64, 10), np.float32),  # X_1
                    "b": np.zeros(10, np.float32),  # X_2
                },
            )
        except AlreadyExistsError:
            pass  # another worker created it first
        w, b = ps.pull(args.group)
        rng = np.random.default_rng(args.index)
        for step in range(1, args.steps + 1):
            batch = rng.choice(len(x_mine), size=32, replace=False)
            loss, g_w, g_b = softmax_regression_grads(
                w, b, x_mine[batch], y_mine[batch]
            )
            # G_1, G_2 in the order of X_1, X_2; the reply is X_1, X_2 after the step.
            w, b = ps.push(args.group, g_w, g_b, return_values=True)
            if step % 50 == 0:
                print(f"worker {args.index} step {step} loss {loss:.4f}", flush=True)
        w, b = ps.pull(args.group)
    accuracy = float(((x_test @ w + b).argmax(axis=1) == y_test).mean())
    print(f"worker {args.index} held-out accuracy {accuracy:.4f}")


if __name__ == "__main__":
    main()
