"""A cluster's call sent again until it lands: while its shard is unavailable (a
pod restarting) or busy, and to the shard a MOVED answer names (a resharding moved
the group, docs/resharding.md), within the call's deadline. Operations
(``_ops.Op``) for both clients, used by ``_sharded`` and the modules beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ._cluster import base_name
from ._errors import FailedPreconditionError, RpcError, UnavailableError
from ._ops import Blocking, Deadline, Op, Pause
from ._shardops import ShardOps

__all__ = ["follow_moved", "is_moved", "until_landed"]

R = TypeVar("R")


def _unavailable(exc: RpcError) -> bool:
    return isinstance(exc, UnavailableError)


def until_landed(
    send: Callable[[], Op[R]],
    deadline: Deadline,
    resend: Callable[[RpcError], bool] = _unavailable,
    ops: ShardOps | None = None,
) -> Op[R]:
    """``send()``, sent again while it fails with an error ``resend`` accepts (by
    default: its server is unavailable), until the deadline (a cluster's calls: a
    shard pod restarting must not fail the worker). A push carries the same
    (client_id, seq) each time, so it lands exactly once. With ``ops``, a MOVED
    answer (a resharding moved the group, docs/resharding.md) is followed: the
    placement map is read again and ``send()`` goes to the shard it names."""
    backoff = 0.1
    while True:
        moved: RpcError | None = None
        try:
            return (yield from send())
        except RpcError as exc:
            if ops is not None and is_moved(exc) and deadline.remaining() > 0:
                moved = exc
            elif not resend(exc):
                raise
            else:
                pause = min(backoff, deadline.remaining())
                if pause <= 0:
                    raise
        if moved is not None:
            assert ops is not None
            yield from follow_moved(ops, moved)
            continue
        yield Pause(pause)
        backoff = min(1.0, backoff * 2)


def is_moved(exc: BaseException) -> bool:
    """A shard answered that another one serves the group now (a resharding)."""
    return isinstance(exc, FailedPreconditionError) and exc.reason == "MOVED"


def follow_moved(ops: ShardOps, exc: RpcError) -> Op[None]:
    """Remember the shard a MOVED answer named for its group (or part), forget
    the group's layout and read the placement map again (new shards, owners)."""
    name = str(exc.metadata.get("group", ""))
    ops.layouts.pop(base_name(name)[0], None)
    yield Blocking(ops.host.refresh_placement)
    shard = exc.metadata.get("shard", "")
    if name and str(shard).isdigit():
        ops.moved[name] = int(shard)
    else:
        ops.moved.pop(name, None)
        yield Pause(0.05)
