"""A replica set member: its lease, its registration, the election and fencing.

Servers started with the same coordinator prefix and shard index form that shard's
replica set (Patroni's shape, on etcd v3). Keys, under ``PREFIX/shards/I/``:

- ``primary``: ``{"member", "address", "term"}`` on the primary's lease. Written by a
  transaction that succeeds only while the key is absent, bumping ``term`` in the same
  transaction: the term (epoch) fences older primaries.
- ``term``: the counter, as decimal text.
- ``sync``: ``{"primary", "term", "standbys", "instances"}``: the standbys holding
  every acknowledged push (only the primary writes it, only while it holds
  ``primary``), and the data dir (``instance``) of each and of the primary. A
  standby may take the lead only when it is named there, or is the primary named
  there (Patroni's synchronous-standby rule), and its data dir is the one named:
  so a promotion never loses an acknowledged push, not even to a process started
  under a named member id on another (empty) data dir.
- ``members/<id>``: ``{"address", "role", "lsn", "term", "shards", "instance"}`` on
  the member's own lease; a primary's also has ``standbys``: each standby whose
  stream it accepted in its term (its log a prefix of the primary's) and the lsn
  it acknowledged. ``instance`` names the data dir (``Replication``): the key is
  created only while absent or held by this data dir's earlier process (one
  killed, its lease not yet expired), and written only while it is on this
  process's lease, so a second live process with the same ``--member-id`` is
  refused (``MemberIdInUse``) instead of taking the member's place.

``PREFIX/layout`` holds the cluster's shard count (clients read it).

The lease is renewed every TTL/3 on a thread that does nothing else, with its own
etcd connections (an etcd read or write of the member's loop that hangs, or a
promotion draining what it received, does not hold a renewal up); a primary whose
last successful renewal is older than TTL*2/3 stops acknowledging
(``may_acknowledge``) before etcd can expire the lease and another member can be
elected.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..interceptors.security import ConfigError
from ..interceptors.shard import ShardIdentity
from ._etcd import (
    CoordinatorAddress,
    CoordinatorUnavailable,
    Etcd,
    KeyValue,
    absent,
    delete_op,
    lease_is,
    mod_revision_is,
    put_op,
    value_is,
)

__all__ = ["Keys", "Member", "MemberConfig", "MemberIdInUse", "Role"]

log = logging.getLogger("onnxps.replication")


class MemberIdInUse(ConfigError):
    """Another live process holds this server's member id (``onnxps serve`` exits
    with status 2 and says so)."""


class Role(enum.Enum):
    STANDBY = "standby"
    PRIMARY = "primary"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Keys:
    prefix: str
    shard: int

    @property
    def base(self) -> str:
        return f"{self.prefix}/shards/{self.shard}"

    @property
    def primary(self) -> str:
        return f"{self.base}/primary"

    @property
    def term(self) -> str:
        return f"{self.base}/term"

    @property
    def sync(self) -> str:
        return f"{self.base}/sync"

    @property
    def members(self) -> str:
        return f"{self.base}/members/"

    def member(self, member_id: str) -> str:
        return f"{self.members}{member_id}"

    @property
    def layout(self) -> str:
        return f"{self.prefix}/layout"


@dataclass(frozen=True)
class MemberConfig:
    coordinator: CoordinatorAddress
    shard: ShardIdentity
    member_id: str
    address: str  # where clients and standbys reach this server
    lease_ttl: int = 3
    instance: str = ""  # the data dir's id: its earlier process's key is its own


@dataclass(frozen=True)
class PrimaryInfo:
    member: str
    address: str
    term: int


def _dumps(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


class Member:
    """This server in its shard's replica set (a thread, and one renewing its lease).

    ``on_promoted(term)`` runs (on the member's thread) once this server took the
    lead, before it acknowledges anything; ``on_primary(info)`` whenever the known
    primary changes (None: none now); ``on_deposed(why)`` when this primary lost its
    lease or its key: it must acknowledge nothing more.
    ``eligible()`` says whether this server may take the lead now (besides the
    ``sync`` rule), e.g. it has applied everything it received. ``standbys()``
    (asked while primary): the standbys following it and the lsn each acknowledged,
    published in its member key.
    """

    def __init__(
        self,
        config: MemberConfig,
        etcd: Etcd,
        *,
        last_lsn: Callable[[], int],
        on_promoted: Callable[[int], None],
        on_primary: Callable[[PrimaryInfo | None], None],
        on_deposed: Callable[[str], None],
        eligible: Callable[[], bool] = lambda: True,
        on_step: Callable[[], None] = lambda: None,
        standbys: Callable[[], dict[str, int]] = dict,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.keys = Keys(config.coordinator.prefix, config.shard.index)
        self.etcd = etcd
        self._last_lsn = last_lsn
        self._on_promoted = on_promoted
        self._on_primary = on_primary
        self._on_deposed = on_deposed
        self._eligible = eligible
        self._on_step = on_step
        self._standbys = standbys
        self._clock = clock
        self._lock = threading.Lock()
        self.role = Role.STANDBY
        self.term = 0
        self.primary: PrimaryInfo | None = None
        # the lsn the primary last published in its member key (None: not read yet)
        # and the standbys it named following it (their acknowledged lsn; None:
        # an earlier onnxps's primary, which names none)
        self.primary_lsn: int | None = None
        self.primary_standbys: dict[str, int] | None = {}
        self._lease = 0
        self._renewed = -1e18  # when the last successful renewal was sent
        self._sent = -1e18
        self._lapsed = 0  # a lease the renewing thread found expired (a standby's)
        self._registered = -1e18
        self._not_campaigning = ""  # why it may not take the lead (logged once)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewer: threading.Thread | None = None
        self._renewer_etcd = etcd.clone()  # its own connections
        self.failovers = 0

    # -- lifecycle ------------------------------------------------------------------
    def start(self, wait: float = 15.0) -> None:
        """Register in etcd (waiting up to ``wait`` seconds for it to answer)."""
        deadline = self._clock() + wait
        waited = False  # said once, not every try: a wrong address is one line
        while True:
            try:
                self._check_layout()
                break
            except CoordinatorUnavailable as exc:
                if self._clock() >= deadline:
                    raise CoordinatorUnavailable(
                        f"cannot reach etcd at {self.config.coordinator} (waited "
                        f"{wait:g} s): {exc} (check --coordinator: etcd's client "
                        "address, etcd://HOST:PORT/PREFIX, and that etcd runs there)"
                    ) from None
                if not waited:
                    log.warning(
                        "etcd at %s does not answer (%s): trying for up to %g s",
                        self.config.coordinator,
                        exc,
                        wait,
                    )
                    waited = True
                time.sleep(0.5)
        if waited:
            log.info("etcd at %s answered", self.config.coordinator)
        self._new_lease()
        self._claim()
        self._renewer = threading.Thread(
            target=self._renew_loop, name="onnxps-lease", daemon=True
        )
        self._renewer.start()
        self._thread = threading.Thread(
            target=self._run, name="onnxps-replica", daemon=True
        )
        self._thread.start()

    def stop(self, resign: bool = True) -> None:
        """Stop taking part; a primary gives its key up at once (``resign``)."""
        self._stop.set()
        for thread in (self._thread, self._renewer):
            if thread is not None:
                thread.join(timeout=10)
        with self._lock:
            was_primary = self.role is Role.PRIMARY
            self.role = Role.STOPPED
        if resign and self._lease:
            try:
                if was_primary:
                    self.etcd.txn(
                        [value_is(self.keys.primary, self._primary_value())],
                        [delete_op(self.keys.primary)],
                    )
                self.etcd.revoke(self._lease)
            except CoordinatorUnavailable:
                pass

    # -- what the data path asks ----------------------------------------------------
    @property
    def lease(self) -> int:
        """The etcd lease this member's key is put with (0 before it registered): a
        standby's hello carries it as proof that the stream is this member's."""
        return self._lease

    @property
    def ttl(self) -> float:
        return float(self.config.lease_ttl)

    def may_acknowledge(self) -> bool:
        """A primary whose lease is certainly still held (renewed within TTL*2/3)."""
        with self._lock:
            if self.role is not Role.PRIMARY:
                return False
        return self._clock() - self._renewed < self.ttl * 2 / 3

    def may_hold_lease(self) -> bool:
        """A primary whose lease may still be held: its last renewal sent less than
        a TTL ago (a late renewal, not yet answered, may still keep it; no other
        member can be elected before then)."""
        with self._lock:
            if self.role is not Role.PRIMARY:
                return False
        return self._clock() - self._renewed < self.ttl

    def set_sync_standbys(
        self, standbys: list[str], instances: dict[str, str] | None = None
    ) -> bool:
        """Name the standbys that hold every acknowledged push (while primary),
        with the data dir (``instance``) each holds them in."""
        value = _dumps(
            {
                "primary": self.config.member_id,
                "term": self.term,
                "standbys": sorted(standbys),
                "instances": self._instances(instances or {}),
            }
        )
        try:
            return self.etcd.txn(
                [value_is(self.keys.primary, self._primary_value())],
                [put_op(self.keys.sync, value)],
            )
        except CoordinatorUnavailable:
            return False

    def _instances(self, standbys: dict[str, str]) -> dict[str, str]:
        """``sync``'s ``instances``: this primary's data dir and the standbys'
        (those known: a standby of an earlier onnxps names none)."""
        named = {m: i for m, i in standbys.items() if i}
        if self.config.instance:
            named[self.config.member_id] = self.config.instance
        return named

    def _named_elsewhere(self, named: dict[str, Any]) -> str | None:
        """Why ``sync`` names this member id for another data dir (it may not take
        the lead: it lacks what that one acknowledged), or None."""
        instances = named.get("instances")
        if not isinstance(instances, dict):
            return None  # written by an earlier onnxps: the member id alone
        there = instances.get(self.config.member_id)
        if not there or not self.config.instance or there == self.config.instance:
            return None
        return (
            f"member id {self.config.member_id} is named in {self.keys.sync} for "
            f"the data dir {there}, and this server's data dir is "
            f"{self.config.instance} (another disk, or a new one): it does not "
            "hold what that one acknowledged, so it does not take the lead; it "
            "follows the primary (once there is one) and is named synchronous "
            "again once it holds every acknowledged push"
        )

    # -- the loop -------------------------------------------------------------------
    def _run(self) -> None:
        tick = max(0.05, self.ttl / 10)
        wait = 0.0  # the first step at once: a restarted standby follows sooner
        while not self._stop.wait(wait):
            wait = tick
            try:
                self._step()
            except CoordinatorUnavailable as exc:
                log.warning("etcd unreachable: %s", exc)
            except Exception:
                log.exception("replica set member step failed")

    def _renew_loop(self) -> None:
        """Renew the lease every TTL/3 (this thread does nothing else)."""
        while not self._stop.wait(max(0.0, self._sent + self.ttl / 3 - self._clock())):
            try:
                self._renew()
            except CoordinatorUnavailable as exc:
                log.warning("etcd unreachable, lease not renewed: %s", exc)
            except Exception:
                log.exception("renewing the etcd lease failed")

    def _step(self) -> None:
        if self._lapsed and self._lapsed == self._lease:
            log.warning("etcd lease %x expired; registering again", self._lease)
            self._new_lease()
            self._register()
        if self.role is Role.PRIMARY:
            self._check_still_primary()
        elif self.role is Role.STANDBY:
            self._follow_or_campaign()
        if self._clock() - self._registered >= max(0.5, self.ttl / 3):
            self._register()
            if self.role is Role.STANDBY:
                self._read_primary_lsn()
        self._on_step()

    def _read_primary_lsn(self) -> None:
        """The primary's position, as it published it (``_register``): a standby
        holding it is caught up (``Replication.caught_up``)."""
        primary = self.primary
        if primary is None:
            self.primary_lsn, self.primary_standbys = None, {}
            return
        kv = self.etcd.get(self.keys.member(primary.member))
        info = None if kv is None else kv.json()
        if (
            info is None
            or primary != self.primary
            or info.get("role") != Role.PRIMARY.value
            or int(info.get("term", 0)) != primary.term
        ):
            self.primary_lsn, self.primary_standbys = None, {}
        else:
            self.primary_lsn = int(info.get("lsn", 0))
            named = info.get("standbys")
            self.primary_standbys = None if named is None else dict(named)

    def _renew(self) -> None:
        """On the renewing thread: a lease that expired deposes a primary; a
        standby's is replaced by the member's loop (``_lapsed``)."""
        sent = self._clock()
        self._sent = sent
        lease = self._lease
        ttl = self._renewer_etcd.keepalive(lease)
        if ttl > 0:
            self._renewed = max(self._renewed, sent)
            return
        if lease != self._lease:
            return  # replaced meanwhile
        if self.role is Role.PRIMARY:
            self._depose("its etcd lease expired")
            return
        self._lapsed = lease

    def _check_still_primary(self) -> None:
        kv = self.etcd.get(self.keys.primary)
        if kv is None or kv.value != self._primary_value():
            self._depose("its primary key is gone or another member's")
        elif not self.may_acknowledge():
            log.warning("lease not renewed for %.1f s: not acknowledging",
                        self._clock() - self._renewed)  # fmt: skip

    def _depose(self, why: str) -> None:
        with self._lock:
            if self.role is not Role.PRIMARY:
                return
            self.role = Role.STOPPED
        log.error("no longer the primary of shard %s: %s", self.config.shard, why)
        self._on_deposed(why)

    def _follow_or_campaign(self) -> None:
        kv = self.etcd.get(self.keys.primary)
        if kv is not None:
            info = kv.json()
            seen = PrimaryInfo(info["member"], info["address"], int(info["term"]))
            if seen != self.primary:
                self.primary, self.primary_lsn = seen, None
                self.primary_standbys = {}
                self.term = max(self.term, seen.term)
                self._on_primary(seen)
            return
        if self.primary is not None:
            self.primary = None
            self._on_primary(None)
        if self._clock() - self._renewed < self.ttl * 2 / 3 and self._eligible():
            self._campaign()

    def _campaign(self) -> None:
        sync = self.etcd.get(self.keys.sync)
        if sync is not None:
            named = sync.json()
            me = self.config.member_id
            if me != named.get("primary") and me not in named.get("standbys", []):
                return  # may lack acknowledged pushes
            elsewhere = self._named_elsewhere(named)
            if elsewhere is not None:
                if elsewhere != self._not_campaigning:
                    self._not_campaigning = elsewhere
                    log.warning("%s", elsewhere)
                return
        term_kv = self.etcd.get(self.keys.term)
        term = int(term_kv.value) if term_kv is not None else 0
        new_term = term + 1
        value = self._primary_value(new_term)
        compare = [
            absent(self.keys.primary),
            mod_revision_is(self.keys.sync, 0 if sync is None else sync.mod_revision),
            mod_revision_is(
                self.keys.term, 0 if term_kv is None else term_kv.mod_revision
            ),
        ]
        sync_value = _dumps(
            {
                "primary": self.config.member_id,
                "term": new_term,
                "standbys": [],
                "instances": self._instances({}),
            }
        )
        won = self.etcd.txn(
            compare,
            [
                put_op(self.keys.primary, value, self._lease),
                put_op(self.keys.term, str(new_term)),
                put_op(self.keys.sync, sync_value),
            ],
        )
        if not won:
            return
        self.term = new_term
        self.primary = PrimaryInfo(self.config.member_id, self.config.address, new_term)
        log.info(
            "member %s is the primary of shard %s (term %d)",
            self.config.member_id,
            self.config.shard,
            new_term,
        )
        self._on_promoted(new_term)
        if not self._renew_after_promotion():
            return
        with self._lock:
            self.role = Role.PRIMARY
        self.failovers += 1
        self._on_primary(self.primary)
        self._register()

    def _renew_after_promotion(self) -> bool:
        """Renew the lease once this server finished applying what it received,
        before it acknowledges anything; False when the lease lapsed meanwhile
        (its primary key went with it)."""
        sent = self._clock()
        try:
            ttl = self.etcd.keepalive(self._lease)
        except CoordinatorUnavailable:
            return True  # the fence (may_acknowledge) decides, as for any renewal
        if ttl > 0:
            self._renewed = self._sent = sent
            return True
        log.warning(
            "etcd lease %x lapsed while taking the lead; following", self._lease
        )
        self.primary = None
        self._on_primary(None)
        self._new_lease()
        self._register()
        return False

    # -- keys -----------------------------------------------------------------------
    def _primary_value(self, term: int | None = None) -> bytes:
        return _dumps(
            {
                "member": self.config.member_id,
                "address": self.config.address,
                "term": self.term if term is None else term,
            }
        )

    def _new_lease(self) -> None:
        sent = self._clock()
        self._lease = self.etcd.grant(self.config.lease_ttl)
        self._renewed = self._sent = sent

    def _member_value(self) -> bytes:
        value: dict[str, Any] = {
            "address": self.config.address,
            "role": self.role.value,
            "lsn": self._last_lsn(),
            "term": self.term,
            "shards": self.config.shard.count,
            "instance": self.config.instance,
        }
        if self.role is Role.PRIMARY:
            value["standbys"] = self._standbys()
        return _dumps(value)

    def _register(self) -> None:
        """Write this member's key: while it is on this process's lease, or absent
        (the lease was replaced); another process holding it is fatal."""
        self._registered = self._clock()
        key = self.keys.member(self.config.member_id)
        put = [put_op(key, self._member_value(), self._lease)]
        if self.etcd.txn([lease_is(key, self._lease)], put):
            return
        if self.etcd.txn([absent(key)], put):
            return
        kv = self.etcd.get(key)
        holder = "another process" if kv is None else self._holder(kv)
        self._stop.set()
        with self._lock:
            self.role = Role.STOPPED
        self._on_deposed(
            f"member id {self.config.member_id} was taken by {holder} (a second "
            "server started with this --member-id)"
        )

    def _claim(self) -> None:
        """Create this member's key on this process's lease: at once when absent or
        held by this data dir's earlier process (it is gone: this one holds the
        data dir's lock); else once the holder's lease expired, within its TTL
        (a process killed moments ago), or refuse (``MemberIdInUse``)."""
        key = self.keys.member(self.config.member_id)
        waited_for: tuple[int, float] | None = None  # (lease, until when)
        while True:
            self._registered = self._clock()
            put = [put_op(key, self._member_value(), self._lease)]
            if self.etcd.txn([absent(key)], put):
                return
            kv = self.etcd.get(key)
            if kv is None:
                continue
            if self._own_earlier(kv) or not kv.lease:
                if self.etcd.txn([mod_revision_is(key, kv.mod_revision)], put):
                    return
                continue
            if waited_for is None or waited_for[0] != kv.lease:
                left, granted = self.etcd.time_to_live(kv.lease)
                until = self._clock() + max(left, granted, 1) + 1.0
                waited_for = (kv.lease, until)
                log.warning(
                    "member id %s is held by %s: waiting up to %.0f s for its "
                    "lease to expire",
                    self.config.member_id, self._holder(kv),
                    until - self._clock(),
                )  # fmt: skip
            elif self._clock() >= waited_for[1]:
                raise MemberIdInUse(
                    f"member id {self.config.member_id} of shard {self.config.shard} "
                    f"under {self.config.coordinator} is held by {self._holder(kv)}, "
                    "which still renews its lease: stop that server, or start this "
                    "one with another --member-id (ONNXPS_MEMBER_ID)"
                )
            time.sleep(0.2)
            self._keep_lease()  # the renewing thread starts once the key is ours

    def _keep_lease(self) -> None:
        """Renew this process's lease once (a new one when it expired)."""
        sent = self._clock()
        if self.etcd.keepalive(self._lease) > 0:
            self._renewed = self._sent = sent
        else:
            self._new_lease()

    def _own_earlier(self, kv: KeyValue) -> bool:
        try:
            instance = kv.json().get("instance")
        except (ValueError, AttributeError):
            return False
        return bool(self.config.instance) and instance == self.config.instance

    @staticmethod
    def _holder(kv: KeyValue) -> str:
        try:
            address = kv.json().get("address", "?")
        except (ValueError, AttributeError):
            address = "?"
        return f"the process at {address} (etcd lease {kv.lease:x})"

    def _check_layout(self) -> None:
        count = str(self.config.shard.count)
        self.etcd.txn([absent(self.keys.layout)], [put_op(self.keys.layout, count)])
        kv = self.etcd.get(self.keys.layout)
        if kv is None or kv.value.decode() == count:
            return
        layout = int(kv.value.decode())
        if self.config.shard.index >= layout:
            log.info(
                "shard %d of a cluster of %d shards (%s): it owns nothing until a "
                "resharding moves groups here (onnxps reshard, docs/resharding.md)",
                self.config.shard.index, layout, self.keys.layout,
            )  # fmt: skip
            return
        # A larger count: the cluster grows (a resharding follows); after one, the
        # count a server was started with is history (the placement map rules).
        grows = self.config.shard.count > layout
        if not grows and self.etcd.get(f"{self.keys.prefix}/placement") is None:
            raise ConfigError(
                f"--shard {self.config.shard}: the cluster under "
                f"{self.config.coordinator} has {kv.value.decode()} shards "
                f"({self.keys.layout}); start every server with the same count"
            )
