"""A worker of the replication tests: COUNT pushes to GROUP through Client(etcd://).

Push k of worker W sends the gradient ``(W + 1) * 0.01 + k * 0.001`` (every element)
and writes one JSON line ``{"w": W, "k": k, "t": T}`` per acknowledged push, T being
the update count the push stepped the group to: a serial replay in T order must give
the replicas' X. With STOP (an 8th argument), it stops early, between two pushes,
once that file exists.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from onnxps.client import Client


def gradient(worker: int, k: int, size: int) -> np.ndarray:
    return np.full(size, (worker + 1) * 0.01 + k * 0.001, np.float32)


def main() -> int:
    url, group, worker, count, size, out = sys.argv[1:7]
    stop = sys.argv[7] if len(sys.argv) > 7 else None
    with Client(url, timeout=60.0) as client, open(out, "a") as f:
        for k in range(int(count)):
            if stop is not None and os.path.exists(stop):
                break
            t = client.push(group, gradient(int(worker), k, int(size)))
            f.write(json.dumps({"w": int(worker), "k": k, "t": t}) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
