"""A worker that computes while its pushes travel (the demo's MLP on digits).

A blocking worker is idle for the whole round trip of every push. This one starts
the push of step k's gradients, computes step k+1 on the parameters it already has,
and only then takes the parameters push k returned. Step k+1's gradients are thus
computed one update behind; the group is async with ``max_staleness`` and each push
says which T it was computed against (``base_version``), so the server refuses a
push that fell further behind than the group allows.

    onnxps serve &
    python examples/overlap_worker.py --mode overlapped      # Client.push_background
    python examples/overlap_worker.py --mode asyncio         # AsyncClient + tasks
    python examples/overlap_worker.py --mode blocking        # for comparison

``push_background`` needs no asyncio: it returns a ``concurrent.futures.Future``, so a
NumPy or PyTorch loop changes two lines. Leave the gradients of a pending push
unchanged until its future is done (a large, streamed push reads them as it sends).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
from onnxps.cli._demo_worker import (
    Dataset,
    accuracy,
    init_params,
    load_dataset,
    loss_and_grads,
)
from onnxps.client import (
    Adam,
    AlreadyExistsError,
    Async,
    AsyncClient,
    Client,
    PushResult,
)

Array = np.ndarray[Any, Any]
Compute = Callable[[Sequence[Array]], list[Array]]


def minibatches(
    data: Dataset, batch_size: int, seed: int
) -> Callable[[Sequence[Array]], list[Array]]:
    """Gradients of the MLP on the next random minibatch of the training set."""
    rng = np.random.default_rng(seed)

    def compute(params: Sequence[Array]) -> list[Array]:
        batch = rng.choice(len(data.x_train), size=batch_size, replace=False)
        return loss_and_grads(params, data.x_train[batch], data.y_train[batch])[1]

    return compute


def train_blocking(ps: Client, group: str, compute: Compute, steps: int) -> int:
    """Compute, push, wait for the new parameters; returns the final T."""
    t, params = ps.pull_versioned(group)
    for _ in range(steps):
        result = ps.push_detailed(
            group, *compute(params), base_version=t, return_values=True
        )
        t, params = result.update_count, result.values or []
    return t


def train_overlapped(ps: Client, group: str, compute: Compute, steps: int) -> int:
    """Push step k in the background, compute step k+1, then take push k's result."""
    t, params = ps.pull_versioned(group)
    pending: Future[PushResult] | None = None
    for _ in range(steps):
        grads = compute(params)  # while the previous push travels
        base = t  # the T these gradients were computed against
        if pending is not None:
            done = pending.result()
            t, params = done.update_count, done.values or []
        pending = ps.push_background(
            group, *grads, base_version=base, return_values=True
        )
    return pending.result().update_count if pending is not None else t


async def train_overlapped_async(
    ps: AsyncClient, group: str, compute: Compute, steps: int
) -> int:
    """The same loop on asyncio: the push is a task, the compute runs in a thread
    so the event loop keeps sending while it runs."""
    t, params = await ps.pull_versioned(group)
    pending: asyncio.Task[PushResult] | None = None
    for _ in range(steps):
        grads = await asyncio.to_thread(compute, params)
        base = t
        if pending is not None:
            done = await pending
            t, params = done.update_count, done.values or []
        pending = asyncio.create_task(
            ps.push_detailed(group, *grads, base_version=base, return_values=True)
        )
    return (await pending).update_count if pending is not None else t


def create_group(ps: Client, group: str, seed: int, learning_rate: float) -> None:
    try:
        ps.create_group(
            group,
            Adam(),
            learning_rate=learning_rate,
            tensors=init_params(seed),
            consistency=Async(max_staleness=1),  # one push in flight per worker
        )
    except AlreadyExistsError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--group", default="digits-overlap")
    ap.add_argument(
        "--mode", choices=("blocking", "overlapped", "asyncio"), default="overlapped"
    )
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--learning-rate", type=float, default=0.003)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    data = load_dataset(args.seed)
    compute = minibatches(data, args.batch_size, args.seed + 1)
    group = f"{args.group}-{args.mode}"
    started = time.perf_counter()
    with Client(args.address) as ps:
        create_group(ps, group, args.seed, args.learning_rate)
        if args.mode == "blocking":
            t = train_blocking(ps, group, compute, args.steps)
        elif args.mode == "overlapped":
            t = train_overlapped(ps, group, compute, args.steps)
        else:

            async def run() -> int:
                async with AsyncClient(args.address) as aps:
                    return await train_overlapped_async(aps, group, compute, args.steps)

            t = asyncio.run(run())
        acc = accuracy(ps.pull(group), data.x_test, data.y_test)
    seconds = time.perf_counter() - started
    print(f"{args.mode}: T={t} in {seconds:.1f} s, held-out accuracy {acc:.4f}")


if __name__ == "__main__":
    main()
