"""``onnxps status ADDRESS``: a table of the groups a server holds.

``ADDRESS`` may list every shard of a cluster, comma-separated in shard order: then a
group appears once (its parts merged), and two more tables follow: the parts of the
split groups (shard, T per part, and whether it agrees with the other parts) and
the shards (answering or not, parts held). Parts at different T in two looks a
second apart are flagged (AGREE "NO", and a "parts apart:" line per group).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Collection, Sequence
from typing import Any, TextIO

from onnxps.client import (
    Adagrad,
    Adam,
    Client,
    GroupInfo,
    OnnxpsError,
    RpcError,
    Sync,
)
from onnxps.client._cluster import base_name, parse_target
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.coordinator import CoordinatorTls, is_coordinator

from ._args import add_connection_arguments, fail, read_tls_ca, unreachable

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
    p.add_argument(
        "address",
        help="host:port of the server (port 50051 when omitted), or of every "
        "shard of a cluster in shard order, comma-separated, or "
        "etcd://HOST:PORT/PREFIX of a replicated cluster (etcds:// for TLS to "
        "etcd: ONNXPS_COORDINATOR_CA, _CERT, _KEY name its files)",
    )
    p.add_argument("--prefix", default="", help="only groups whose name starts so")
    add_connection_arguments(p, timeout=3.0)
    for part, what in (("ca", "CA (PEM) etcd's certificate chains to"),
                       ("cert", "client certificate (PEM) to present to etcd"),
                       ("key", "the key of --coordinator-cert")):  # fmt: skip
        env = f"ONNXPS_COORDINATOR_{part.upper()}"
        p.add_argument(
            f"--coordinator-{part}",
            default=os.environ.get(env),
            help=f"with etcds://: {what} ({env})",
        )


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


def format_table(
    groups: Sequence[GroupInfo] | Sequence[tuple[str, ...]],
    columns: tuple[str, ...] = COLUMNS,
    numeric: frozenset[int] = frozenset({3, 4, 5}),
) -> str:
    """Aligned columns, one line per group (or row), numbers right-aligned."""
    body = [g if isinstance(g, tuple) else row(g) for g in groups]
    rows = [columns, *body]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = []
    for r in rows:
        cells = [
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


PART_COLUMNS = ("GROUP", "PART", "SHARD", "ADDRESS", "ELEMENTS", "T", "AGREE")
SHARD_COLUMNS = ("SHARD", "ADDRESS", "STATE", "PARTS")
APART_RECHECK = 1.0  # seconds between the two looks at parts at different T


def _agree(g: GroupInfo, t: int, apart: Collection[str]) -> str:
    if g.name not in apart:
        return "yes"
    top = max(p.update_count for p in g.parts)
    return f"NO: {top - t} behind" if t < top else "NO"


def part_rows(
    groups: Sequence[GroupInfo], apart: Collection[str] = ()
) -> list[tuple[str, ...]]:
    """One row per part of each split group; AGREE says whether its T is the
    other parts' (``apart``: the groups whose parts disagree)."""
    return [
        (
            g.name,
            p.name,
            str(p.shard),
            p.address,
            str(p.element_count),
            str(p.update_count),
            _agree(g, p.update_count, apart),
        )
        for g in groups
        if len(g.parts) > 1
        for p in g.parts
    ]


def still_apart(ps: Client, groups: Sequence[GroupInfo]) -> set[str]:
    """The split groups whose parts are at different T in two looks
    ``APART_RECHECK`` s apart (one look can catch a push in flight)."""
    first = [g.name for g in groups if g.parts_apart]
    if not first:
        return set()
    time.sleep(APART_RECHECK)
    return {name for name in first if ps.describe_group(name).parts_apart}


def apart_lines(groups: Sequence[GroupInfo], apart: set[str]) -> list[str]:
    return [
        f"parts apart: {g.name}: T "
        + ", ".join(str(p.update_count) for p in g.parts)
        + " (a part lost pushes the others applied; see docs/cluster.md, 'When "
        "the parts of a split group disagree')"
        for g in groups
        if g.name in apart
    ]


def shard_rows(ps: Client, prefix: str, timeout: float) -> list[tuple[str, ...]]:
    """Each shard: whether it answers (and accepts this layout), and what it holds."""
    rows: list[tuple[str, ...]] = []
    for i, address in enumerate(ps.addresses):
        try:
            msg = ps._call(
                "ListGroups", pb.ListGroupsRequest(prefix=prefix), timeout, None, i
            )
        except RpcError as exc:
            gone = exc.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
            state = "unreachable" if gone else (exc.reason or exc.code.name)
            rows.append((str(i), address, state, "-"))
            continue
        whole = sum(base_name(g.name)[2] == 1 for g in msg.groups)
        parts = len(msg.groups) - whole
        rows.append((str(i), address, "serving", f"{whole} whole, {parts} split"))
    return rows


REPLICA_COLUMNS = ("SHARD", "MEMBER", "ADDRESS", "ROLE", "TERM", "LSN", "LAG", "SYNC")


def _lag(m: dict[str, Any]) -> str:
    """A member's LAG cell: records behind the primary, or why there is none."""
    if m["following"] is False:
        return "not-following"  # its lsn may count records of another term
    return "-" if m["lag"] is None else str(m["lag"])


def replica_rows(
    url: str, timeout: float, tls: CoordinatorTls | None = None
) -> list[tuple[str, ...]]:
    """A replicated cluster's members from etcd (docs/cluster.md); ``tls``: the
    files of an ``etcds://`` url (None: the environment's)."""
    from onnxps.client._discovery import Discovery

    return [
        (
            str(m["shard"]),
            m["member"],
            m["address"],
            m["role"],
            str(m["term"]),
            str(m["lsn"]),
            _lag(m),
            "yes" if m["sync"] else "-",
        )
        for m in Discovery(url, tls=tls).replicas(timeout)
    ]


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Print the table; 1 with a message on stderr when the server cannot be asked
    (a cluster: when a shard cannot; the shard table says which)."""
    out = out or sys.stdout
    roots = read_tls_ca("onnxps status", args.tls_ca)
    replicated = is_coordinator(args.address)
    # etcds:// files, the flags' (or the environment's)
    etcd_tls = CoordinatorTls(
        *(args.coordinator_ca, args.coordinator_cert, args.coordinator_key)
        if replicated
        else ()
    )
    target = args.address if replicated else parse_target(args.address)
    shards: list[tuple[str, ...]] = []
    try:
        with Client(
            target,
            timeout=args.timeout,
            token=args.token,
            root_certificates=roots,
            coordinator_ca=etcd_tls.ca,
            coordinator_cert=etcd_tls.cert,
            coordinator_key=etcd_tls.key,
        ) as ps:
            cluster = _several_shards(ps)
            if cluster:
                shards = shard_rows(ps, args.prefix, args.timeout)
                if any(r[2] != "serving" for r in shards):
                    print(format_table(shards, SHARD_COLUMNS, frozenset()), file=out)
            groups = ps.list_groups(args.prefix)
            apart = still_apart(ps, groups) if cluster else set()
    except RpcError as exc:
        why = (
            unreachable(exc, target, args.timeout) or f"{exc.code.name}: {exc.details}"
        )
        fail("onnxps status", f"cannot list the groups on {args.address}: {why}")
    except OnnxpsError as exc:
        fail("onnxps status", f"{args.address}: {exc}")
    except (OSError, LookupError, ValueError) as exc:  # etcd: its answer, or none
        if not replicated:
            raise
        fail("onnxps status", f"{args.address}: {exc}")
    if not groups:
        print(f"no groups on {args.address}", file=out)
    else:
        print(format_table(groups), file=out)
    if shards:
        parts = part_rows(groups, apart)
        if parts:
            print(file=out)
            print(format_table(parts, PART_COLUMNS, frozenset({2, 4, 5})), file=out)
        for line in apart_lines(groups, apart):
            print(line, file=out)
        print(file=out)
        print(format_table(shards, SHARD_COLUMNS, frozenset({0})), file=out)
    if replicated:
        try:
            replicas = replica_rows(args.address, args.timeout, etcd_tls)
        except (OSError, LookupError) as exc:
            fail("onnxps status", f"{args.address}: {exc}")
        print(file=out)
        print(
            format_table(replicas, REPLICA_COLUMNS, frozenset({0, 4, 5, 6})), file=out
        )
        for line in resharding_lines(args.address, replicas, etcd_tls):
            print(line, file=out)
    return 0


def _several_shards(ps: Client) -> bool:
    """Whether to show shards and parts (a cluster found through etcd of one
    shard is shown as one server)."""
    return (ps.shards or 1) > 1


def resharding_lines(
    url: str, replicas: Sequence[tuple[str, ...]], tls: CoordinatorTls | None
) -> list[str]:
    """What the placement map says of the shards (docs/resharding.md): a shard
    that owns nothing yet, a resharding under way."""
    from onnxps.client._discovery import Discovery

    placement = Discovery(url, tls=tls).placement(time.monotonic() + 5)
    lines = []
    for shard in sorted(
        {int(r[0]) for r in replicas if int(r[0]) >= placement.serving}
    ):
        lines.append(
            f"shard {shard} owns nothing yet: it holds groups once `onnxps reshard "
            f"{url} --shards {shard + 1}` (or more) moves some there "
            "(docs/resharding.md)"
        )
    for name, (source, target) in sorted(placement.moving.items()):
        lines.append(f"moving {name}: shard {source} -> {target} (a resharding)")
    return lines
