"""A shard's identity (``--shard I/N``) and the check that calls were routed for it.

A cluster client sends ``onnxps-shard: I/N`` with every call: the shard index it
routed the call to and the shard count it routed for. A shard started with another
identity refuses the call with FAILED_PRECONDITION (reason ``SHARD_LAYOUT_MISMATCH``)
before reading it, so a group is never created or stepped on the wrong shard. A call
without the metadata (a one-server client, ``grpcurl``) is served.

``--shard auto/N`` takes the index from the host name's trailing ``-<ordinal>``: a
StatefulSet pod ``ps-2`` is shard 2. The host name is ``$HOSTNAME`` (Kubernetes sets
it to the pod name), else the system's.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Any

import grpc
from onnxps.wire.codec import SHARD_METADATA_KEY

from ._handlers import SERVICE, Call, CallHooks, Handler, HookInterceptor, Refusal
from ._status import rich_status
from .security import ConfigError

__all__ = ["ShardIdentity", "ShardInterceptor", "parse_shard"]

_ORDINAL = re.compile(r"-(\d+)$")
REASON = "SHARD_LAYOUT_MISMATCH"


@dataclass(frozen=True)
class ShardIdentity:
    index: int  # from 0
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def _hostname() -> str:
    return os.environ.get("HOSTNAME") or socket.gethostname()


def parse_shard(text: str, hostname: str | None = None) -> ShardIdentity:
    """``"2/4"``, or ``"auto/4"`` with the index from the host name's ordinal."""
    index_text, sep, count_text = text.partition("/")
    try:
        count = int(count_text)
    except ValueError:
        count = 0
    if not sep or count < 1:
        raise ConfigError(
            f"--shard takes INDEX/COUNT or auto/COUNT (e.g. 2/4), got {text!r}"
        )
    if index_text == "auto":
        host = hostname if hostname is not None else _hostname()
        m = _ORDINAL.search(host)
        if m is None:
            raise ConfigError(
                f"--shard auto/{count}: the host name {host!r} does not end in "
                "-<ordinal> (a StatefulSet pod's name does); give the index"
            )
        index_text = m.group(1)
    if not index_text.isdigit() or int(index_text) >= count:
        raise ConfigError(
            f"--shard {text!r}: the index must be a whole number from 0 to {count - 1}"
        )
    return ShardIdentity(int(index_text), count)


def _routed(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == SHARD_METADATA_KEY:
            return value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return None


def mismatch(
    shard: ShardIdentity | None, routed: str, any_count: bool = False
) -> str | None:
    """Why a call routed as ``routed`` ("I/N") may not be served here; None: it may.
    ``any_count``: a shard of a cluster found through etcd, whose shard count a
    resharding changes (docs/resharding.md): only the index must match."""
    index_text, _, count_text = routed.partition("/")
    if not (index_text.isdigit() and count_text.isdigit()):
        return f"the {SHARD_METADATA_KEY} metadata must be INDEX/COUNT, got {routed!r}"
    index, count = int(index_text), int(count_text)
    if shard is None:
        if count == 1:
            return None
        return (
            f"this server is not a shard (started without --shard); the client "
            f"routed for {count} shards"
        )
    if count != shard.count and not any_count:
        return (
            f"this is shard {shard.index} of {shard.count}; the client routed for "
            f"{count} shards"
        )
    if index != shard.index:
        return (
            f"this is shard {shard.index} of {shard.count}; the client routed this "
            f"call to shard {index} (its address list is in another order)"
        )
    return None


class _Refused(Refusal):
    __slots__ = ("status",)

    def __init__(self, status: grpc.Status) -> None:
        self.status = status

    def before(self, call: Call, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(self.status)


class ShardInterceptor(HookInterceptor):
    """Refuses calls routed for another shard layout (decided from the metadata)."""

    reads_metadata = True

    def __init__(self, shard: ShardIdentity | None, any_count: bool = False) -> None:
        self.shard = shard
        self.any_count = any_count

    def call_hooks(
        self, handler: Handler, called: tuple[str, str], metadata: Any
    ) -> CallHooks | None:
        service, _ = called
        routed = _routed(metadata)
        if service != SERVICE or routed is None:
            return None
        why = mismatch(self.shard, routed, self.any_count)
        if why is None:
            return None
        metadata = {"routed": routed}
        if self.shard is not None:
            metadata["shard"] = str(self.shard)
        status = rich_status(grpc.StatusCode.FAILED_PRECONDITION, why, REASON, metadata)
        return _Refused(status)
