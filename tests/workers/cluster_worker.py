"""A worker process of the cluster tests: pushes to some groups of a cluster.

    cluster_worker.py ADDRESSES GROUPS WORKER WORKERS --steps N [--turns] [--seed S]
                      [--async]

ADDRESSES and GROUPS are comma-separated. For each group in turn (every worker takes
them in the same order): a sync group is joined and stepped N times (push with
base_version=T, then wait for T + 1); an async group is pushed N times, with
``--turns`` in turn (worker w pushes at T = k * WORKERS + w), so the order of the
pushes, and so the result, is the same on every run. Gradients are a pure function
of (seed, worker, step) and the group's shapes and dtype. Prints ``done`` at the end.
With ``--async`` the worker is an ``AsyncClient`` (the same steps, awaited).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from onnxps.client import AsyncClient, Client, GroupInfo, Sync


def gradients(info: GroupInfo, seed: int, worker: int, step: int) -> list[Any]:
    rng = np.random.default_rng([seed, worker, step])
    return [rng.standard_normal(s).astype(info.dtype) for _, s in info.tensors]


class _Awaiting:
    """A Client awaited like an AsyncClient: one worker loop serves both."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        fn = getattr(self._client, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return call


async def run_group(ps: Any, group: str, args: argparse.Namespace) -> None:
    info = await ps.describe_group(group)
    w = args.worker
    if isinstance(info.consistency, Sync):
        await ps.join(group)
        t = (await ps.pull_versioned(group))[0]
        for _ in range(args.steps):
            await ps.push(group, *gradients(info, args.seed, w, t), base_version=t)
            t = (await ps.pull_versioned(group, min_version=t + 1))[0]
        await ps.leave(group)
        return
    for k in range(args.steps):
        if args.turns:
            await ps.pull_versioned(group, min_version=k * args.workers + w)
        await ps.push(group, *gradients(info, args.seed, w, k))


async def work(target: str | list[str], args: argparse.Namespace) -> None:
    client_id = f"worker-{args.worker:02d}"
    if args.use_async:
        async with AsyncClient(target, client_id=client_id, timeout=60.0) as ps:
            for group in args.groups.split(","):
                await run_group(ps, group, args)
        return
    with Client(target, client_id=client_id, timeout=60.0) as c:
        for group in args.groups.split(","):
            await run_group(_Awaiting(c), group, args)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("addresses")
    p.add_argument("groups")
    p.add_argument("worker", type=int)
    p.add_argument("workers", type=int)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--turns", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async", dest="use_async", action="store_true")
    args = p.parse_args()
    addresses = args.addresses.split(",")
    target: str | list[str] = addresses if len(addresses) > 1 else addresses[0]
    asyncio.run(work(target, args))
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
