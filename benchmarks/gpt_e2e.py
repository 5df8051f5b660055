"""End to end: a GPT-style model in plain torch, 2 workers, CPU per batch.

    python benchmarks/gpt_e2e.py [--quick] [--rounds 3] [--steps 8] [--rows ...]

The model: 12 pre-norm transformer blocks, d=256, 4 heads, vocabulary 4,096, context
64; 150 parameter tensors, 11.6 M float32 parameters (46 MB pushed and pulled per
step). Every row trains it with Adam on random tokens, 2 worker processes of one
thread each (``torch.set_num_threads(1)``), each doing ``--steps`` batches after
``--warmup`` batches:

- ``one process``: one process doing the same 2 x steps batches alone with
  ``torch.optim.Adam`` (the baseline of every ratio);
- ``onnxps, no flags``: ``onnxps serve`` with its defaults (only a free port given,
  ``start_default_server``) and ``Client(address)``, the ``RemoteOptimizer`` as
  documented;
- ``onnxps, data channel``: ``onnxps serve --data-port 0`` and
  ``Client(address, shared_memory="off", data_channel="on")``: what two hosts get;
- ``onnxps, gRPC streams``: ``shared_memory="off", data_channel="off"``;
- ``..., BucketedOptimizer``: the same with ``onnxps.torch.BucketedOptimizer``
  (gradients pushed in 25 MiB buckets during backward);
- ``torch DDP (gloo)``: ``DistributedDataParallel`` (25 MB buckets) and
  ``torch.optim.Adam`` in each worker;
- ``torch.distributed.rpc PS``: a third process holds the parameters and
  ``torch.optim.Adam``; a worker sends its gradients with ``rpc_sync`` and gets the
  new parameters back.

CPU per batch is the workers' CPU (each measures its own ``time.process_time``
between two barriers) plus the server's (``/proc/PID/stat`` around the same
window), over the batches of both workers. Rounds alternate the rows (the order
rotates each round) so the machine's load hits them alike; per row the median ratio
to the one-process baseline of the same round and its spread (min..max), the CPU per
batch in ms, and batches/s. The load average and the share of the machine's CPU that
other processes used during each row are printed, so a loaded run says so.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

TICKS = os.sysconf("SC_CLK_TCK")
QUIET = 0.5  # cores other processes used during a row, below which it is "quiet"


# -- the model -----------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    layers: int = 12
    d: int = 256
    heads: int = 4
    vocab: int = 4096
    context: int = 64
    batch: int = 4


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (
            a.view(b, t, self.heads, d // self.heads).transpose(1, 2) for a in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.vocab, s.d)
        self.wpe = nn.Embedding(s.context, s.d)
        self.blocks = nn.ModuleList(Block(s.d, s.heads) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.d)
        self.head = nn.Linear(s.d, s.vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


def make_model(s: ModelShape) -> GPT:
    torch.manual_seed(0)
    return GPT(s)


def batches(
    s: ModelShape, rank: int
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 * rank + step)
        tokens = torch.randint(0, s.vocab, (s.batch, s.context + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    return batch


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# -- what every worker does ------------------------------------------------------------
@dataclass
class Job:
    row: str
    kind: str  # "local", "onnxps", "ddp", "rpc"
    shape: ModelShape
    steps: int
    warmup: int
    rank: int = 0
    workers: int = 2
    address: str = ""
    client: dict[str, Any] = field(default_factory=dict)
    overlap: bool = False
    port: int = 0


def _train(job: Job, barrier: Any, results: Any, step: Callable[[int], float]) -> None:
    """Warm up, then time ``job.steps`` calls of ``step`` between two barriers."""
    for i in range(job.warmup):
        step(i)
    barrier.wait()
    cpu, wall = time.process_time(), time.perf_counter()
    loss = math.nan
    for i in range(job.steps):
        loss = step(job.warmup + i)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    barrier.wait()
    results.put((job.rank, cpu, wall, loss))


def worker(job: Job, barrier: Any, results: Any) -> None:
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    torch.set_num_threads(1)
    try:
        {"local": _local, "onnxps": _onnxps, "ddp": _ddp, "rpc": _rpc}[job.kind](
            job, barrier, results
        )
    except BaseException as exc:
        results.put((job.rank, "error", repr(exc), 0))
        barrier.abort()
        raise


def _local(job: Job, barrier: Any, results: Any) -> None:
    model = make_model(job.shape)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = batches(job.shape, job.rank)

    def step(i: int) -> float:
        # one process doing both workers' batches: two per step
        loss = 0.0
        for b in (2 * i, 2 * i + 1):
            opt.zero_grad()
            out = loss_of(model, *batch(b))
            out.backward()
            opt.step()
            loss = out.item()
        return loss

    _train(job, barrier, results, step)


def _onnxps(job: Job, barrier: Any, results: Any) -> None:
    from onnxps.client import Adam, Client
    from onnxps.torch import BucketedOptimizer, RemoteOptimizer

    model = make_model(job.shape)
    batch = batches(job.shape, job.rank)
    with Client(job.address, timeout=300, **job.client) as ps:
        kind = BucketedOptimizer if job.overlap else RemoteOptimizer
        opt = kind(model.named_parameters(), ps, group="gpt", lr=1e-3, optimizer=Adam())

        def step(i: int) -> float:
            opt.zero_grad()
            out = loss_of(model, *batch(i))
            out.backward()
            opt.step()
            return out.item()

        _train(job, barrier, results, step)


def _ddp(job: Job, barrier: Any, results: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job.port}",
        rank=job.rank,
        world_size=job.workers,
    )
    model = DistributedDataParallel(make_model(job.shape))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = batches(job.shape, job.rank)

    def step(i: int) -> float:
        opt.zero_grad()
        out = loss_of(model, *batch(i))
        out.backward()
        opt.step()
        return out.item()

    try:
        _train(job, barrier, results, step)
    finally:
        dist.destroy_process_group()


# torch.distributed.rpc's parameter server: rank 0 holds these (one process).
_PS: dict[str, Any] = {}


def ps_step(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """On the PS: apply one worker's gradients with Adam, return the new params."""
    with _PS["lock"]:
        for p, g in zip(_PS["params"], grads, strict=True):
            p.grad = g
        _PS["opt"].step()
        return [p.detach().clone() for p in _PS["params"]]


def _rpc(job: Job, barrier: Any, results: Any) -> None:
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{job.port}", num_worker_threads=4
    )
    model = make_model(job.shape)
    if job.rank < 0:  # the parameter server
        _PS["params"] = list(model.parameters())
        _PS["opt"] = torch.optim.Adam(_PS["params"], lr=1e-3)
        _PS["lock"] = threading.Lock()
        rpc.init_rpc(
            "ps", rank=0, world_size=job.workers + 1, rpc_backend_options=options
        )
        rpc.shutdown()
        return
    rpc.init_rpc(
        f"w{job.rank}",
        rank=job.rank + 1,
        world_size=job.workers + 1,
        rpc_backend_options=options,
    )
    params = list(model.parameters())
    batch = batches(job.shape, job.rank)

    def step(i: int) -> float:
        for p in params:
            p.grad = None
        out = loss_of(model, *batch(i))
        out.backward()
        new = rpc.rpc_sync("ps", ps_step, args=([p.grad for p in params],))
        with torch.no_grad():
            for p, x in zip(params, new, strict=True):
                p.copy_(x)
        return out.item()

    try:
        _train(job, barrier, results, step)
    finally:
        rpc.shutdown()


# -- the rows --------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    name: str
    kind: str
    serve: tuple[str, ...] = ()
    client: tuple[tuple[str, str], ...] = ()
    overlap: bool = False


ROWS = {
    "one": Row("one process, torch.optim.Adam", "local"),
    "default": Row("onnxps, no flags", "onnxps"),
    "channel": Row(
        "onnxps, data channel (shm off)",
        "onnxps",
        ("--data-port", "0"),
        (("shared_memory", "off"), ("data_channel", "on")),
    ),
    "grpc": Row(
        "onnxps, gRPC streams",
        "onnxps",
        (),
        (("shared_memory", "off"), ("data_channel", "off")),
    ),
    "default-overlap": Row(
        "onnxps, no flags, BucketedOptimizer", "onnxps", overlap=True
    ),
    "channel-overlap": Row(
        "onnxps, data channel, BucketedOptimizer",
        "onnxps",
        ("--data-port", "0"),
        (("shared_memory", "off"), ("data_channel", "on")),
        overlap=True,
    ),
    "ddp": Row("torch DDP (gloo)", "ddp"),
    "rpc": Row("torch.distributed.rpc PS", "rpc"),
}
DEFAULT_ROWS = ("default", "channel", "grpc", "ddp", "rpc")


def _proc_cpu(pid: int) -> float:
    """utime + stime of a process, all threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _machine_cpu() -> float:
    """CPU seconds the whole machine spent busy (every core)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / TICKS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Result:
    cpu_per_batch: float
    batches_per_s: float
    others: float  # CPU seconds of other processes on the machine per wall second


def run_row(row: Row, shape: ModelShape, steps: int, warmup: int, tmp: Path) -> Result:
    ctx = mp.get_context("spawn")
    nworkers = 1 if row.kind == "local" else 2
    barrier = ctx.Barrier(nworkers + 1)
    results = ctx.Queue()
    server: subprocess.Popen[bytes] | None = None
    extra: list[Any] = []
    base = Job(row.name, row.kind, shape, steps, warmup, workers=nworkers)
    if row.kind == "onnxps":
        from onnxps.cli.process import start_default_server

        work = Path(tempfile.mkdtemp(dir=tmp))
        # onnxps serve with its defaults (snapshots in work/onnxps-data) + the row's
        server, base.address = start_default_server(
            work, *row.serve, log=work / "server.log"
        )
        base.client = dict(row.client)
        base.overlap = row.overlap
    if row.kind in ("ddp", "rpc"):
        base.port = _free_port()
    if row.kind == "rpc":
        ps_job = Job(**{**base.__dict__, "rank": -1})
        ps = ctx.Process(target=worker, args=(ps_job, barrier, results))
        ps.start()
        extra.append(ps)
    procs = []
    for rank in range(nworkers):
        job = Job(**{**base.__dict__, "rank": rank})
        p = ctx.Process(target=worker, args=(job, barrier, results))
        p.start()
        procs.append(p)
    watched = [server.pid] if server is not None else [p.pid for p in extra]
    try:
        barrier.wait(timeout=600)
        before = [_proc_cpu(pid) for pid in watched]
        machine, wall = _machine_cpu(), time.perf_counter()
        barrier.wait(timeout=600)
        wall = time.perf_counter() - wall
        machine = _machine_cpu() - machine
        server_cpu = sum(_proc_cpu(pid) for pid in watched) - sum(before)
        got = [results.get(timeout=120) for _ in procs]
    except threading.BrokenBarrierError:
        got = [results.get(timeout=10) for _ in procs]
        raise RuntimeError(f"{row.name}: a worker failed: {got}") from None
    finally:
        for p in procs + extra:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    worker_cpu = sum(g[1] for g in got)
    total = steps * 2
    ours = worker_cpu + server_cpu
    return Result(
        (worker_cpu + server_cpu) / total,
        total / max(g[2] for g in got),
        max(0.0, machine - ours) / wall,
    )


def _spread(values: list[float], fmt: str) -> str:
    return (
        f"{format(statistics.median(values), fmt)} "
        f"({format(min(values), fmt)}-{format(max(values), fmt)})"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed batches per worker")
    ap.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 4 steps")
    ap.add_argument(
        "--rows",
        default=",".join(DEFAULT_ROWS),
        help=f"comma-separated, of {', '.join(ROWS)} (one process always runs)",
    )
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 4, 2
    shape = ModelShape(layers=args.layers, batch=args.batch)
    model = make_model(shape)
    tensors = list(model.parameters())
    count = sum(p.numel() for p in tensors)
    print(
        f"GPT: {shape.layers} layers, d={shape.d}, {len(tensors)} tensors, "
        f"{count / 1e6:.2f} M parameters ({count * 4 / 1e6:.1f} MB), batch "
        f"{shape.batch} x {shape.context} tokens; 2 workers x 1 thread; "
        f"{args.rounds} rounds of {args.steps} timed steps per worker; "
        f"{os.cpu_count()} cores"
    )
    subprocess.run(
        [sys.executable, "-m", "onnxps.server.kernels"],
        check=False,
        capture_output=True,
    )
    names = ["one", *[r for r in args.rows.split(",") if r != "one"]]
    rows = [ROWS[n] for n in names]
    found: dict[str, list[Result]] = {r.name: [] for r in rows}
    ratios: dict[str, list[float]] = {r.name: [] for r in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            order = rows[k % len(rows) :] + rows[: k % len(rows)]
            load = open("/proc/loadavg").read().split()[0]
            this: dict[str, Result] = {}
            for row in order:
                this[row.name] = run_row(row, shape, args.steps, args.warmup, Path(tmp))
                found[row.name].append(this[row.name])
            one = this[rows[0].name].cpu_per_batch
            for row in rows:
                ratios[row.name].append(this[row.name].cpu_per_batch / one)
            print(
                f"round {k + 1}: load average {load}; "
                + "; ".join(
                    f"{r.name}: {this[r.name].cpu_per_batch * 1e3:.0f} ms CPU/batch, "
                    f"others {this[r.name].others:.2f} cores"
                    for r in rows
                ),
                flush=True,
            )
    print()
    print(
        "| path | CPU per batch vs one process | CPU per batch, ms | batches/s "
        f"| batches/s, rows with others < {QUIET} core "
        "| others' CPU during the row, cores |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        res = found[row.name]
        quiet = [r.batches_per_s for r in res if r.others < QUIET]
        print(
            f"| {row.name} | {_spread(ratios[row.name], '.2f')}x "
            f"| {_spread([r.cpu_per_batch * 1e3 for r in res], '.0f')} "
            f"| {_spread([r.batches_per_s for r in res], '.2f')} "
            f"| {_spread(quiet, '.2f') if quiet else '-'} ({len(quiet)} rows) "
            f"| {_spread([r.others for r in res], '.2f')} |"
        )
    _paired(rows, found)
    return 0


def _paired(rows: list[Row], found: dict[str, list[Result]]) -> None:
    """BucketedOptimizer against RemoteOptimizer on the same path, per round."""
    for row in rows:
        if not row.overlap:
            continue
        base = next(
            (
                r
                for r in rows
                if not r.overlap
                and (r.kind, r.serve, r.client) == (row.kind, row.serve, row.client)
            ),
            None,
        )
        if base is None:
            continue
        pairs = list(zip(found[row.name], found[base.name], strict=True))
        cpu = [a.cpu_per_batch / b.cpu_per_batch for a, b in pairs]
        rate = [a.batches_per_s / b.batches_per_s for a, b in pairs]
        lower = sum(c < 1 for c in cpu)
        print(
            f"{row.name} / {base.name}, paired per round: CPU per batch "
            f"{_spread(cpu, '.3f')}x (lower in {lower} of {len(cpu)}), "
            f"batches/s {_spread(rate, '.2f')}x"
        )


if __name__ == "__main__":
    sys.exit(main())
