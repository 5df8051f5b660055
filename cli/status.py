"""``onnxps status ADDRESS``: a table of the groups a server holds."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from onnxps.client import (
    Adagrad,
    Adam,
    Client,
    GroupInfo,
    OnnxpsError,
    RpcError,
    Sync,
)

from ._args import add_connection_arguments, fail, read_tls_ca

__all__ = ["add_arguments", "format_table", "run"]

COLUMNS = (
    "GROUP",
    "OPTIMIZER",
    "DTYPE",
    "TENSORS",
    "ELEMENTS",
    "T",
    "LR",
    "MODE",
    "WORKERS",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="host:port of the server")
    p.add_argument("--prefix", default="", help="only groups whose name starts so")
    add_connection_arguments(p, timeout=3.0)


def _optimizer(info: GroupInfo) -> str:
    opt = info.optimizer
    if isinstance(opt, Adam):
        return "adam"
    if isinstance(opt, Adagrad):
        return "adagrad"
    return "nesterov" if opt.mode == "nesterov" else "momentum"


def _mode(info: GroupInfo) -> tuple[str, str]:
    c = info.consistency
    alive = sum(w.alive for w in info.workers)
    if isinstance(c, Sync):
        return f"sync/{c.reduction}", f"{alive}/{c.workers}"
    mode = "async" if c.max_staleness is None else f"async<={c.max_staleness}"
    return mode, str(alive)


def row(info: GroupInfo) -> tuple[str, ...]:
    mode, workers = _mode(info)
    return (
        info.name,
        _optimizer(info),
        str(info.dtype),
        str(len(info.tensors)),
        str(info.element_count),
        str(info.update_count),
        f"{info.learning_rate:g}",
        mode,
        workers,
    )


def format_table(groups: Sequence[GroupInfo]) -> str:
    """Aligned columns, one line per group, numbers right-aligned."""
    rows = [COLUMNS, *(row(g) for g in groups)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    numeric = {3, 4, 5}
    lines = []
    for r in rows:
        cells = [
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the table; 1 with a message on stderr when the server cannot be asked."""
    out = out or sys.stdout
    roots = read_tls_ca("onnxps status", args.tls_ca)
    try:
        with Client(
            args.address,
            timeout=args.timeout,
            token=args.token,
            root_certificates=roots,
        ) as ps:
            groups = ps.list_groups(args.prefix)
    except RpcError as exc:
        fail(
            "onnxps status",
            f"cannot list the groups on {args.address}: {exc.code.name}: {exc.details}",
        )
    except OnnxpsError as exc:
        fail("onnxps status", f"{args.address}: {exc}")
    if not groups:
        print(f"no groups on {args.address}", file=out)
        return 0
    print(format_table(groups), file=out)
    return 0
