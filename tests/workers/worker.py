"""A training worker run as its own process by the distributed tests.

    python worker.py ADDRESS GROUP WORKER_INDEX --mode sync|async --steps N --seed S

Sync: join the group (heartbeats keep the lease), then per step pull T, push the
gradients of (seed, worker, T) with base_version=T, and wait for T + 1 with
pull(min_version). Async: push the gradients of (seed, worker, i) N times.
Prints ``joined``, ``step K T=...`` after each accepted push and ``done T=...``;
any error ends the process with a non-zero exit code and the traceback on stderr.
"""

from __future__ import annotations

import argparse
import sys

from common import client_id, gradients  # type: ignore[import-not-found]
from onnxps.client import Client


def run_sync(ps: Client, group: str, worker: int, steps: int, seed: int) -> int:
    ps.join(group)
    print("joined", flush=True)
    t = ps.pull_versioned(group)[0]
    for k in range(steps):
        ps.push(group, *gradients(seed, worker, t), base_version=t)
        t = ps.pull_versioned(group, min_version=t + 1)[0]
        print(f"step {k} T={t}", flush=True)
    ps.leave(group)
    return t


def run_async(ps: Client, group: str, worker: int, steps: int, seed: int) -> int:
    print("joined", flush=True)
    t = 0
    for k in range(steps):
        t = ps.push(group, *gradients(seed, worker, k))
    return t


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("group")
    p.add_argument("worker", type=int)
    p.add_argument("--mode", choices=("sync", "async"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    run = run_sync if args.mode == "sync" else run_async
    with Client(args.address, client_id=client_id(args.worker), timeout=30.0) as ps:
        t = run(ps, args.group, args.worker, args.steps, args.seed)
    print(f"done T={t}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
