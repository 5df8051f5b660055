"""Data-parallel jobs: N worker processes training one onnxps group."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

# The module, not the function torch.multiprocessing.spawn that shadows it as an
# attribute; torch leaves start_processes untyped.
_spawn = importlib.import_module("torch.multiprocessing.spawn")
_start_processes: Callable[..., Any] = _spawn.start_processes

__all__ = ["run_workers", "shard"]

T = TypeVar("T")


def run_workers(
    fn: Callable[..., None],
    nprocs: int,
    *args: Any,
    start_method: str = "spawn",
) -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` processes and wait for them all.

    ``fn`` must be importable (a module-level function) and each call builds its own
    ``Client`` and ``RemoteOptimizer`` on the same group: the first to arrive creates
    it, the others join. Raises (``torch.multiprocessing.ProcessRaisedException`` or
    ``ProcessExitedException``) when a worker fails; the others are terminated.
    Workers on separate hosts run the same ``fn`` with their own rank instead.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    _start_processes(
        fn,
        args=(nprocs, *args),
        nprocs=nprocs,
        join=True,
        start_method=start_method,
    )


def shard(items: Sequence[T], rank: int, nprocs: int) -> Sequence[T]:
    """Worker ``rank``'s share of ``items``: every ``nprocs``-th item from ``rank``."""
    if not 0 <= rank < nprocs:
        raise ValueError(f"rank must be in [0, {nprocs}), got {rank}")
    return items[rank::nprocs]
