"""The same model trained with torch.optim and with RemoteOptimizer: loss curves.

An MLP on scikit-learn's digits, one process, the same initial values and the same
batches for every run, float32, one torch thread. Pairs:

- ``torch.optim.Adam(lr)`` vs ``RemoteOptimizer(optimizer=Adam(), lr)``: ONNX Adam
  adds epsilon after the square root of H without bias correction and folds the bias
  correction into R (and takes its first step, T=0, without any), so the curves
  differ;
- ``torch.optim.SGD(lr, momentum=0.9)`` vs ``Momentum(alpha=0.9, beta=1.0)``: the
  same recurrence (V = 0.9 V + G, the first V = G; X -= R V), equal up to rounding.

Prints a Markdown table of the mean training loss over windows of steps and the
held-out accuracy at the end.

    python benchmarks/torch_numerics.py [--steps 300]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from onnxps.client import Adam, Client, Momentum, OptimizerSpec
from onnxps.server.app import ServerConfig, create_server
from onnxps.torch import RemoteOptimizer
from sklearn.datasets import load_digits
from torch import nn

Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def data() -> Data:
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(x)))
    x, y = x[order], y[order]
    return x[360:], y[360:], x[:360], y[:360]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def train(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer], d: Data, steps: int
) -> tuple[list[float], float]:
    x, y, x_test, y_test = d
    model = make_model()
    opt = make_opt(model)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = torch.randint(0, len(x), (32,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    return losses, accuracy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = data()
    server = create_server(ServerConfig(address="127.0.0.1:0", durability="none"))
    server.start()
    runs: dict[str, tuple[list[float], float]] = {}
    try:
        with Client(server.address) as ps:

            def remote(
                spec: OptimizerSpec, lr: float, group: str
            ) -> Callable[..., Any]:
                return lambda m: RemoteOptimizer(
                    m.parameters(), ps, group=group, lr=lr, optimizer=spec
                )

            runs["torch.optim.Adam(lr=1e-3)"] = train(
                lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), d, args.steps
            )
            runs["RemoteOptimizer Adam() lr=1e-3"] = train(
                remote(Adam(), 1e-3, "adam"), d, args.steps
            )
            runs["torch.optim.SGD(lr=0.05, momentum=0.9)"] = train(
                lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                d,
                args.steps,
            )
            runs["RemoteOptimizer Momentum(0.9, 1.0) lr=0.05"] = train(
                remote(Momentum(alpha=0.9, beta=1.0), 0.05, "momentum"), d, args.steps
            )
    finally:
        server.stop(grace=0)

    edges = [0, 1, 10, 50, 100, 200, args.steps]
    windows = [
        (a, b) for a, b in zip(edges, edges[1:], strict=False) if b <= args.steps
    ]
    head = " | ".join(f"steps {a + 1}-{b}" for a, b in windows)
    print(f"| optimizer | {head} | held-out accuracy |")
    print("|---|" + "---:|" * (len(windows) + 1))
    for name, (losses, accuracy) in runs.items():
        cells = " | ".join(f"{np.mean(losses[a:b]):.4f}" for a, b in windows)
        print(f"| {name} | {cells} | {accuracy:.3f} |")
    sgd = runs["torch.optim.SGD(lr=0.05, momentum=0.9)"][0]
    mom = runs["RemoteOptimizer Momentum(0.9, 1.0) lr=0.05"][0]
    gap = max(abs(a - b) for a, b in zip(sgd, mom, strict=True))
    print(f"\nlargest per-step loss gap SGD-momentum vs ONNX Momentum: {gap:.2e}")


if __name__ == "__main__":
    main()
