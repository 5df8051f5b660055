"""What worker processes and the tests that check them agree on.

Gradients are a pure function of (seed, worker index, step), so a test can recompute
every contribution in one process and compare with what the server did.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]

SHAPES: tuple[tuple[int, ...], ...] = ((16, 8), (8,))
DTYPE = np.dtype(np.float32)


def initial_values(seed: int) -> list[Array]:
    rng = np.random.default_rng([seed, 1_000_000])
    return [rng.standard_normal(s).astype(DTYPE) for s in SHAPES]


def gradients(seed: int, worker: int, step: int) -> list[Array]:
    rng = np.random.default_rng([seed, worker, step])
    return [rng.standard_normal(s).astype(DTYPE) for s in SHAPES]


def client_id(worker: int) -> str:
    return f"worker-{worker:02d}"
