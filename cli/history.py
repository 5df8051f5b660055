"""``onnxps rewind``, ``onnxps fork`` and ``onnxps history``: a group's past.

``rewind ADDRESS GROUP --to-step T`` sets a group back to its state right after
step T (every part of a split group); ``--all`` rewinds every group, and
``--to-time`` picks, per group, its last step taken at or before a time.
``fork ADDRESS GROUP NEW --at-step T`` makes a new group of that state.
``history ADDRESS GROUP`` lists the steps a group can go back to, with their times,
and the disk the server's retention holds. They need a server with
``--durability wal``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import TextIO

from onnxps.client import Client, HistoryInfo, OnnxpsError, RewindInfo, RpcError
from onnxps.client._cluster import parse_target

from ._args import EXIT_USAGE, add_connection_arguments, fail, read_tls_ca, unreachable

__all__ = [
    "add_fork_arguments",
    "add_history_arguments",
    "add_rewind_arguments",
    "parse_time",
    "run",
]


def _address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "address",
        help="host:port of the server (port 50051 when omitted), or of every shard "
        "of a cluster in shard order, comma-separated",
    )


def add_rewind_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Set a group back to its state right after an earlier step: X, V, H, ids "
        "tables' rows and T bit for bit as they were (every part of a split "
        "group). The learning rate stays as it is now. Pushes computed before the "
        "rewind are refused (REWOUND): workers pull and go on. Needs a server "
        "started with --durability wal; `onnxps history` lists the steps."
    )
    _address(p)
    p.add_argument("group", nargs="?", help="the group (or --all)")
    p.add_argument(
        "--all", action="store_true", help="every group on the server (or cluster)"
    )
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--to-step", type=int, metavar="T", help="the step (T after)")
    when.add_argument(
        "--to-time",
        type=parse_time,
        metavar="TIME",
        help="per group, its last step taken at or before TIME (Unix seconds, or "
        "ISO 8601 such as 2026-11-28T16:05:00+00:00)",
    )
    add_connection_arguments(p, timeout=60.0)


def add_fork_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Create a new group with a group's state right after one of its steps "
        "(X, V, H, ids tables' rows, T and that step's learning rate); the two go "
        "on apart. Needs a server started with --durability wal (one server)."
    )
    _address(p)
    p.add_argument("group", help="the group forked")
    p.add_argument("new_group", help="the name of the new group")
    p.add_argument("--at-step", type=int, required=True, metavar="T", help="the step")
    add_connection_arguments(p, timeout=60.0)


def add_history_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "List the steps a group can go back to (onnxps rewind, fork), oldest "
        "first, with the time each was taken, and the disk the server's "
        "retention holds (--keep-snapshots, --keep-seconds, --keep-bytes)."
    )
    _address(p)
    p.add_argument("group", help="the group")
    p.add_argument(
        "--every-step",
        action="store_true",
        help="one line per step (default: ranges of consecutive steps, and every "
        "base: a snapshot, the create, where a rewind landed)",
    )
    add_connection_arguments(p, timeout=10.0)


def parse_time(text: str) -> float:
    """Unix seconds, or an ISO 8601 time (one without a zone is UTC)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither Unix seconds nor an ISO 8601 time"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.timestamp()


def _when(unix: float) -> str:
    if not unix:
        return "-"
    t = datetime.datetime.fromtimestamp(unix, datetime.UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def format_history(h: HistoryInfo, every_step: bool) -> str:
    lines = [f"{'STEP':>12}  {'TAKEN (UTC)':<24}  KIND"]
    steps = h.steps
    k = 0
    while k < len(steps):
        s = steps[k]
        j = k
        if not every_step and s.kind == "step":
            while (
                j + 1 < len(steps)
                and steps[j + 1].kind == "step"
                and steps[j + 1].step == steps[j].step + 1
            ):
                j += 1
        if j > k:
            e = steps[j]
            lines.append(
                f"{f'{s.step}-{e.step}':>12}  {_when(s.unix_time):<24}  steps "
                f"(the last at {_when(e.unix_time)})"
            )
        else:
            lines.append(f"{s.step:>12}  {_when(s.unix_time):<24}  {s.kind}")
        k = j + 1
    oldest = "none" if h.oldest_step is None else str(h.oldest_step)
    lines.append(
        f"group {h.group}: T={h.update_count}, reachable from T={oldest}; "
        f"retention holds {_size(h.snapshot_bytes)} of snapshots and "
        f"{_size(h.wal_bytes)} of write-ahead log"
    )
    if steps and steps[0].kind == "moved":
        lines.append(
            f"its history here starts at T={steps[0].step}, where a resharding "
            f"moved it to this shard ({_when(steps[0].unix_time)}): the steps "
            "before the move cannot be reached (export a group before "
            "resharding to keep its state)"
        )
    return "\n".join(lines)


def _said(r: RewindInfo, what: str) -> str:
    return (
        f"{what} {r.group.name}: T={r.group.update_count} (was {r.from_step}); "
        + _how(r)
    )


def _how(r: RewindInfo) -> str:
    return (
        f"from the {r.base} at T={r.base_step} and {r.replayed} records replayed, "
        f"in {r.seconds:.3f} s"
    )


def _rewind(client: Client, args: argparse.Namespace, out: TextIO) -> None:
    names = [g.name for g in client.list_groups()] if args.all else [args.group]
    for name in names:
        step = args.to_step
        if step is None:
            history = client.history(name)
            taken = [s.step for s in history.steps if s.unix_time <= args.to_time]
            if not taken:
                oldest = history.steps[0] if history.steps else None
                since = (
                    ""
                    if oldest is None
                    else f" (its oldest: {_when(oldest.unix_time)}"
                    + (
                        ", where a resharding moved it to this shard)"
                        if oldest.kind == "moved"
                        else ")"
                    )
                )
                fail(
                    f"onnxps {args.command}",
                    f"group {name!r} has no step kept from at or before "
                    f"{_when(args.to_time)}{since}; nothing was rewound after the "
                    f"groups listed above",
                )
            step = taken[-1]
        print(_said(client.rewind(name, to_step=step), "rewound"), file=out)


def _usage(args: argparse.Namespace) -> str | None:
    if args.command == "rewind":
        if bool(args.all) == bool(args.group):
            return "give either GROUP or --all"
        if args.to_step is not None and args.to_step < 0:
            return f"--to-step must be >= 0, got {args.to_step}"
    if args.command == "fork" and args.at_step < 0:
        return f"--at-step must be >= 0, got {args.at_step}"
    return None


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Rewind, fork or list history; a failure is one line on stderr."""
    out = out or sys.stdout
    prog = f"onnxps {args.command}"
    roots = read_tls_ca(prog, args.tls_ca)
    wrong = _usage(args)
    if wrong:
        fail(prog, wrong, EXIT_USAGE)
    target = parse_target(args.address)
    try:
        with Client(
            target, timeout=args.timeout, token=args.token, root_certificates=roots
        ) as client:
            if args.command == "rewind":
                _rewind(client, args, out)
            elif args.command == "fork":
                done = client.fork(args.group, args.new_group, at_step=args.at_step)
                print(
                    f"forked {args.group} (T={done.from_step}) as "
                    f"{done.group.name}: T={done.group.update_count}; {_how(done)}",
                    file=out,
                )
            else:
                print(
                    format_history(client.history(args.group), args.every_step),
                    file=out,
                )
    except RpcError as exc:
        why = unreachable(exc, target, args.timeout)
        fail(prog, f"{args.address}: {why or exc}")
    except OnnxpsError as exc:
        fail(prog, f"{args.address}: {exc}")
    return 0
