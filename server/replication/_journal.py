"""The primary's side of log shipping: a journal that acknowledges a record only
once the synchronous standbys hold it, and the ``Replicate`` stream that feeds them.

The store's journal on a replicated shard is a ``ReplicatedJournal`` around the
write-ahead log. ``log`` refuses a change before anything is written when this
server is not the primary that may acknowledge (``NOT_PRIMARY``, with the primary's
address) or when fewer than ``sync_replicas`` synchronous standbys follow it
(``NOT_ENOUGH_REPLICAS``). ``wait`` returns once the record is durable here and on
every synchronous standby. A synchronous standby that acknowledges nothing for
``ack_timeout`` (a partition) loses its stream: the changes after it are refused
while the waiting ones wait for it (or for a caught-up standby named in its place)
one more ``ack_timeout``, or until their caller leaves; then they end
unacknowledged (applied here: the log holds them; see ``_give_up``).
A record durable here that cannot be acknowledged because the lease was lost leaves
this server's memory behind its own log: it calls ``on_stuck`` (the server steps
down and exits; restarted, it replays its log and follows the new primary).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb

from ..durability import Durability
from ..durability._snapshot import SnapshotError, list_snapshots, read_manifest
from ..durability._walread import LogCursor, logged_term
from ..errors import (
    FailedPrecondition,
    Unavailable,
)
from ..store._waits import CURRENT_CALL, CallCancelled, CallLink
from ._frames import (
    BATCH_OVERHEAD,
    BATCHES,
    PIECE,
    PROTOCOL,
    UNREADABLE,
    WHOLE,
    KeptFrame,
    batch,
    pieces,
)
from ._hello import MEMBER_ID, MEMBER_ID_RULE, HelloCheck
from ._member import Member, Role

__all__ = ["MEMBER_ID", "MEMBER_ID_RULE", "NotPrimary", "ReplicatedJournal"]

log = logging.getLogger("onnxps.replication")

Array = np.ndarray[Any, Any]
SNAPSHOT_CHUNK = 1 << 20


class NotPrimary(FailedPrecondition, Unavailable):
    """A write sent to a server that is not its shard's primary.

    Answered FAILED_PRECONDITION (the status table tries that class first); an
    ``Unavailable`` too, so that the store's own background changes (the lease
    reaper's sync steps) on a standby are skipped like a log that cannot be
    written, not fatal to the reaper thread.
    """

    default_reason = "NOT_PRIMARY"


@dataclass
class _Record:
    term: int
    frame: KeptFrame
    failed: bool = False
    durable: bool = False


@dataclass
class _Standby:
    member_id: str
    address: str
    # its data dir's id (the member key's "instance" when its hello was checked):
    # acknowledgements count for the data dir that holds them, not for a member id
    instance: str = ""
    acked: int = 0
    syncing: bool = True
    floor: int = 0  # records after this are kept for it
    gone: bool = False
    cancel: Callable[[], Any] | None = None  # ends its stream
    piece: int = PIECE  # frame bytes per message: WHOLE for a protocol 0 standby
    batches: bool = False  # takes several whole records in a message (protocol 2)
    # The last record handed to its stream whole (or the snapshot's, or the one
    # its hello resumed after): it cannot acknowledge beyond it.
    shipped: int = 0


class ReplicatedJournal:
    """The store's journal on a replicated shard (see the module's doc)."""

    def __init__(
        self,
        durability: Durability,
        member: Member,
        *,
        sync_replicas: int,
        lower: bool = False,
        ack_timeout: float,
        on_stuck: Callable[[str], None],
    ) -> None:
        self.durability = durability
        self.member = member
        self.sync_replicas = sync_replicas
        # --sync-policy lower: with fewer standbys following, acknowledge with those
        self.lower = lower
        self.ack_timeout = ack_timeout
        self._on_stuck = on_stuck
        # One lock, two conditions: the pushes waiting for acks (``_cv``) and the
        # streams waiting for records to ship (``_new``) do not wake each other.
        lock = threading.RLock()
        self._cv = threading.Condition(lock)
        self._new = threading.Condition(lock)
        self._records: dict[int, _Record] = {}
        self._standbys: dict[str, _Standby] = {}
        self._sync: list[str] = []  # named in etcd, in this order
        # the data dir (instance) each was named with: a member id on another
        # data dir holds none of what the named one acknowledged
        self._sync_instances: dict[str, str] = {}
        # A standby being named (in etcd, outside the lock every push takes): the
        # pushes acknowledged meanwhile wait for it too, so it holds all of them.
        self._joining: str | None = None
        # Changes of the synchronous standbys, one at a time
        self._naming = threading.Lock()
        self.acknowledged = 0
        self._hellos = HelloCheck(member)

    def promoted(self, last_lsn: int) -> None:
        """This server took the lead holding records up to ``last_lsn``, any of
        which an earlier term may have acknowledged: a standby is named synchronous
        only once it holds all of them (else its promotion could lose them)."""
        with self._cv:
            self.acknowledged = max(self.acknowledged, last_lsn)

    @property
    def inner(self) -> Any:
        journal = self.durability.journal
        if journal is None:
            raise Unavailable("the write-ahead log is closed (a standby catching up)")
        return journal

    # -- the Journal protocol -------------------------------------------------------
    def log(self, record: dict[str, Any], arrays: Sequence[Array]) -> int:
        self._check_primary()
        with self._cv:
            live = self._live_sync()
            if len(live) < self.sync_replicas and not self.lower:
                raise Unavailable(
                    f"{len(live)} of the {self.sync_replicas} synchronous standbys "
                    "this shard needs (--sync-replicas) follow its primary: the change "
                    "is refused and nothing was applied; retry once a standby caught "
                    "up",
                    reason="NOT_ENOUGH_REPLICAS",
                    metadata={
                        "sync_replicas": self.sync_replicas,
                        "in_sync": len(live),
                    },
                )
            # The term in each record: a standby resuming from its last record
            # must hold the one of this log (a deposed primary's may differ).
            term = self.member.term
            lsn, frame = self.inner.log_frame({**record, "term": term}, arrays)
            lsn = int(lsn)
            # Shipped by the streams while this server writes it: the standbys'
            # fsync runs beside this one's, not after it.
            self._records[lsn] = _Record(term, KeptFrame(term, lsn, frame))
            self._new.notify_all()
        return lsn

    def wait(self, lsn: int) -> None:
        try:
            self._wait(lsn)
        finally:
            # The caller gives the record's arrays back (a pooled gradient) once
            # this returns: a stream that did not copy all its pieces yet reads
            # the rest from the log.
            with self._cv:
                entry = self._records.get(lsn)
            if entry is not None:
                entry.frame.release()

    def _wait(self, lsn: int) -> None:
        try:
            self.inner.wait(lsn)
        except BaseException:
            with self._cv:
                entry = self._records.get(lsn)
                if entry is not None:
                    entry.failed = True
                shipped = any(not s.gone for s in self._standbys.values())
                self._wake_all()
            if shipped:
                # A standby may hold what this server refuses: step down.
                self._on_stuck(f"record {lsn} was shipped but not written here")
            raise
        with self._cv:
            entry = self._records.get(lsn)
            if entry is not None:
                entry.durable = True
        self._await_standbys(lsn)

    def _await_standbys(self, lsn: int) -> None:
        """Until the synchronous standbys hold ``lsn``, as long as this server may
        acknowledge. One silent for ``ack_timeout`` (a partition) loses its stream:
        the next changes are refused (or, another standby caught up, named in its
        place), and this one waits for it to be back or replaced, one more
        ``ack_timeout`` at most. It ends at once when its caller left (the call's
        ``CallLink``); ending unacknowledged, it returns (the caller applies the
        change: this log holds it) and the link says why."""
        call = CURRENT_CALL.get()
        deadline = time.monotonic() + self.ack_timeout
        ended = False  # the silent standbys' streams were ended
        with self._cv:
            # A renewal late (under load) but the lease maybe still held: nothing
            # is acknowledged meanwhile, and the push waits for the renewal.
            while self.member.may_hold_lease():
                if self.member.may_acknowledge():
                    if self._held(lsn):
                        self.acknowledged = max(self.acknowledged, lsn)
                        self._trim()
                        return
                    if time.monotonic() >= deadline:
                        if ended:
                            self._give_up(lsn, call)
                            return
                        self._end_silent(lsn)
                        ended = True
                        deadline = time.monotonic() + self.ack_timeout
                if call is not None and call.gone():
                    call.unacknowledged = CallCancelled(
                        f"the caller went away before record {lsn} was acknowledged"
                    )
                    return
                self._cv.wait(0.05)
        why = "this server lost its primary lease before the standbys held it"
        log.error("record %d is durable here but not acknowledged: %s", lsn, why)
        self._on_stuck(f"record {lsn} could not be acknowledged: {why}")
        raise Unavailable(
            f"the change was not acknowledged: {why}; retry (the shard elects a "
            "primary holding every acknowledged push)",
            reason="NOT_REPLICATED",
        )

    def _give_up(self, lsn: int, call: CallLink | None) -> None:
        """Under the lock: ``lsn`` was not acknowledged within twice ``ack_timeout``
        (its standbys' streams ended after the first). The wait ends, the change is
        applied here (this log holds it: memory must be its replay) and ships when
        a standby follows again; its caller is told it was not acknowledged."""
        wait = 2 * self.ack_timeout
        log.warning(
            "record %d: no synchronous standby acknowledged it within %g s; its "
            "change is applied here, unacknowledged (it ships once a standby "
            "follows again)",
            lsn, wait,
        )  # fmt: skip
        if call is not None:
            call.unacknowledged = Unavailable(
                f"the change is durable on the primary but no synchronous standby "
                f"acknowledged it within {wait:g} s (2 x the ack timeout): it is not "
                "acknowledged, and may land once a standby follows again or be lost "
                "in a failover; resend it with the same (client_id, seq): a resend "
                "is answered once the standbys hold it, never applied twice",
                reason="NOT_ACKNOWLEDGED",
                metadata={"lsn": lsn, "waited_seconds": f"{wait:g}"},
            )

    def settle(self) -> None:
        """Until every record logged so far is acknowledged (as ``wait``): a resend
        is answered from a group's exactly-once window only once the push it
        resends is, which may have been applied unacknowledged (``_give_up``, or
        its caller left)."""
        with self._cv:
            last = max(self._records, default=0)
            if last <= self.acknowledged:
                return
        self._await_standbys(last)

    def _end_silent(self, lsn: int) -> None:
        """Under the lock: end the streams of the synchronous standbys that did not
        acknowledge ``lsn`` within ``ack_timeout`` (they follow again once they can)."""
        for member_id in self._sync:
            s = self._standbys.get(member_id)
            if s is None or s.gone or s.acked >= lsn:
                continue
            log.warning(
                "standby %s did not acknowledge record %d within %g s: ending its "
                "stream (changes wait for a synchronous standby)",
                member_id, lsn, self.ack_timeout,
            )  # fmt: skip
            s.gone = True
            if s.cancel is not None:
                s.cancel()
        self._wake_all()

    def _wake_all(self) -> None:
        """Under the lock: wake the pushes waiting and the streams shipping (a
        standby gone, a record failed)."""
        self._cv.notify_all()
        self._new.notify_all()

    def _held(self, lsn: int) -> bool:
        if len(self._sync) < self.sync_replicas and not self.lower:
            return False
        holders = [*self._sync, *([self._joining] if self._joining else [])]
        return all(
            (s := self._standbys.get(m)) is not None and s.acked >= lsn for m in holders
        )

    def _live_sync(self) -> list[str]:
        """Under the lock: the synchronous standbys still following."""
        return [m for m in self._sync if not self._standbys_gone(m)]

    def _standbys_gone(self, member_id: str) -> bool:
        s = self._standbys.get(member_id)
        return s is None or s.gone

    def check_writable(self) -> None:
        """Refuse (NOT_PRIMARY) unless this server is the primary that may
        acknowledge: asked before a resend is answered from a group's window."""
        self._check_primary()

    def _check_primary(self) -> None:
        if self.member.may_acknowledge():
            return
        primary = self.member.primary
        address = (
            ""
            if primary is None or primary.member == self.member.config.member_id
            else primary.address
        )
        where = (
            f"the primary is {address}; send writes there"
            if address
            else "no primary is known (an election, or etcd unreachable); retry"
        )
        raise NotPrimary(
            f"this server is not the primary of shard {self.member.config.shard} "
            f"that may acknowledge: {where} (a Client('etcd://...') follows it)",
            metadata={"primary": address, "term": self.member.term},
        )

    def _trim(self) -> None:
        """Drop records every follower holds (and no follower being synced needs)."""
        keep_after = self.acknowledged
        for s in self._standbys.values():
            if not s.gone:
                keep_after = min(keep_after, s.floor if s.syncing else s.acked)
        # Kept in lsn order (``log`` adds them under this lock): the oldest first, so
        # a push costs the records it drops, not every record a standby behind
        # keeps (10,000 of them scanned per push made its catch-up quadratic).
        records = self._records
        while records:
            oldest = next(iter(records))
            if oldest > keep_after:
                break
            del records[oldest]

    # -- the Replicate stream -------------------------------------------------------
    def replicate(
        self, requests: Iterable[pb.ReplicateRequest], context: Any
    ) -> Iterator[pb.ReplicateResponse | bytes]:
        it = iter(requests)
        first = next(it, None)
        if first is None or first.WhichOneof("part") != "hello":
            raise FailedPrecondition("a Replicate stream starts with a hello")
        hello = first.hello
        self._check_primary()
        instance = self._hellos.check(hello)
        term = self.member.term
        if hello.term > term:
            raise NotPrimary(
                f"the standby knows term {hello.term}, this primary's is {term}",
                metadata={"term": term},
            )
        standby = _Standby(
            hello.member_id, hello.address, instance, cancel=context.cancel
        )
        cursor = LogCursor(self.durability.wal_dir)
        standby.batches = min(hello.protocol, PROTOCOL) >= BATCHES
        if min(hello.protocol, PROTOCOL) < 1:
            standby.piece = WHOLE
            log.warning(
                "standby %s (%s) speaks log shipping protocol %d (an earlier onnxps; "
                "this one speaks %d): its records go whole, one message each; "
                "upgrade it",
                hello.member_id, hello.address, hello.protocol, PROTOCOL,
            )  # fmt: skip
        with self._cv:
            # Records up to the floor are durable here: they are read from the log
            # on disk; those after it are kept in memory for this standby.
            standby.floor = self._durable_floor()
            self._unname_other_instance(standby)
            old = self._standbys.get(hello.member_id)
            if old is not None:  # the same member (its lease), following again
                old.gone = True
                if old.cancel is not None:
                    old.cancel()
            self._standbys[hello.member_id] = standby
        acks = threading.Thread(
            target=self._read_acks, args=(it, standby), daemon=True,
            name="onnxps-acks",
        )  # fmt: skip
        try:
            if self._resumable(hello, standby.floor):
                log.info(
                    "standby %s (%s) resumes after record %d (term %d): this log "
                    "holds it in that term, no snapshot",
                    hello.member_id, hello.address, hello.last_lsn, hello.last_term,
                )  # fmt: skip
                after = hello.last_lsn
                with self._cv:  # the hello vouches for it: the standby's first ack
                    standby.acked, standby.syncing = after, False
                    standby.shipped = after
            else:
                after = yield from self._snapshot(hello, term, standby)
            acks.start()
            try:
                yield from self._logged(after, standby, term, cursor)
            except UNREADABLE as exc:
                # never skipped: the standby gets a snapshot that holds the record
                after = yield from self._snapshot(hello, term, standby, exc)
                yield from self._logged(after, standby, term, cursor)
            yield from self._records_after(
                standby.floor, standby, context, term, cursor
            )
        finally:
            cursor.close()
            with self._cv:
                standby.gone = True
                self._forget(standby)
                self._cv.notify_all()
            log.info("standby %s stopped following", hello.member_id)

    def _unname_other_instance(self, standby: _Standby) -> None:
        """Under the lock: a synchronous standby's member id following from another
        data dir (its disk replaced, a new process on an empty one) holds none of
        what the named one acknowledged: it is no longer counted as synchronous,
        and is named again (with its own data dir, in etcd first) once it holds
        every acknowledged push. etcd still names the old data dir meanwhile,
        which no process has: no other member may take the lead with less."""
        member_id = standby.member_id
        named = self._sync_instances.get(member_id, "")
        if member_id not in self._sync or not named or named == standby.instance:
            return
        log.warning(
            "standby %s follows from another data dir (instance %s; it was named "
            "synchronous with instance %s): it is not synchronous until it holds "
            "every acknowledged push",
            member_id, standby.instance or "unknown", named,
        )  # fmt: skip
        self._sync = [m for m in self._sync if m != member_id]
        self._sync_instances.pop(member_id, None)
        self._wake_all()

    def _forget(self, standby: _Standby) -> None:
        """Under the lock: a follower whose stream ended is forgotten unless the
        pushes may still count on its acknowledgements (a synchronous standby,
        or one being named)."""
        member_id = standby.member_id
        if (
            self._standbys.get(member_id) is standby
            and member_id not in self._sync
            and member_id != self._joining
        ):
            del self._standbys[member_id]

    def _shipped(
        self, standby: _Standby, lsn: int, messages: Iterable[Any]
    ) -> Iterator[Any]:
        """``messages`` (record ``lsn``'s, or a snapshot's end), the standby
        marked as holding up to ``lsn`` before the last goes out: it may not
        acknowledge what it was not sent."""
        last = _NOTHING
        for message in messages:
            if last is not _NOTHING:
                yield last
            last = message
        with self._cv:
            standby.shipped = max(standby.shipped, lsn)
        if last is not _NOTHING:
            yield last

    def _resumable(self, hello: pb.ReplicateHello, floor: int) -> bool:
        """Whether the standby's log is a prefix of this one: its last record is
        durable here and was written in the same term (a standby holding records
        of a deposed primary that this log lacks or holds otherwise must take a
        snapshot: PostgreSQL's timelines, Kafka's leader epochs)."""
        if not 0 < hello.last_lsn <= floor or hello.last_term == 0:
            return False
        wal_dir = self.durability.wal_dir
        return logged_term(wal_dir, hello.last_lsn) == hello.last_term

    def _logged(
        self, after: int, standby: _Standby, term: int, cursor: LogCursor
    ) -> Iterator[bytes]:
        """Records ``after``+1 to the standby's floor as shipped, read from the log
        on disk in one pass (durable, maybe no longer kept in memory), several in
        a message to a standby that takes batches; one that cannot be read raises
        (``UNREADABLE``): it is never skipped."""
        cursor.seek(after)
        run: list[tuple[int, list[bytes]]] = []
        size = 0
        for header, chunks in cursor.frames(standby.floor):
            lsn = int(header["lsn"])
            nbytes = sum(len(c) for c in chunks) + BATCH_OVERHEAD
            if run and (size + nbytes > PIECE or nbytes > PIECE):
                yield from self._send_run(standby, term, run)
                run, size = [], 0
            if standby.batches and nbytes <= PIECE:
                run.append((lsn, chunks))
                size += nbytes
                continue
            messages = pieces(term, lsn, chunks, 0, standby.piece)
            yield from self._shipped(standby, lsn, messages)
        if run:
            yield from self._send_run(standby, term, run)

    def _send_run(
        self, standby: _Standby, term: int, run: Sequence[tuple[int, Sequence[Any]]]
    ) -> Iterator[bytes]:
        """Records ``run`` (lsn, frame in chunks), consecutive and each at most a
        piece: one message (a batch; a record alone goes as it always did)."""
        last, chunks = run[-1]
        if len(run) == 1:
            messages: Iterable[bytes] = pieces(term, last, chunks, 0, standby.piece)
        else:
            messages = [batch(term, run)]
        yield from self._shipped(standby, last, messages)

    def _snapshot(
        self,
        hello: pb.ReplicateHello,
        term: int,
        standby: _Standby,
        unreadable: BaseException | None = None,
    ) -> Generator[pb.ReplicateResponse, None, int]:
        """Send the newest snapshot on disk (written already: no store lock, so no
        wait on pushes that wait for a standby); returns its wal lsn. After a
        record the log cannot give back (``unreadable``), one written after it."""
        if unreadable is None:
            path, wal_lsn = self._base_snapshot()
        else:
            path, wal_lsn = self._snapshot_after(hello, unreadable)
        log.info(
            "standby %s (%s, last record %d of term %d): sending snapshot %s "
            "(wal lsn %d), then the log",
            hello.member_id, hello.address, hello.last_lsn, hello.last_term, path,
            wal_lsn,
        )  # fmt: skip
        yield from _snapshot_messages(path, term)
        done = pb.ReplicateResponse(
            term=term,
            snapshot_done=pb.ReplicaSnapshotDone(
                wal_lsn=wal_lsn,
                generation=int(os.path.basename(path).split("-")[1]),
            ),
        )
        yield from self._shipped(standby, wal_lsn, [done])
        return wal_lsn

    def _durable_floor(self) -> int:
        """Under the lock: every record up to this lsn is durable in the log."""
        pending = [
            lsn for lsn, e in self._records.items() if not e.durable and not e.failed
        ]
        return min(pending) - 1 if pending else int(self.inner.last_lsn())

    def _snapshot_after(
        self, hello: pb.ReplicateHello, unreadable: BaseException
    ) -> tuple[str, int]:
        """A snapshot written after every record this log holds now, for a standby
        that needs one the log cannot give back. Not for a synchronous standby:
        the pushes waiting for it would hold up the snapshot (its stream ends)."""
        with self._cv:
            synchronous = hello.member_id in (*self._sync, self._joining)
        log.warning(
            "standby %s (%s): %s; sending a snapshot instead%s",
            hello.member_id, hello.address, unreadable,
            "" if not synchronous else " (not to a synchronous standby: it follows "
            "again)",
        )  # fmt: skip
        if synchronous:
            raise Unavailable(
                f"the log cannot give back a record this standby needs: {unreadable}",
                reason="NOT_REPLICATED",
            )
        saved = self.durability.snapshot(force=True)
        assert saved is not None
        return saved.path, read_manifest(saved.path).wal_lsn

    def _base_snapshot(self) -> tuple[str, int]:
        """The newest intact snapshot on disk (one is written when there is none)."""
        for _, path in list_snapshots(self.durability.snap_dir):
            try:
                return path, read_manifest(path).wal_lsn
            except SnapshotError:
                continue
        saved = self.durability.snapshot(force=True)
        assert saved is not None
        return saved.path, read_manifest(saved.path).wal_lsn

    def _records_after(
        self,
        lsn: int,
        standby: _Standby,
        context: Any,
        term: int,
        cursor: LogCursor,
    ) -> Iterator[bytes]:
        nxt = lsn + 1
        while context.is_active() and not standby.gone:
            with self._cv:
                entry = self._records.get(nxt)
                if entry is None and nxt <= self._last_known():
                    nxt += 1  # a record that was not kept: one nobody waits for
                    continue
                if entry is None:
                    self._new.wait(0.05)
                    if self.member.term != term or self.member.role is not Role.PRIMARY:
                        return  # deposed, or a newer term: the standby follows it
                    continue
                run = self._ready(nxt, term) if standby.batches else []
            if len(run) > 1:  # a standby behind: several records in a message
                yield from self._send_run(
                    standby, term, [(k, self._whole(k, e, cursor)) for k, e in run]
                )
                nxt = run[-1][0] + 1
                continue
            if not entry.failed:
                if entry.term != term:
                    return  # logged in a newer term: the standby follows that
                messages = self._ship(entry.frame, nxt, term, standby.piece, cursor)
                yield from self._shipped(standby, nxt, messages)
            nxt += 1

    def _ready(self, lsn: int, term: int) -> list[tuple[int, KeptFrame]]:
        """Under the lock: the records kept from ``lsn`` on that one message may
        carry (consecutive, logged in ``term`` and not failed, a piece in all)."""
        run: list[tuple[int, KeptFrame]] = []
        size = 0
        while (entry := self._records.get(lsn)) is not None:
            nbytes = entry.frame.nbytes + BATCH_OVERHEAD
            if entry.failed or entry.term != term or size + nbytes > PIECE:
                break
            run.append((lsn, entry.frame))
            size += nbytes
            lsn += 1
        return run

    def _whole(self, lsn: int, record: KeptFrame, cursor: LogCursor) -> list[bytes]:
        """Record ``lsn``'s frame: copied from its arrays while the push that
        logged it waits, else read from the log (on the stream's cursor)."""
        got = record.whole()
        return self._from_log(lsn, cursor) if got is None else got

    def _ship(
        self, record: KeptFrame, lsn: int, term: int, size: int, cursor: LogCursor
    ) -> Iterator[bytes]:
        """Record ``lsn``'s pieces: copied from its arrays while the push that
        logged it waits, the rest from the log once it was released (read on the
        stream's cursor: a standby behind reads the log in one pass)."""
        offset: int | None = 0
        while offset is not None:
            got = record.piece(offset, size)
            if got is None:
                chunks = self._from_log(lsn, cursor)
                yield from pieces(term, lsn, chunks, offset, size)
                return
            message, offset = got
            yield message

    def _from_log(self, lsn: int, cursor: LogCursor) -> list[bytes]:
        """Record ``lsn``'s frame (durable) in chunks, read from the log on disk."""
        try:
            cursor.seek(lsn - 1)
            for _, chunks in cursor.frames(lsn):
                return chunks
        except UNREADABLE as exc:
            cursor.close()
            why = str(exc)
        else:
            why = "a record voided when written"
        raise Unavailable(
            f"record {lsn} cannot be read from the log {self.durability.wal_dir} "
            f"({why}): follow again",
            reason="NOT_REPLICATED",
        )

    def _last_known(self) -> int:
        """Below the oldest record kept, every record was trimmed (all hold it)."""
        if self._records:  # the oldest kept is the first (lsn order)
            return next(iter(self._records)) - 1
        return int(self.inner.last_lsn())

    def _read_acks(self, requests: Iterator[pb.ReplicateRequest], s: _Standby) -> None:
        try:
            if not s.syncing:  # resumed: it may hold every acknowledged push already
                self._maybe_sync(s)
            for req in requests:
                if req.WhichOneof("part") != "ack":
                    continue
                with self._cv:
                    lsn = int(req.ack.lsn)
                    if lsn > s.shipped:
                        self._hellos.refusals.log(
                            s.member_id, "ack",
                            f"standby {s.member_id} acknowledged record {lsn}, but "
                            f"its stream was sent records up to {s.shipped}: "
                            "ending its stream (nothing it acknowledges counts)",
                        )  # fmt: skip
                        break
                    s.acked = max(s.acked, lsn)
                    s.syncing = False
                    self._cv.notify_all()
                self._maybe_sync(s)
        except grpc.RpcError:
            pass
        finally:
            with self._cv:
                s.gone = True
                if s.cancel is not None:
                    s.cancel()
                self._wake_all()
            self._replace_gone()

    def _maybe_sync(self, s: _Standby) -> None:
        """Name a caught-up standby synchronous when a place is free: in etcd
        first (a promotion must find it there), outside the lock pushes take; the
        pushes acknowledged meanwhile wait for it too (``_joining``)."""
        with self._naming:
            with self._cv:
                if s.member_id in self._sync or s.gone:
                    return
                live = self._live_sync()
                if len(live) >= self.sync_replicas or s.acked < self.acknowledged:
                    return
                wanted = [*live, s.member_id]
                instances = {m: self._sync_instances.get(m, "") for m in live}
                instances[s.member_id] = s.instance
                self._joining = s.member_id
            named = False
            try:
                named = self.member.set_sync_standbys(wanted, instances)
            finally:
                with self._cv:
                    self._joining = None
                    if named:
                        self._sync = wanted
                        self._sync_instances = instances
                    self._cv.notify_all()
            if named:
                log.info("synchronous standbys: %s", ", ".join(wanted))

    def _replace_gone(self) -> None:
        if self.lower:
            self._drop_gone()
        with self._cv:
            candidates = [
                s for s in self._standbys.values()
                if not s.gone and not s.syncing and s.member_id not in self._sync
            ]  # fmt: skip
        for s in candidates:
            self._maybe_sync(s)

    def _drop_gone(self) -> None:
        """--sync-policy lower: name only the standbys still following (in etcd
        first: a promotion must not pick one that misses what is acknowledged
        next), then acknowledge with them. Until then the pushes wait for the old
        set, outside the etcd call."""
        with self._naming:
            with self._cv:
                live = self._live_sync()
                if live == self._sync:
                    return
                instances = {m: self._sync_instances.get(m, "") for m in live}
            if not self.member.set_sync_standbys(live, instances):
                return  # not the primary any more: nothing is acknowledged
            with self._cv:
                self._sync = live
                self._sync_instances = instances
                self._cv.notify_all()
            log.warning(
                "%d of the %d synchronous standbys follow: acknowledging with %s "
                "(--sync-policy lower)",
                len(live), self.sync_replicas,
                ", ".join(live) if live else "this server alone",
            )  # fmt: skip

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {
                "sync": list(self._sync),
                "standbys": {
                    k: {"acked": s.acked, "gone": s.gone, "syncing": s.syncing}
                    for k, s in self._standbys.items()
                },
                "acknowledged": self.acknowledged,
            }


_NOTHING: Any = object()


def _snapshot_messages(path: str, term: int) -> Iterator[pb.ReplicateResponse]:
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            offset = 0
            while True:
                data = f.read(SNAPSHOT_CHUNK)
                yield pb.ReplicateResponse(
                    term=term,
                    snapshot_chunk=pb.ReplicaSnapshotChunk(
                        name=name, offset=offset, data=data
                    ),
                )
                offset += len(data)
                if len(data) < SNAPSHOT_CHUNK:
                    break
