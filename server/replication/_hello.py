"""Who may follow a primary: the checks of a ``ReplicateHello`` before a
``Replicate`` stream gets anything, and the log of refused followers.

A hello names a member id of the form etcd's member keys hold and carries the
lease of that member's key: only the process that registered it holds that lease
(a tenant, or another member, does not), so a stream cannot speak for a member it
is not. Refusals are logged once per member and reason.
"""

from __future__ import annotations

import logging
import re
import threading

from onnxps.v1 import parameter_server_pb2 as pb

from ..errors import InvalidArgument, PermissionDenied, Unavailable
from ._etcd import CoordinatorUnavailable
from ._member import Member

__all__ = ["MAX_ADDRESS", "MEMBER_ID", "MEMBER_ID_RULE", "HelloCheck", "Refusals"]

log = logging.getLogger("onnxps.replication")

# What a hello may name: a member id as etcd keys hold it, an address for logs.
MEMBER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
MEMBER_ID_RULE = (
    "1 to 128 characters of [A-Za-z0-9._:@-], the first a letter or a digit"
)
MAX_ADDRESS = 256


class Refusals:
    """Logs each refused follower once per (member, reason) at WARNING, then at
    DEBUG: a standby retrying every 0.2 s does not fill the log."""

    def __init__(self, limit: int = 256) -> None:
        self._seen: dict[tuple[str, str], None] = {}
        self._limit = limit
        self._lock = threading.Lock()

    def log(self, member_id: str, reason: str, message: str) -> None:
        key = (member_id[:128], reason)
        with self._lock:
            first = key not in self._seen
            if first:
                if len(self._seen) >= self._limit:
                    self._seen.pop(next(iter(self._seen)))
                self._seen[key] = None
        log.log(logging.WARNING if first else logging.DEBUG, "%s", message)


class HelloCheck:
    """Checks a standby's hello against its shard's member keys in etcd, read on a
    client of its own (one hello at a time)."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self.refusals = Refusals()
        self._etcd = member.etcd.clone()
        self._etcd_lock = threading.Lock()

    def check(self, hello: pb.ReplicateHello) -> str:
        """Only a member of this shard may follow, and only under its own id: the
        hello names a registered member and carries the lease of its key in etcd
        (which a tenant, or another member, does not hold). Returns the data dir
        id (``instance``) that key names."""
        member_id = hello.member_id
        if not MEMBER_ID.fullmatch(member_id):
            self.refusals.log(
                member_id, "id", f"refused a Replicate stream: bad member id "
                f"({len(member_id)} characters)",
            )  # fmt: skip
            raise InvalidArgument(
                f"ReplicateHello.member_id must be {MEMBER_ID_RULE}, got "
                f"{len(member_id)} characters",
                reason="BAD_MEMBER_ID",
            )
        if len(hello.address) > MAX_ADDRESS:
            raise InvalidArgument(
                f"ReplicateHello.address must be at most {MAX_ADDRESS} characters, "
                f"got {len(hello.address)}",
                reason="BAD_MEMBER_ID",
            )
        if member_id == self.member.config.member_id:
            raise PermissionDenied(
                f"member {member_id} is this primary: it does not follow itself",
                reason="STANDBY_NOT_MEMBER",
            )
        key = self.member.keys.member(member_id)
        try:
            with self._etcd_lock:
                kv = self._etcd.get(key)
        except CoordinatorUnavailable as exc:
            raise Unavailable(
                f"cannot check standby {member_id} in etcd ({exc}): retry"
            ) from None
        if kv is not None and kv.lease != 0 and kv.lease == hello.lease:
            try:
                instance = kv.json().get("instance", "")
            except (ValueError, AttributeError):
                instance = ""
            return instance if isinstance(instance, str) else ""
        why = (
            f"no member {member_id} is registered in this shard (no key {key} in etcd)"
            if kv is None
            else f"the hello's lease ({hello.lease}) is not the one of member "
            f"{member_id}'s key {key} in etcd (a standby of an earlier onnxps sends "
            "none: upgrade it)"
        )
        self.refusals.log(
            member_id, "lease" if kv is not None else "absent",
            f"refused a Replicate stream under member id {member_id} from "
            f"{hello.address[:MAX_ADDRESS]!r}: {why}",
        )  # fmt: skip
        raise PermissionDenied(
            f"{why}: only a replica of this shard follows its primary, under its "
            "own member id",
            reason="STANDBY_NOT_MEMBER",
            metadata={"member": member_id},
        )
