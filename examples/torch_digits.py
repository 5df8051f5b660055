"""A small CNN on scikit-learn's digits, trained by 4 PyTorch worker processes.

    python examples/torch_digits.py                    # starts its own server
    python examples/torch_digits.py --address HOST:PORT --workers 4 --async

Every worker builds the same model and a ``RemoteOptimizer`` on one group: the first
creates it, the others join and start from the server's X. Each trains on its shard
of the training set (sync mode: one Adam step per round of 4 pushes, their gradients
averaged). The parent then pulls the group into its own model and measures the
held-out accuracy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from onnxps.client import Adam, Async, Client, GroupInfo, NotFoundError, Sync
from onnxps.torch import RemoteOptimizer, run_workers, shard
from sklearn.datasets import load_digits
from torch import nn

GROUP = "digits-cnn"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and held-out sets, the same in every process."""
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(digits.target)
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(x)))
    x, y = x[order], y[order]
    return x[360:], y[360:], x[:360], y[:360]


def worker(
    rank: int, nprocs: int, address: str, epochs: int, lr: float, sync: bool
) -> None:
    torch.set_num_threads(1)
    x_train, y_train, _, _ = split()
    mine = shard(range(len(x_train)), rank, nprocs)
    x, y = x_train[list(mine)], y_train[list(mine)]
    model = make_model()
    consistency = Sync(nprocs) if sync else Async()
    with Client(address) as ps:
        opt = RemoteOptimizer(
            model.named_parameters(),
            ps,
            group=GROUP,
            lr=lr,
            optimizer=Adam(),
            consistency=consistency,
            join=sync,
        )
        gen = torch.Generator().manual_seed(rank)
        for _ in range(epochs):
            for batch in torch.randperm(len(x), generator=gen).split(32):
                if len(batch) < 32:
                    continue  # every worker takes the same number of sync steps
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
                opt.step()
        opt.leave()


def evaluate(address: str) -> float:
    _, _, x_test, y_test = split()
    model = make_model()
    with Client(address) as ps, torch.no_grad():
        for p, value in zip(model.parameters(), ps.pull(GROUP), strict=True):
            p.copy_(torch.from_numpy(value))
    return float((model(x_test).argmax(1) == y_test).float().mean())


def existing(address: str) -> GroupInfo | None:
    """The group as it is before this run (None: the first worker creates it)."""
    with Client(address) as ps:
        try:
            return ps.describe_group(GROUP)
        except NotFoundError:
            return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", help="a running server (default: start one here)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--learning-rate", type=float, default=0.002)
    ap.add_argument("--async", dest="sync", action="store_false")
    args = ap.parse_args()

    server = None
    address = args.address
    if address is None:
        from onnxps.server.app import ServerConfig, create_server

        config = ServerConfig(address="127.0.0.1:0", durability="none")
        server = create_server(config).start()
        address = server.address
    try:
        before = existing(address)
        start = time.perf_counter()
        run_workers(
            worker,
            args.workers,
            address,
            args.epochs,
            args.learning_rate,
            args.sync,
        )
        took = time.perf_counter() - start
        with Client(address) as ps:
            info = ps.describe_group(GROUP)
        accuracy = evaluate(address)
        # The group's own mode and this run's steps: a group that existed is used
        # as it is, whatever --async says, and its T counts earlier runs too.
        mode = "sync" if isinstance(info.consistency, Sync) else "async"
        steps = info.update_count - (0 if before is None else before.update_count)
        print(
            f"{args.workers} workers ({mode}), {steps} server steps in {took:.1f} s; "
            f"held-out accuracy {accuracy:.4f}"
        )
        if before is not None:
            print(
                f"(group {GROUP} existed at T={before.update_count}: trained on from "
                f"there, in its {mode} mode; now T={info.update_count})"
            )
    finally:
        if server is not None:
            server.stop(grace=0)


if __name__ == "__main__":
    main()
