"""Same-host benchmark: TCP loopback, a Unix socket, shared memory, torch RPC shm.

    python benchmarks/samehost.py [--rounds 5] [--steps 3] [--small 200]
                                  [--baseline REV]

One run, variants alternating round by round (so drift on a shared machine hits
them all alike), servers in their own processes:

- ``no flags``: ``onnxps serve`` with no flag but a free loopback port (its
  defaults) and ``Client(address)`` with no option: what a user gets on one host;
- ``tcp``: ``onnxps serve`` on 127.0.0.1, chunked gRPC streams (transport="stream");
- ``unix``: the same on a Unix socket (``--address unix:PATH``);
- ``shm``: the Unix-socket server, tensors through /dev/shm (``shared_memory="on"``:
  every call, the 1,000-element ones too; with "auto" those go inline);
- ``shm-bufs``: the same, with ``Client.tensor_buffers``: the worker writes G
  straight into its shared buffers (the copy of G counted in the push, as a worker
  that computes into them would not make it) and pulls X into shared buffers
  (``pull(out=)``): no tensor byte is copied in the client;
- ``torch-shm``: torch.distributed.rpc with TensorPipe ``_transports=["shm"]`` (and
  its default channels), a server-side ``torch.optim.Adam(fused=True)`` (when torch
  is installed).

``--baseline REV`` adds ``tcp@base`` and ``shm@base``: the servers of an older commit
(``benchmarks/_baseline.py``), the same client: an A/B of a server change.

A 64 MiB float32 group (one tensor, Adam): push ms, pull ms, push+pull step ms and
GB/s (128 MiB moved per step); a 1,000-element push+pull round trip p50 in us.
Each figure is the median over rounds, with the spread (min-max of the rounds'
medians). The machine may be shared: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from onnxps.cli.process import (
    start_default_server,
    start_server_process,
    stop_processes,
)
from onnxps.client import Adam, Client

MIB = 1 << 20
LARGE = 16 * MIB  # float32 elements: 64 MiB
SMALL = 1000
LR = 1e-3


# -- torch.distributed.rpc parameter server (server side: torch Adam) -------------
_PARAMS: dict[str, Any] = {}


def _torch_create(name: str, n: int) -> None:
    import torch

    p = torch.zeros(n, dtype=torch.float32, requires_grad=False)
    _PARAMS[name] = (p, torch.optim.Adam([p], lr=LR, eps=1e-6, fused=True))


def _torch_push(name: str, g: Any) -> int:
    p, opt = _PARAMS[name]
    p.grad = g
    opt.step()
    return 1


def _torch_pull(name: str) -> Any:
    return _PARAMS[name][0]


def _torch_push_pull(name: str, g: Any) -> Any:
    _torch_push(name, g)
    return _PARAMS[name][0]


def _rpc_options(rpc: Any) -> Any:
    # the shm transport; TensorPipe picks its channel (cma for CPU tensors)
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=4, _transports=["shm"], rpc_timeout=120
    )


def _torch_server(port: str) -> None:
    import torch.distributed.rpc as rpc

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    rpc.init_rpc("ps", rank=0, world_size=2, rpc_backend_options=_rpc_options(rpc))
    rpc.shutdown()  # waits for the trainer


class TorchRpc:
    def __init__(self) -> None:
        import multiprocessing as mp
        import socket

        import torch.distributed.rpc as rpc

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        self.proc = mp.get_context("spawn").Process(target=_torch_server, args=(port,))
        self.proc.start()
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = port
        rpc.init_rpc(
            "trainer", rank=1, world_size=2, rpc_backend_options=_rpc_options(rpc)
        )
        self.rpc = rpc

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.rpc.rpc_sync("ps", fn, args=args)

    def stop(self) -> None:
        self.rpc.shutdown()
        self.proc.join(30)


# -- the variants ------------------------------------------------------------------
class Variant:
    name: str

    def push(self, g: np.ndarray) -> None: ...
    def pull(self) -> np.ndarray: ...
    def small(self, g: np.ndarray) -> None: ...


class Onnxps(Variant):
    def __init__(self, name: str, address: str, **kw: Any) -> None:
        self.name = name
        self.client = Client(address, timeout=120, **kw)
        w = np.zeros(LARGE, np.float32)
        self.client.create_group(
            f"{name}-big", Adam(), learning_rate=LR, tensors={"w": w}
        )
        self.client.create_group(
            f"{name}-small",
            Adam(),
            learning_rate=LR,
            tensors={"w": np.zeros(SMALL, np.float32)},
        )

    def push(self, g: np.ndarray) -> None:
        self.client.push(f"{self.name}-big", g)

    def pull(self) -> np.ndarray:
        return self.client.pull(f"{self.name}-big")[0]

    def small(self, g: np.ndarray) -> None:
        self.client.push(f"{self.name}-small", g)
        self.client.pull(f"{self.name}-small")


class OnnxpsBuffers(Onnxps):
    """Gradients written into ``tensor_buffers`` and X pulled into them."""

    def __init__(self, name: str, address: str, **kw: Any) -> None:
        super().__init__(name, address, **kw)
        self.grads = self.client.tensor_buffers(f"{name}-big")
        self.values = self.client.tensor_buffers(f"{name}-big")
        self.small_grads = self.client.tensor_buffers(f"{name}-small")
        self.small_values = self.client.tensor_buffers(f"{name}-small")
        assert self.grads.shared and self.values.shared

    def push(self, g: np.ndarray) -> None:
        # A worker computes G into the buffers; the copy stands for that write.
        np.copyto(self.grads[0], g)
        self.client.push(f"{self.name}-big", *self.grads)

    def pull(self) -> np.ndarray:
        return self.client.pull(f"{self.name}-big", out=self.values)[0]

    def small(self, g: np.ndarray) -> None:
        np.copyto(self.small_grads[0], g)
        self.client.push(f"{self.name}-small", *self.small_grads)
        self.client.pull(f"{self.name}-small", out=self.small_values)


class Torch(Variant):
    def __init__(self, rpc: TorchRpc) -> None:
        self.name = "torch-shm"
        self.rpc = rpc
        rpc.call(_torch_create, "big", LARGE)
        rpc.call(_torch_create, "small", SMALL)

    def push(self, g: np.ndarray) -> None:
        import torch

        self.rpc.call(_torch_push, "big", torch.from_numpy(g))

    def pull(self) -> np.ndarray:
        return self.rpc.call(_torch_pull, "big").numpy()

    def small(self, g: np.ndarray) -> None:
        import torch

        self.rpc.call(_torch_push, "small", torch.from_numpy(g))
        self.rpc.call(_torch_pull, "small")


def _ms(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _round(
    v: Variant, g: np.ndarray, gs: np.ndarray, steps: int, small: int
) -> dict[str, float]:
    push = [_ms(lambda: v.push(g)) for _ in range(steps)]
    pull = [_ms(v.pull) for _ in range(steps)]
    step = [_ms(lambda: (v.push(g), v.pull())) for _ in range(steps)]
    rtt = []
    for _ in range(small):
        t = time.perf_counter()
        v.small(gs)
        rtt.append((time.perf_counter() - t) * 1e6)
    return {
        "push ms": statistics.median(push),
        "pull ms": statistics.median(pull),
        "step ms": statistics.median(step),
        "small p50 us": statistics.median(rtt),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--small", type=int, default=200)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument(
        "--baseline",
        help="also measure an older commit's servers (tcp@base, shm@base): an A/B",
    )
    args = p.parse_args(argv)
    with contextlib.ExitStack() as stack:
        env = None
        if args.baseline:
            from _baseline import checkout, tree_env

            env = dict(tree_env(stack.enter_context(checkout(args.baseline)).tree))
        return _main(args, env)


def _main(args: argparse.Namespace, baseline_env: dict[str, str] | None) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="onnxps-samehost-"))
    sock = tmp / "ps.sock"
    default_proc, default = start_default_server(
        tmp / "default", log=tmp / "default.log"
    )
    tcp_proc, tcp = start_server_process(log=tmp / "tcp.log")
    unix_proc, unix = start_server_process(
        "--address", f"unix://{sock}", log=tmp / "unix.log"
    )
    variants: list[Variant] = [
        Onnxps("no flags", default),
        Onnxps("tcp", tcp, transport="stream", shared_memory="off"),
        Onnxps("unix", unix, transport="stream", shared_memory="off"),
        Onnxps("shm", unix, shared_memory="on"),
        OnnxpsBuffers("shm-bufs", unix, shared_memory="on"),
    ]
    procs = [default_proc, tcp_proc, unix_proc]
    if baseline_env is not None:
        old_tcp_proc, old_tcp = start_server_process(
            log=tmp / "old-tcp.log", env=baseline_env
        )
        old_unix_proc, old_unix = start_server_process(
            "--address",
            f"unix://{sock}.old",
            log=tmp / "old-unix.log",
            env=baseline_env,
        )
        procs += [old_tcp_proc, old_unix_proc]
        variants += [
            Onnxps("tcp@base", old_tcp, transport="stream", shared_memory="off"),
            Onnxps("shm@base", old_unix, shared_memory="on"),
        ]
    rpc = None
    if not args.no_torch:
        try:
            import torch  # noqa: F401

            rpc = TorchRpc()
            variants.append(Torch(rpc))
        except ImportError:
            print("torch is not installed: no torch RPC row", file=sys.stderr)
    rng = np.random.default_rng(0)
    g = (rng.standard_normal(LARGE) * 1e-3).astype(np.float32)
    gs = (rng.standard_normal(SMALL) * 1e-3).astype(np.float32)
    results: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
    try:
        for v in variants:  # warm up: first touch of every buffer, kernels compiled
            _round(v, g, gs, 1, 20)
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                results[v.name].append(_round(v, g, gs, args.steps, args.small))
    finally:
        for v in variants:
            if isinstance(v, Onnxps):
                v.client.close()
        if rpc is not None:
            rpc.stop()
        stop_processes(procs, timeout=60)  # the default server writes a snapshot
    _report(results, args)
    return 0


def _report(
    results: dict[str, list[dict[str, float]]], args: argparse.Namespace
) -> None:
    keys = ["push ms", "pull ms", "step ms", "small p50 us"]
    med = {
        n: {k: statistics.median(r[k] for r in rs) for k in keys}
        for n, rs in results.items()
    }
    print(
        f"64 MiB float32 Adam group; {args.rounds} rounds x {args.steps} steps, "
        f"{args.small} small round trips per round; median (min-max of rounds)"
    )
    header = f"{'variant':<10}" + "".join(f"{k:>22}" for k in keys) + f"{'GB/s':>8}"
    print(header)
    for n, rs in results.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in rs]
            cells.append(
                f"{med[n][k]:>8.1f} ({min(vals):.1f}-{max(vals):.1f})".rjust(22)
            )
        gbs = 2 * LARGE * 4 / (med[n]["step ms"] / 1e3) / 1e9
        print(f"{n:<10}" + "".join(cells) + f"{gbs:>8.2f}")
    if "torch-shm" in med:
        t = med["torch-shm"]
        for n in med:
            if n == "torch-shm":
                continue
            print(
                f"torch-shm / {n}: step {t['step ms'] / med[n]['step ms']:.2f}x, "
                f"push {t['push ms'] / med[n]['push ms']:.2f}x, pull "
                f"{t['pull ms'] / med[n]['pull ms']:.2f}x, small "
                f"{t['small p50 us'] / med[n]['small p50 us']:.2f}x "
                "(>1: onnxps faster)"
            )
    tcp = med.get("tcp")
    if tcp:
        for n in ("unix", "shm", "shm-bufs"):
            if n in med:
                print(
                    f"tcp / {n}: step {tcp['step ms'] / med[n]['step ms']:.2f}x, small "
                    f"{tcp['small p50 us'] / med[n]['small p50 us']:.2f}x"
                )


if __name__ == "__main__":
    sys.exit(main())
