"""Replicated shards: a shard is a replica set on etcd.

``onnxps serve --durability wal --coordinator etcd://H:P/PREFIX --shard I/N``: the
servers of one coordinator prefix and shard index elect a primary through etcd
(``_member``); the primary ships its write-ahead log to the standbys and
acknowledges a change once ``--sync-replicas`` of them hold it (``_journal``); a
standby catches up from a snapshot and then applies every record in order
(``_standby``). Without ``--coordinator`` none of this runs. This is where a push's
record is replicated. It may import ``durability``, ``store``, ``interceptors`` (TLS
settings, the shard identity) and ``errors``; only the process wiring imports it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from onnxps.v1 import parameter_server_pb2 as pb

from ..durability import Durability
from ..durability._wal import fsync_dir
from ..errors import Unavailable
from ..interceptors.security import ConfigError
from ..interceptors.shard import ShardIdentity
from ..store import ParameterStore
from ._etcd import (
    CoordinatorAddress,
    CoordinatorTls,
    CoordinatorUnavailable,
    Etcd,
    parse_coordinator,
)
from ._journal import MEMBER_ID, MEMBER_ID_RULE, NotPrimary, ReplicatedJournal
from ._member import Keys, Member, MemberConfig, MemberIdInUse, PrimaryInfo, Role
from ._placement import PlacementWatch
from ._standby import Follower

__all__ = [
    "CoordinatorAddress",
    "CoordinatorTls",
    "CoordinatorUnavailable",
    "Keys",
    "MemberIdInUse",
    "NotPrimary",
    "Replication",
    "ReplicationConfig",
    "ReplicationTls",
    "Role",
    "exit_process",
    "parse_coordinator",
]

log = logging.getLogger("onnxps.replication")

EXIT_DEPOSED = 75  # EX_TEMPFAIL: restart me, I rejoin as a standby
INSTANCE_FILE = "member-instance"
# a promotion that applied nothing of what it received for this long gives up
# (the process exits; restarted, it replays its log and follows)
PROMOTION_STALL = 120.0


def exit_process(why: str) -> None:
    """What a primary that cannot go on does: exit at once (restarted, it replays its
    own log and follows the new primary)."""
    log.critical("exiting (status %d): %s", EXIT_DEPOSED, why)
    logging.shutdown()
    os._exit(EXIT_DEPOSED)


@dataclass(frozen=True)
class ReplicationTls:
    """How a standby reaches its primary over TLS (PEM file paths): the CA the
    primary's certificate chains to (None: the system's roots), and the client
    certificate and key it presents when the primary asks for one (mutual TLS)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca),
            private_key=read(self.key),
            certificate_chain=read(self.cert),
        )


@dataclass(frozen=True)
class ReplicationConfig:
    coordinator: CoordinatorAddress
    shard: ShardIdentity
    sync_replicas: int = 1
    sync_policy: str = "refuse"  # or "lower"
    lease_ttl: int = 3
    member_id: str | None = None
    max_message_bytes: int = 256 << 20
    token: str | None = None  # presented to the primary by the standby
    tls: ReplicationTls | None = None  # None: plaintext to the primary

    @property
    def ack_timeout(self) -> float:
        return max(5.0, 3.0 * self.lease_ttl)


def member_id_for(address: str) -> str:
    """The default member id: host name and port (stable across restarts)."""
    port = address.rsplit(":", 1)[-1]
    return f"{socket.gethostname()}-{port}"


def instance_id(root: str) -> str:
    """This data dir's id (made once, kept in it): a member key holding it was
    written by an earlier process of this data dir, which is gone (the running
    process holds the data dir's lock)."""
    path = os.path.join(root, INSTANCE_FILE)
    try:
        with open(path) as f:
            found = f.read().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    made = uuid.uuid4().hex
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(made + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    fsync_dir(root)
    return made


class Replication:
    """This server's part in its shard's replica set; built by ``create_server``."""

    def __init__(
        self,
        config: ReplicationConfig,
        store: ParameterStore,
        durability: Durability | None,
        *,
        on_fatal: Callable[[str], None] = exit_process,
        set_caught_up: Callable[[bool], None] = lambda caught_up: None,
    ) -> None:
        if durability is None or durability.mode != "wal":
            raise ConfigError(
                "--coordinator needs --durability wal (a replica set ships its "
                "write-ahead log) and a --data-dir"
            )
        if config.lease_ttl < 2:
            raise ConfigError(
                f"--lease-ttl must be at least 2 seconds (etcd's minimum), got "
                f"{config.lease_ttl}"
            )
        if config.sync_replicas < 0:
            raise ConfigError(
                f"--sync-replicas must be 0 or more, got {config.sync_replicas}"
            )
        self.config = config
        self.store = store
        self.durability = durability
        self._on_fatal = on_fatal
        self._set_caught_up = set_caught_up
        self._caught_up: bool | None = None  # as last published
        self._why = ""  # the kind of reason last logged
        self._promoting = False  # took the lead, still applying what it received
        self._led = False  # took the lead once: memory is what the log holds
        self.etcd = Etcd(config.coordinator, timeout=max(0.5, config.lease_ttl / 3))
        self.member: Member | None = None
        self.journal: ReplicatedJournal | None = None
        self.follower: Follower | None = None
        store.moves.shard = config.shard.index  # what a resharding moves here
        self.placement = PlacementWatch(
            self.etcd.clone(), config.coordinator.prefix, config.shard.index, store
        )

    def start(self, address: str) -> None:
        """Join the replica set, reachable at ``address`` (after the server bound)."""
        member_id = self.config.member_id or member_id_for(address)
        durability = self.durability
        assert durability is not None
        follower = Follower(
            durability,
            member_id=member_id,
            address=address,
            term=lambda: 0 if self.member is None else self.member.term,
            max_message_bytes=self.config.max_message_bytes,
            token=self.config.token,
            credentials=None
            if self.config.tls is None
            else self.config.tls.credentials(),
            lease=lambda: 0 if self.member is None else self.member.lease,
            on_fatal=self._on_fatal,
        )
        member = Member(
            MemberConfig(
                self.config.coordinator,
                self.config.shard,
                member_id,
                address,
                self.config.lease_ttl,
                instance_id(durability.root),
            ),
            self.etcd,
            last_lsn=self._last_lsn,
            on_promoted=self._promoted,
            on_primary=follower.follow,
            on_deposed=self._on_fatal,
            eligible=self._eligible,
            on_step=self._publish_caught_up,
            standbys=self._standbys,
        )
        journal = ReplicatedJournal(
            durability,
            member,
            sync_replicas=self.config.sync_replicas,
            lower=self.config.sync_policy == "lower",
            ack_timeout=self.config.ack_timeout,
            on_stuck=self._on_fatal,
        )
        self.member, self.follower, self.journal = member, follower, journal
        self.store.set_journal(journal)
        durability.set_position(self._position)
        follower.start()
        member.start()
        self.placement.start()
        log.info(
            "member %s of shard %s under %s (sync replicas %d, lease %d s)",
            member_id, self.config.shard, self.config.coordinator,
            self.config.sync_replicas, self.config.lease_ttl,
        )  # fmt: skip

    def caught_up(self) -> tuple[bool, str, str]:
        """Whether this replica holds what its shard acknowledged, why, and the
        kind of reason: the primary that may acknowledge (once it applied what it
        received before it took the lead); a standby following the current term's
        primary (its stream open, and the primary names it in etcd: it accepted
        this standby's log as a prefix of its own) holding (durably, not adopting
        a snapshot) every record the primary had logged when it last published
        its position in etcd. A position alone says nothing across terms: a
        deposed primary may hold more records than the new one logged, some never
        acknowledged. What ``onnxps.ready`` says."""
        member, follower = self.member, self.follower
        if member is None or follower is None or member.role is Role.STOPPED:
            return False, "not in the replica set", "stopped"
        if self._promoting:
            why = "taking the lead: applying the records it received"
            return False, why, "promoting"
        if member.role is Role.PRIMARY:
            if member.may_acknowledge():
                return True, f"the primary (term {member.term})", "primary"
            return False, "the primary, its lease not renewed in time", "lease"
        primary, logged = member.primary, member.primary_lsn
        if primary is None or logged is None:
            return False, "no primary known yet", "unknown"
        if not self._eligible():
            return False, "adopting a snapshot", "adopting"
        held = follower.durable
        named = member.primary_standbys  # None: an earlier onnxps's primary
        if follower.following != primary or (
            named is not None and member.config.member_id not in named
        ):
            why = (
                f"does not follow the primary {primary.member} of term "
                f"{primary.term} (holds record {held} of term "
                f"{follower.durable_term}, the primary had logged {logged})"
            )
            return False, why, "not following"
        why = f"holds record {held}, the primary {primary.member} had logged {logged}"
        return (False, why, "behind") if held < logged else (True, why, "holds")

    def _standbys(self) -> dict[str, int]:
        """The standbys following this primary in its term, and the lsn each
        acknowledged (published in its member key)."""
        if self.journal is None:
            return {}
        return {
            name: int(s["acked"])
            for name, s in self.journal.status()["standbys"].items()
            if not s["gone"] and not s["syncing"]
        }

    @contextlib.contextmanager
    def _position(self) -> Iterator[int | None]:
        """What this server's memory holds, for a snapshot (``Durability``): a
        standby's last record applied, no record applied meanwhile; None for the
        server that took the lead (it applies what it logs, under the group's
        lock; it leads until it exits). A promotion waits for this."""
        follower = self.follower
        if follower is None or self._led:
            yield None
            return
        with follower.held() as applied:
            yield None if self._led else applied

    def _publish_caught_up(self) -> None:
        """Tell the health service when readiness changes; log each new reason."""
        ready, why, kind = self.caught_up()
        if kind != self._why:
            self._why = kind
            log.info("%s: %s", "caught up (ready)" if ready else "not ready", why)
        if ready != self._caught_up:
            self._caught_up = ready
            self._set_caught_up(ready)

    def _eligible(self) -> bool:
        """Not while (or after a crash while) a snapshot replaces this server's
        state: it may hold less than it acknowledged before."""
        return self.durability is not None and not self.durability.adopting

    def _last_lsn(self) -> int:
        journal = self.durability.journal if self.durability is not None else None
        return 0 if journal is None else int(journal.last_lsn())

    def _promoted(self, term: int) -> None:
        """Before acknowledging anything: stop following, finish applying. Until
        then a group not applied yet is UNAVAILABLE (``STATE_REPLACING``, which
        clients retry), not NOT_FOUND, and this server is not ready."""
        follower, journal = self.follower, self.journal
        assert follower is not None and journal is not None
        self._promoting = True
        try:
            with self.store.replacing_state(
                f"taking the lead of shard {self.config.shard} (term {term}): "
                "applying the records it received"
            ):
                self._publish_caught_up()
                follower.follow(None)
                self._finish_applying(follower)
                # a resharding may have fenced a group since the last poll
                if not self.placement.read_now():
                    log.error(
                        "taking the lead of shard %s: the placement map could not "
                        "be read; a group a resharding fenced in the last half "
                        "second may be served until the next poll",
                        self.config.shard,
                    )
                with follower.held():  # from now on memory is what the log holds
                    self._led = True
                journal.promoted(self._last_lsn())
        finally:
            self._promoting = False

    def _finish_applying(self, follower: Follower) -> None:
        """Wait for the follower to have applied every record it received; give up
        (``on_fatal``) when it applied none for ``PROMOTION_STALL`` seconds."""
        applied, since = follower.applied, time.monotonic()
        while not follower.idle.wait(1.0):
            if follower.applied != applied:
                applied, since = follower.applied, time.monotonic()
            elif time.monotonic() - since > PROMOTION_STALL:
                why = (
                    f"taking the lead, it applied none of the records it received "
                    f"for {PROMOTION_STALL:g} s (record {applied} last)"
                )
                self._on_fatal(why)
                raise Unavailable(why)

    def replicate(
        self, requests: Iterable[pb.ReplicateRequest], context: Any
    ) -> Iterator[pb.ReplicateResponse | bytes]:
        if self.journal is None:
            raise Unavailable("this server is starting: retry")
        return self.journal.replicate(requests, context)

    def metrics(self) -> dict[str, Any]:
        """What ``ReplicationCollector`` exports, read now."""
        member, journal = self.member, self.journal
        lsn = self._last_lsn()
        lag: dict[str, int] = {}
        sync = 0
        if member is not None and member.role is Role.PRIMARY and journal is not None:
            status = journal.status()
            for name, s in status["standbys"].items():
                if not s["gone"]:
                    lag[name] = max(0, lsn - int(s["acked"]))
            sync = len([m for m in status["sync"] if m in lag])
        return {
            "role": self.role().value,
            "term": 0 if member is None else member.term,
            "lsn": lsn,
            "failovers": 0 if member is None else member.failovers,
            "lag": lag,
            "sync": sync,
        }

    def collector(self) -> Any:
        from ._metrics import ReplicationCollector

        return ReplicationCollector(self.metrics)

    def role(self) -> Role:
        return Role.STOPPED if self.member is None else self.member.role

    def stop(self) -> None:
        self.placement.stop()
        if self.member is not None:
            self.member.stop(resign=True)
        if self.follower is not None:
            self.follower.stop()
        self.store.set_journal(
            None if self.durability is None else self.durability.journal
        )


__all__ += ["PrimaryInfo", "from_server_config"]


def from_server_config(
    config: Any,
    shard: Any,
    store: ParameterStore,
    durability: Durability | None,
    registry: Any,
    set_caught_up: Any,
) -> Replication:
    """The replica set part of a server started with ``config`` (a ``ServerConfig``
    with ``--coordinator``), its metrics registered in ``registry`` (when serving
    metrics), telling ``set_caught_up`` whether this replica holds what the shard
    acknowledged."""
    if shard is None:
        raise ConfigError("--coordinator needs --shard INDEX/COUNT (e.g. 0/1)")
    if config.member_id is not None and not MEMBER_ID.fullmatch(config.member_id):
        raise ConfigError(
            f"--member-id must be {MEMBER_ID_RULE} (a primary refuses any other "
            f"in a standby's hello), got {config.member_id[:140]!r}"
        )
    etcd_tls = CoordinatorTls(
        config.coordinator_ca, config.coordinator_cert, config.coordinator_key
    )
    replication = Replication(
        ReplicationConfig(
            parse_coordinator(config.coordinator, etcd_tls),
            shard,
            sync_replicas=config.sync_replicas,
            sync_policy=config.sync_policy,
            lease_ttl=config.lease_ttl,
            member_id=config.member_id,
            max_message_bytes=config.max_message_bytes,
            token=config.replication_token,
            tls=_replication_tls(config),
        ),
        store,
        durability,
        set_caught_up=set_caught_up,
    )
    if registry is not None:
        registry.register(replication.collector())
    return replication


def _replication_tls(config: Any) -> ReplicationTls | None:
    """How a standby reaches its primary: TLS when this server serves TLS (a replica
    set's servers share their settings), verified against --tls-ca (else the
    client CA, else the system's roots), with this server's certificate as its
    client certificate under mutual TLS."""
    if not config.tls_cert or not config.tls_key:
        return None
    return ReplicationTls(
        ca=config.tls_ca or config.tls_client_ca,
        cert=config.tls_cert if config.tls_client_ca else None,
        key=config.tls_key if config.tls_client_ca else None,
    )
