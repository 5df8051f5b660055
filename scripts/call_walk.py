"""Walk one warm push through the code: which onnxps modules it enters, and how often
a call crosses from one module into another.

    python scripts/call_walk.py [--elements 256] [--only grpc|frames] [--trace]

In one process: a server (``create_server``, ``durability="none"``, a data port,
NumPy kernels), a small Adam group, a warm-up push; then one push of
``--elements`` float32 (1 KiB for 256) is traced from ``Client.push`` to the kernel
and back with ``sys.setprofile`` and ``threading.setprofile`` (the server's
threads included). Every Python ``call`` and ``return`` event of a frame in an
``onnxps`` module counts; grpc, numpy and the standard library are left out. A
*hop* is such an event whose module differs from the previous onnxps event's
module in the same thread (the push crosses threads through grpc or a socket: the
hops are summed over the threads that took part in it). Run twice: over gRPC, and
as a frame call (``Client(frames="on")``).

Prints, per way: the threads, the modules entered, the hops, and the modules
entered most often (a module is *entered* by a hop into it). A figure for
reading a call's shape, not a timing.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

os.environ.setdefault("ONNXPS_KERNELS", "numpy")  # no numba thread at start

import numpy as np  # noqa: E402
from onnxps.client import Adam, Client  # noqa: E402
from onnxps.server.app import ServerConfig, create_server  # noqa: E402


@dataclass
class ThreadWalk:
    """The onnxps events of one thread."""

    name: str
    last: str | None = None
    hops: int = 0
    trail: list[str] = field(default_factory=list)
    entered: collections.Counter[str] = field(default_factory=collections.Counter)
    modules: set[str] = field(default_factory=set)


class Walk:
    """A profile function that counts module hops per thread."""

    def __init__(self) -> None:
        self.threads: dict[int, ThreadWalk] = {}
        self.on = False

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event not in ("call", "return"):
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("onnxps."):
            return
        ident = threading.get_ident()
        walk = self.threads.get(ident)
        if walk is None:
            name = threading.current_thread().name
            walk = self.threads[ident] = ThreadWalk(name)
        walk.modules.add(module)
        if walk.last is None:
            walk.entered[module] += 1
        elif module != walk.last:
            walk.hops += 1
            walk.entered[module] += 1
            arrow = "->" if event == "call" else "<-"
            walk.trail.append(f"{arrow} {module}.{frame.f_code.co_name}")
        walk.last = module

    def install(self) -> None:
        sys.setprofile(self.profile)
        threading.setprofile(self.profile)

    def remove(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _is_push_thread(walk: ThreadWalk) -> bool:
    """A thread of the push: the caller's, or one that ran a Push handler (the
    server's background threads, e.g. a reaper waking, are left out)."""
    return walk.name == "MainThread" or any(
        m.startswith("onnxps.server") and ("rpc" in m or "push" in m)
        for m in walk.modules
    )


def walk_push(frames: bool, elements: int) -> tuple[list[ThreadWalk], set[str]]:
    """Trace one warm push; the threads that took part, and the modules entered."""
    walk = Walk()
    walk.install()  # before the server's threads start: they are traced too
    config = ServerConfig(address="127.0.0.1:0", durability="none", data_port=0)
    handle = create_server(config).start()
    try:
        with Client(handle.address, frames="on" if frames else "off") as client:
            x = np.zeros(elements, np.float32)
            client.create_group("g", Adam(), learning_rate=0.01, tensors={"x": x})
            g = np.full(elements, 0.5, np.float32)
            for _ in range(3):  # warm: channels, callables, the call channel
                client.push("g", g)
            walk.on = True
            client.push("g", g)
            walk.on = False
    finally:
        walk.remove()
        handle.stop(grace=0)
    threads = [w for w in walk.threads.values() if _is_push_thread(w)]
    modules = set().union(*(w.modules for w in threads)) if threads else set()
    return threads, modules


def _short(module: str) -> str:
    return module.removeprefix("onnxps.")


def report(
    label: str, threads: list[ThreadWalk], modules: set[str], trace: bool = False
) -> None:
    hops = sum(w.hops for w in threads)
    entered: collections.Counter[str] = collections.Counter()
    for w in threads:
        entered.update(w.entered)
    print(f"{label}: {len(modules)} modules in {hops} hops")
    for w in threads:
        print(f"  thread {w.name}: {len(w.modules)} modules, {w.hops} hops")
        if trace:
            for step in w.trail:
                print(f"    {step.replace('onnxps.', '')}")
    most = ", ".join(f"{_short(m)} {n}" for m, n in entered.most_common(8))
    print(f"  entered most: {most}")
    print(f"  modules: {', '.join(sorted(map(_short, modules)))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--only", choices=("grpc", "frames"), default=None)
    parser.add_argument(
        "--trace", action="store_true", help="print every hop (call -> / return <-)"
    )
    args = parser.parse_args()
    for label, frames in (("grpc", False), ("frames", True)):
        if args.only not in (None, label):
            continue
        threads, modules = walk_push(frames, args.elements)
        report(f"{label} push", threads, modules, args.trace)


if __name__ == "__main__":
    main()
