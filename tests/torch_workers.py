"""What the onnxps.torch tests' worker processes and the tests agree on.

A worker's batch is a pure function of (seed, rank, step) and the model's initial
values of the seed, so a test can recompute every gradient in one process.
"""

from __future__ import annotations

import torch
from onnxps.client import Adam, Client, Sync
from onnxps.torch import RemoteOptimizer

LR = 0.01
SPEC = Adam(epsilon=1e-6)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    )


def batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + step)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def sync_worker(rank: int, nprocs: int, address: str, group: str, steps: int) -> None:
    """One data-parallel worker: its own shard, a sync group of ``nprocs``."""
    torch.set_num_threads(1)  # a gradient computed here equals the test's, bit for bit
    model = make_model(seed=7)
    with Client(address, timeout=60.0) as ps:
        opt = RemoteOptimizer(
            model.named_parameters(),
            ps,
            group=group,
            lr=LR,
            optimizer=SPEC,
            consistency=Sync(nprocs),
            join=True,
        )
        for step in range(steps):
            opt.zero_grad()
            loss_of(model, *batch(7, rank, opt.version)).backward()  # type: ignore[no-untyped-call]
            opt.step()
            assert opt.version == step + 1
        opt.leave()
