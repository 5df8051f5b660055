"""A standby's side of log shipping: follow the primary's ``Replicate`` stream.

The standby connects to the primary etcd names, receives a snapshot (written into a
temporary directory beside its own, then adopted as its whole state), then every
record after it: each is written to its own log with the primary's lsn and, once
fsynced, acknowledged, then applied through the store's replay methods, in order.
The records received while one batch is fsynced make the next batch, fsynced once
and acknowledged by its last lsn (``_Syncer``): a standby catching up does not
fsync every record on its own. Messages of
a term older than the newest this standby has seen are refused (the stream ends).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from onnxps.v1 import parameter_server_pb2 as pb

from ..durability import Durability
from ..errors import DomainError, Unavailable
from ._frames import (
    PROTOCOL,
    Gather,
    ShippedBatch,
    ShippedRecord,
    check_frame,
    decode_response,
    frame_arrays,
)
from ._member import PrimaryInfo

__all__ = ["Follower"]

log = logging.getLogger("onnxps.replication")

_END = object()
REPLICATE = "/onnxps.v1.ParameterServerService/Replicate"


class _Applier:
    """Applies the records a follower received, in order, on its own thread
    behind their acks: a record waits until its ack was sent (``sent``), so that
    applying it does not hold this process's GIL and a core while the ack goes
    out. At most ``limit`` bytes of records wait (the receiver blocks beyond that,
    and the records then go on without waiting for their acks); ``close`` returns
    once every record queued is applied."""

    def __init__(
        self,
        apply: Callable[[dict[str, Any], Any, dict[str, int]], None],
        limit: int = 256 << 20,
    ) -> None:
        self._apply = apply
        self._limit = limit
        self._cv = threading.Condition()
        self._items: collections.deque[Any] = collections.deque()
        self._bytes = 0
        self._sent = 0  # the records up to this lsn may be applied
        self._closed = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="onnxps-apply", daemon=True
        )
        self._thread.start()

    def put(self, header: dict[str, Any], frame: Any, covered: dict[str, int]) -> None:
        self.put_many([(header, frame, covered)])

    def put_many(self, items: list[tuple[dict[str, Any], Any, dict[str, int]]]) -> None:
        """``put`` each of ``items`` (header, frame, covered), in order; the
        applier is woken once."""
        with self._cv:
            for header, frame, covered in items:
                while self._items and self._bytes + len(frame) > self._limit:
                    self._release()  # applied without waiting for their acks
                    self._cv.wait()
                self._raise_failed()
                self._items.append((header, frame, covered))
                self._bytes += len(frame)
            self._cv.notify_all()

    def sent(self, lsn: int) -> None:
        """The ack of record ``lsn`` was sent: it may be applied."""
        with self._cv:
            if lsn > self._sent:
                self._sent = lsn
                self._cv.notify_all()

    def _release(self) -> None:
        """Under the lock: let every record queued be applied."""
        if self._items:
            self._sent = max(self._sent, int(self._items[-1][0]["lsn"]))
            self._cv.notify_all()

    def drain(self) -> None:
        """Return once every record queued is applied."""
        with self._cv:
            self._release()
            while self._items:
                self._cv.wait()
            self._raise_failed()

    def close(self) -> bool:
        """Return once every record queued is applied: False if one failed."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        return self._failed is None

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError("applying a record failed") from self._failed

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (
                    not self._items or int(self._items[0][0]["lsn"]) > self._sent
                ):
                    self._cv.wait()
                if not self._items:
                    return
                ready = self._ready()
            for item in ready:  # (taken under one lock: a standby behind has many)
                try:
                    if self._failed is None:
                        self._apply(*item)
                except BaseException as exc:  # the receiver raises it, and stops
                    log.exception("applying record %s failed", item[0].get("lsn"))
                    self._failed = exc
            with self._cv:
                for item in ready:
                    self._items.popleft()
                    self._bytes -= len(item[1])
                self._cv.notify_all()

    def _ready(self, most: int = 256) -> list[Any]:
        """Under the lock: the first records queued that may be applied now
        (their acks sent, or the applier closing), ``most`` at most."""
        ready: list[Any] = []
        for item in self._items:
            if len(ready) >= most or (
                not self._closed and int(item[0]["lsn"]) > self._sent
            ):
                break
            ready.append(item)
        return ready


# a record appended: (the log, its lsn, header, frame, covered lsns per group)
_Received = tuple[Any, int, dict[str, Any], ShippedRecord, dict[str, int]]


class _Syncer:
    """Makes the records a follower appended to its log durable, in batches, on
    its own thread: every record appended while a batch is fsynced goes in the
    next one (the log's group commit). A batch durable, ``durable(lsn, term)`` is
    told its last record (the follower acknowledges it), then its records go to
    the applier. At most ``limit`` bytes of records wait (``put`` blocks beyond);
    ``drain`` returns once every record put is durable and handed on."""

    def __init__(
        self,
        durable: Callable[[int, int], None],
        applier: _Applier,
        limit: int = 256 << 20,
        on_failed: Callable[[], Any] = lambda: None,
    ) -> None:
        self._durable = durable
        # A batch failed: end the stream now (the receiver would learn it only
        # from the next record, which may not come while pushes wait on this one)
        self._on_failed = on_failed
        self._applier = applier
        self._limit = limit
        self._cv = threading.Condition()
        self._items: list[_Received] = []
        self._bytes = 0
        self._busy = False
        self._closed = False
        self._failed: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="onnxps-standby-fsync", daemon=True
        )
        self._thread.start()

    def put(self, records: list[_Received]) -> None:
        """``records`` (the log, lsn, header, frame, covered) were appended to
        the log, in order: make them durable (raises once a batch failed: the
        syncer makes nothing durable after it)."""
        with self._cv:
            for item in records:
                while (
                    self._items
                    and self._bytes + len(item[3]) > self._limit
                    and self._failed is None
                ):
                    self._cv.notify_all()
                    self._cv.wait()
                self._raise_failed()
                self._items.append(item)
                self._bytes += len(item[3])
            self._cv.notify_all()

    def drain(self) -> None:
        with self._cv:
            while (self._items or self._busy) and self._failed is None:
                self._cv.wait()
            self._raise_failed()

    def close(self) -> None:
        """``drain``, then stop the thread (raises what failed, if anything)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError("a record received was not made durable") from (
                self._failed
            )

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                if not self._items or self._failed is not None:
                    return
                batch, self._items, self._busy = self._items, [], True
            try:
                self._sync(batch)
            except DomainError as exc:  # the log refused them (a full disk)
                log.error("making records %d to %d durable failed: %s",
                          batch[0][1], batch[-1][1], exc)  # fmt: skip
                self._failed = exc
                self._on_failed()
            except BaseException as exc:  # the receiver raises it, and stops
                log.exception("making records %d to %d durable failed",
                              batch[0][1], batch[-1][1])  # fmt: skip
                self._failed = exc
                self._on_failed()
            with self._cv:
                self._busy = False
                self._bytes -= sum(len(item[3]) for item in batch)
                self._cv.notify_all()

    def _sync(self, batch: list[_Received]) -> None:
        journal, lsn, header = batch[-1][:3]
        journal.wait(lsn)  # the log writes and fsyncs every record before it too
        self._durable(lsn, int(header.get("term", 0)))
        self._applier.put_many([(item[2], item[3], item[4]) for item in batch])


def _shipped(msg: pb.ReplicateResponse) -> Any:
    """A parsed message carrying records as ``decode_response`` gives them."""
    part = msg.WhichOneof("part")
    if part == "record":
        return ShippedRecord(msg.term, msg.record.lsn, memoryview(msg.record.frame))
    if part == "records":
        return ShippedBatch(
            msg.term,
            tuple(
                ShippedRecord(msg.term, r.lsn, memoryview(r.frame))
                for r in msg.records.records
            ),
        )
    return msg


def _whole(gather: Gather, msg: ShippedRecord | ShippedBatch) -> list[ShippedRecord]:
    """The records ``msg`` completes: a piece's record once whole, a batch's
    records (each whole: ValueError when one is not, or pieces are missing)."""
    if isinstance(msg, ShippedRecord):
        rec = gather.add(msg)  # a record comes in pieces
        return [] if rec is None else [rec]
    for rec in msg.records:
        if gather.add(rec) is not rec:
            raise ValueError(
                f"record {rec.lsn} of a batch is not whole, or came between the "
                "pieces of another"
            )
    return list(msg.records)


class Follower:
    """Follows one primary at a time, on its own thread."""

    def __init__(
        self,
        durability: Durability,
        *,
        member_id: str,
        address: str,
        term: Callable[[], int],
        max_message_bytes: int,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        lease: Callable[[], int] = lambda: 0,
        on_fatal: Callable[[str], None] = lambda why: None,
    ) -> None:
        self.durability = durability
        self.member_id = member_id
        self._lease = lease  # of this member's key in etcd: its proof of identity
        self._on_fatal = on_fatal  # this process cannot go on: exit (restarted)
        self.address = address
        self._term = term
        self._max_message = max_message_bytes
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._credentials = credentials  # None: plaintext
        self._lock = threading.Lock()
        self._target: PrimaryInfo | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._call: Any = None
        self._thread: threading.Thread | None = None
        # The last record durable in this server's log and its term, sent in the
        # hello to resume from there ((0, 0): this state needs a snapshot)
        journal = durability.journal
        self.durable = 0 if journal is None else int(journal.last_lsn())
        self.durable_term = 0 if durability.adopting else durability.last_term
        self.applied = 0  # the last lsn applied (durable first: acks do not wait)
        # Held while a record is applied (and ``applied`` moved): a snapshot holds
        # it to capture memory as of ``applied`` exactly (``held``).
        self._apply_lock = threading.Lock()
        self.idle = threading.Event()
        self.idle.set()
        self._warned: PrimaryInfo | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="onnxps-follower", daemon=True
        )
        self._thread.start()

    def follow(self, primary: PrimaryInfo | None) -> None:
        """Follow ``primary`` from now on (None, or this server: follow nobody)."""
        with self._lock:
            if primary is not None and primary.member == self.member_id:
                primary = None
            if primary == self._target:
                return
            self._target = primary
            call = self._call
        if call is not None:
            call.cancel()
        self._wake.set()

    @property
    def following(self) -> PrimaryInfo | None:
        """The primary this follower's stream is open to (None: none now)."""
        with self._lock:
            return self._target if self._call is not None else None

    def stop(self) -> None:
        """Stop following and return once nothing is being applied."""
        self._stop.set()
        self.follow(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                target = self._target
            if target is None:
                self._wake.wait(0.2)
                self._wake.clear()
                continue
            self.idle.clear()
            try:
                self._follow(target)
            except grpc.RpcError as exc:
                if self._log_failed(target):
                    pass  # this server's log refused a record (its stream ended)
                elif exc.code() != grpc.StatusCode.CANCELLED:
                    # once per primary at WARNING: it retries every 0.2 s until
                    # etcd names another primary
                    level = logging.DEBUG if target == self._warned else logging.WARNING
                    self._warned = target
                    log.log(
                        level, "following %s: %s: %s",
                        target.address, exc.code().name, exc.details(),
                    )  # fmt: skip
            except Exception:
                if not self._log_failed(target):
                    log.exception("following %s failed", target.address)
            finally:
                self.idle.set()
            self._wake.wait(0.2)
            self._wake.clear()

    def _log_failed(self, target: PrimaryInfo) -> bool:
        """After following failed: when this server's log refused a record (a full
        disk), forget the records it refused (the primary sends them again), then
        follow again only once the disk takes writes; meanwhile the primary counts
        this standby out and refuses changes at once. True when that was the
        failure (logged here, without a traceback)."""
        journal = self.durability.journal
        alarm = None if journal is None else journal.alarm()
        if journal is None or alarm is None:
            return False
        try:
            last = int(journal.forget_refused())
        except DomainError as exc:
            self._on_fatal(f"this standby's write-ahead log stopped: {exc}")
            return True
        if last != self.durable:
            # Records durable here but neither acknowledged nor applied: the
            # restart's replay applies them as the log holds them.
            self._on_fatal(
                f"records {self.durable + 1} to {last} are durable in this "
                "standby's log but were not applied when a later write failed"
            )
            return True
        log.error(
            "following %s: this server's write-ahead log refused a record (%s): "
            "following again from record %d once its disk takes writes",
            target.address, alarm, last + 1,
        )  # fmt: skip
        delay = 0.5
        while not self._stop.is_set() and not self._room():
            self._stop.wait(delay)
            delay = min(delay * 2, 5.0)
        return True

    def _room(self) -> bool:
        """Whether this server's log directory takes 1 MiB (written, fsynced)."""
        path = os.path.join(self.durability.wal_dir, ".space-probe")
        try:
            with open(path, "wb") as f:
                f.write(bytes(1 << 20))
                f.flush()
                os.fsync(f.fileno())
            return True
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _follow(self, target: PrimaryInfo) -> None:
        acks: queue.Queue[Any] = queue.Queue()
        acks.put(
            pb.ReplicateRequest(
                hello=pb.ReplicateHello(
                    member_id=self.member_id,
                    term=target.term,
                    address=self.address,
                    last_lsn=self.durable if self.durable_term else 0,
                    last_term=self.durable_term,
                    protocol=PROTOCOL,
                    lease=self._lease(),
                )
            )
        )

        def requests() -> Iterator[pb.ReplicateRequest]:
            # (an idle stream is not a stalled one: the server's stall watch
            # leaves Replicate alone once its hello, queued above, came,
            # ``limits._Admission``)
            while True:
                item = acks.get()
                if item is _END:
                    return
                yield item
                # gRPC asks for the next message once this one is sent
                if item.WhichOneof("part") == "ack":
                    applier.sent(item.ack.lsn)  # (assigned below, before the call)

        options = [
            ("grpc.max_receive_message_length", self._max_message),
            ("grpc.max_send_message_length", self._max_message),
        ]
        with self._channel(target.address, options) as channel:
            # records arrive as views of the message received (decode_response)
            replicate = channel.stream_stream(
                REPLICATE,
                request_serializer=pb.ReplicateRequest.SerializeToString,
                response_deserializer=decode_response,
            )
            applier = _Applier(self._apply)
            call: Any = replicate(requests(), metadata=self._metadata)
            with self._lock:
                if self._target != target:
                    call.cancel()
                    applier.close()
                    return
                self._call = call
            try:
                self._receive(call, target, acks, applier)
            finally:
                acks.put(_END)
                with self._lock:
                    self._call = None

    def _channel(self, address: str, options: list[tuple[str, int]]) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._credentials, options=options)

    def _receive(
        self,
        call: Any,
        target: PrimaryInfo,
        acks: queue.Queue[Any],
        applier: _Applier,
    ) -> None:
        def durable(lsn: int, term: int) -> None:
            self.durable, self.durable_term = lsn, term
            acks.put(pb.ReplicateRequest(ack=pb.ReplicateAck(lsn=lsn)))

        syncer = _Syncer(durable, applier, on_failed=call.cancel)
        try:
            self._messages(call, target, acks, syncer, applier)
        finally:
            # Every record received is durable and applied before following ends:
            # a promotion (which stops following first) serves the whole state.
            try:
                syncer.close()
            finally:
                if not applier.close():
                    self.durable_term = 0  # what is applied is not the log

    def _messages(
        self,
        call: Any,
        target: PrimaryInfo,
        acks: queue.Queue[Any],
        syncer: _Syncer,
        applier: _Applier,
    ) -> None:
        tmp: str | None = None
        covered: dict[str, int] = {}
        gather = Gather(self._max_message)  # (a record came in one message)
        fresh = True  # no snapshot nor record received yet
        for msg in call:
            if msg.term < max(target.term, self._term()) or self._stop.is_set():
                log.warning(
                    "refusing a message of term %d from %s: term %d is current",
                    msg.term, target.address, max(target.term, self._term()),
                )  # fmt: skip
                call.cancel()
                return
            if not isinstance(msg, ShippedRecord | ShippedBatch):
                msg = _shipped(msg)  # (a record encoded otherwise: parsed)
            if isinstance(msg, ShippedRecord | ShippedBatch):
                records = _whole(gather, msg)
                if records and fresh:
                    fresh = False
                    log.info(
                        "following %s from record %d (after this server's record "
                        "%d: resumed with no snapshot)",
                        target.address, records[0].lsn, self.durable,
                    )  # fmt: skip
                self._records(records, covered, syncer)
                continue
            part = msg.WhichOneof("part")
            fresh = False
            if part == "snapshot_chunk":
                tmp = tmp or self._fresh_dir()
                self._write_chunk(tmp, msg.snapshot_chunk)
            elif part == "snapshot_done":
                gen = msg.snapshot_done.generation
                assert tmp is not None, "a snapshot_done before its chunks"
                final = os.path.join(os.path.dirname(tmp), f"snap-{gen:012d}")
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
                tmp = None
                syncer.drain()
                applier.drain()
                self.durable_term = 0  # until a record of the new log is durable
                wal_lsn, covered = self.durability.adopt_snapshot(final)
                self.durable = self.applied = wal_lsn
                log.info(
                    "caught up from %s's snapshot (generation %d, wal lsn %d)",
                    target.address, gen, wal_lsn,
                )  # fmt: skip
                acks.put(pb.ReplicateRequest(ack=pb.ReplicateAck(lsn=wal_lsn)))

    def _records(
        self, records: list[ShippedRecord], covered: dict[str, int], syncer: _Syncer
    ) -> None:
        """Append each frame to this server's log as it came (its CRC and lsn
        checked); the syncer acknowledges them once they are durable, then hands
        them to the applier: the ack promises durability, not application."""
        journal = self.durability.journal
        appended: list[_Received] = []
        try:
            for rec in records:
                header = check_frame(rec, rec.lsn)
                if rec.lsn <= self.durable:
                    continue
                if journal is None:
                    raise Unavailable("the write-ahead log is closed: follow again")
                journal.append_frame(rec.chunks(), rec.lsn)
                appended.append((journal, rec.lsn, header, rec, covered))
        finally:
            if appended:  # (what the log took is made durable, as ever)
                syncer.put(appended)

    def _apply(
        self, header: dict[str, Any], rec: ShippedRecord, covered: dict[str, int]
    ) -> None:
        lsn = int(header["lsn"])
        with self._apply_lock:
            if covered.get(header.get("group", ""), -1) < lsn:
                try:
                    self.durability.apply(header, frame_arrays(header, rec.whole()))
                except DomainError as exc:
                    log.warning(
                        "record %d (%s on %r) not applied: %s",
                        lsn, header["op"], header.get("group"), exc,
                    )  # fmt: skip
            self.applied = lsn

    @contextlib.contextmanager
    def held(self) -> Iterator[int]:
        """No record is applied in this context; it gives the last one applied."""
        with self._apply_lock:
            yield self.applied

    def _fresh_dir(self) -> str:
        path = os.path.join(self.durability.root, "incoming-snapshot.tmp")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    @staticmethod
    def _write_chunk(directory: str, chunk: pb.ReplicaSnapshotChunk) -> None:
        name = os.path.basename(chunk.name)
        if name != chunk.name or name in ("", ".", ".."):
            raise ValueError(f"snapshot file name {chunk.name!r}")
        path = os.path.join(directory, name)
        with open(path, "r+b" if chunk.offset else "wb") as f:
            f.seek(chunk.offset)
            f.write(chunk.data)
            if len(chunk.data) < (1 << 20):
                f.flush()
                os.fsync(f.fileno())
