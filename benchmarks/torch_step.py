"""What onnxps.torch adds to a step: RemoteOptimizer.step() vs the plain client.

For a model of about 10M float32 parameters, in alternating rounds (each round runs
every variant once, in a rotating order, so drift and noise hit them alike):

- ``torch.optim.Adam.step()``: the local optimizer, for scale;
- ``Client.push(return_values=True)`` of the same gradients (the plain client);
- ``RemoteOptimizer.step()``: the same push, plus collecting the grads as views and
  having X written straight into the parameters (``push(..., out=)``).

The server runs as its own process (``onnxps serve`` with no flags), as in a real
job. Prints the median and the spread (min..max) per variant, and the overhead of
onnxps.torch over the client as a share of its step. ``--shared-memory off`` moves
the tensors over gRPC (as between hosts); ``auto`` (the default) passes no option:
what ``Client(address)`` does.

    python benchmarks/torch_step.py [--rounds 30] [--hidden 2304] [--shared-memory off]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from onnxps.cli.process import start_default_server
from onnxps.client import Adam, Client
from onnxps.torch import RemoteOptimizer
from torch import nn


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1024),
    )


def fill_grads(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=2304)
    ap.add_argument("--shared-memory", choices=["auto", "off"], default="auto")
    args = ap.parse_args()

    local, remote, plain = (make_model(args.hidden) for _ in range(3))
    count = sum(p.numel() for p in remote.parameters())
    for m in (local, remote, plain):
        fill_grads(m)
    grads = [p.grad.numpy() for p in plain.parameters()]  # type: ignore[union-attr]
    adam = torch.optim.Adam(local.parameters(), lr=1e-3)

    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_default_server(Path(tmp), log=Path(tmp) / "server.log")
        # auto: no option at all, what Client(address) takes
        opts = {} if args.shared_memory == "auto" else {"shared_memory": "off"}
        try:
            with Client(address, **opts) as ps:  # type: ignore[arg-type]
                opt = RemoteOptimizer(
                    remote.named_parameters(), ps, group="remote", lr=1e-3
                )
                ps.create_group(
                    "plain",
                    Adam(),
                    learning_rate=1e-3,
                    tensors=[
                        (n, p.detach().numpy()) for n, p in plain.named_parameters()
                    ],
                )

                def push() -> object:
                    return ps.push(
                        "plain", *grads, return_values=True, learning_rate=1e-3
                    )

                def copied_back() -> object:
                    # The step before X was written straight into the parameters
                    # (the baseline): a push returning fresh arrays, then a copy.
                    result = opt._push(opt.gradients(), 1e-3)
                    assert result.values is not None
                    opt._write_all(result.values)
                    return None

                variants: dict[str, Callable[[], object]] = {
                    "torch.optim.Adam.step()": adam.step,
                    "Client.push(return_values=True)": push,
                    "RemoteOptimizer.step()": opt.step,
                    "baseline: step with X copied back": copied_back,
                }
                for fn in variants.values():  # warm up: channels, scratch, pages
                    fn()

                def own_work() -> object:
                    # What step() does besides the client's push: collect the
                    # grads, take the parameters' views for X (written in place).
                    opt.gradients()
                    opt._in_place()
                    return None

                variants["step() minus the push (grads + views)"] = own_work
                times: dict[str, list[float]] = {k: [] for k in variants}
                order = list(variants)
                for r in range(args.rounds):
                    rotated = order[r % len(order) :] + order[: r % len(order)]
                    for name in rotated:
                        times[name].append(timed(variants[name]))
        finally:
            proc.terminate()
            proc.wait()

    print(f"model: {count / 1e6:.1f}M float32 parameters ({count * 4 / 2**20:.0f} MiB)")
    print(
        f"{args.rounds} alternating rounds, torch threads {torch.get_num_threads()}, "
        f"shared_memory={args.shared_memory}"
    )
    print()
    print("| variant | median ms | min..max ms |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        ms = [t * 1e3 for t in ts]
        print(
            f"| {name} | {statistics.median(ms):.1f} | {min(ms):.1f}..{max(ms):.1f} |"
        )
    opt_ts = times["RemoteOptimizer.step()"]
    push_ts = times["Client.push(return_values=True)"]
    paired = [a - b for a, b in zip(opt_ts, push_ts, strict=True)]
    step = statistics.median(opt_ts)
    print()
    print(
        f"onnxps.torch overhead over the client: median of paired differences "
        f"{statistics.median(paired) * 1e3:.1f} ms = "
        f"{statistics.median(paired) / step:.1%} of the step; "
        f"difference of medians {(step - statistics.median(push_ts)) * 1e3:.1f} ms"
    )
    before = times["baseline: step with X copied back"]
    ratios = sorted(a / b for a, b in zip(opt_ts, before, strict=True))
    print(
        f"RemoteOptimizer.step() / the copy-back baseline, paired per round: median "
        f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}..{ratios[-1]:.3f}); "
        f"faster in {sum(r < 1 for r in ratios)} of {len(ratios)} rounds"
    )
    own = statistics.median(times["step() minus the push (grads + views)"])
    print(f"measured directly (grads + views): {own * 1e3:.2f} ms = {own / step:.2%}")


if __name__ == "__main__":
    main()
