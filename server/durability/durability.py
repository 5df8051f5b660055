"""Snapshots, the write-ahead log, restore and replay.

``--durability snapshot``: the whole state is written atomically every
``snapshot_interval`` seconds, on the Save RPC and on graceful shutdown; a crash loses
what came after the last snapshot. ``--durability wal``: in addition every change is
appended to a write-ahead log and fsynced before the push is acknowledged, so a crash
loses nothing that was acknowledged. On start the newest intact snapshot is restored
and the log after it is replayed through the store's own code paths. The on-disk
format is in docs/FORMAT.md.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DomainError, FailedPrecondition, NotFound
from ..store import ParameterStore
from ._history import (
    GroupHistory,
    LogIndex,
    Reached,
    Record,
    build,
    read_base,
    renamed,
    snapshot_points,
)
from ._redo import redo
from ._snapshot import (
    SaveResult,
    SnapshotError,
    list_snapshots,
    load_snapshot,
    next_generation,
    read_manifest,
    write_snapshot,
)
from ._wal import LogReader, WriteAheadLog, fsync_dir, segment_paths
from ._walread import logged_term

__all__ = ["MODES", "Durability", "GroupHistory", "Rewound", "SaveResult"]

log = logging.getLogger("onnxps.durability")

MODES = ("none", "snapshot", "wal")


class Durability:
    """One data directory: ``snapshots/snap-<gen>/`` and ``wal/wal-<lsn>.log``.

    ``set_serving(False)`` is called when a write fails (a snapshot: the server
    serves from memory; the log: changes are refused) and ``set_serving(True)`` once
    writing works again. ``truncate_corrupt``: cut the log at corruption in its
    middle (dropping what follows) instead of refusing to start.
    """

    def __init__(
        self,
        store: ParameterStore,
        data_dir: str,
        *,
        mode: str = "snapshot",
        keep: int = 3,
        keep_seconds: float = 0.0,
        keep_bytes: int = 0,
        set_serving: Callable[[bool], None] | None = None,
        truncate_corrupt: bool = False,
    ) -> None:
        self.store = store
        self.root = os.path.abspath(data_dir)
        self.mode = mode
        self.keep = max(1, keep)
        self.keep_seconds = keep_seconds
        self.keep_bytes = keep_bytes
        self.snap_dir = os.path.join(self.root, "snapshots")
        self.wal_dir = os.path.join(self.root, "wal")
        self.journal: WriteAheadLog | None = None
        self._set_serving = set_serving
        self._truncate_corrupt = truncate_corrupt
        self._base_lsn = 0  # the last lsn when no log is kept
        self._lock = threading.Lock()  # one snapshot at a time
        # A standby's: while in it no record is applied; it gives the last one
        # applied (``set_position``). None: the log's last lsn is what memory holds.
        self._position: Callable[[], AbstractContextManager[int | None]] | None = None
        self._signature: Any = None
        self._snapshot_failed = False
        self._wal_failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_fd = -1
        self._scratch = _Scratch()
        # The term of the log's last record, read at open (a replicated shard's
        # records carry it; 0: unknown, or the last lsn is a snapshot's)
        self.last_term = 0
        # Where each group's records are in the log (rewind, fork, history)
        self._index = LogIndex(self.wal_dir)

    # -- start ----------------------------------------------------------------------
    def open(self) -> None:
        """Lock the directory, restore the newest snapshot, replay the log after it."""
        self._prepare()
        try:
            wal_lsn, covered = self._restore()
            last, replayed = self._replay(wal_lsn, covered)
        except BaseException:
            self._unlock()
            raise
        next_lsn = max([last, wal_lsn, *covered.values()]) + 1
        if next_lsn - 1 != last:
            self.last_term = 0  # the last lsn is not a record in the log
        elif last == wal_lsn:
            # Nothing after the snapshot (a graceful stop writes one last): the
            # term its last record has in the log, if kept, so that a standby
            # resumes after it instead of taking its primary's whole snapshot.
            self.last_term = (wal_lsn and logged_term(self.wal_dir, wal_lsn)) or 0
        if self.mode == "wal":
            self.journal = WriteAheadLog(
                self.wal_dir, next_lsn, self._on_wal_error, self._on_wal_recover
            )
            self.store.set_journal(self.journal)
        else:
            self._base_lsn = next_lsn - 1
            if replayed or segment_paths(self.wal_dir):
                # Left by a run in wal mode: fold it into a snapshot, then drop it.
                self.snapshot()
                for _, path in segment_paths(self.wal_dir):
                    os.unlink(path)
        self._signature = self._current_signature()

    def _prepare(self) -> None:
        try:
            os.makedirs(self.snap_dir, exist_ok=True)
            os.makedirs(self.wal_dir, exist_ok=True)
            self._lock_fd = os.open(
                os.path.join(self.root, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644
            )
            probe = os.path.join(self.root, ".write-test")
            with open(probe, "wb") as f:
                f.write(b"onnxps")
                os.fsync(f.fileno())
            os.unlink(probe)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"data directory {self.root!r} is not usable: "
                f"{exc.strerror or exc}; create it writable by this user, pass "
                "another --data-dir, or run with --durability none to keep state "
                "in memory only",
            ) from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise OSError(
                exc.errno,
                f"data directory {self.root!r} is in use by another onnxps server; "
                "stop it or pass another --data-dir",
            ) from exc
        for entry in os.listdir(self.snap_dir):
            if entry.endswith(".tmp"):
                log.warning("removing unfinished snapshot %s", entry)
                shutil.rmtree(os.path.join(self.snap_dir, entry), ignore_errors=True)

    def _restore(self) -> tuple[int, dict[str, int]]:
        """Install the newest intact snapshot; (its wal lsn, covered lsn per group)."""
        for _, path in list_snapshots(self.snap_dir):
            try:
                manifest, groups = load_snapshot(path)
            except SnapshotError as exc:
                log.warning(
                    "snapshot %s is damaged or incomplete (%s); using the one before",
                    path,
                    exc,
                )
                continue
            for captured in groups:
                self.store.install(captured.image, captured.runtime)
            log.info(
                "restored %d groups from %s (generation %d)",
                len(groups),
                path,
                manifest.generation,
            )
            covered = {c.image.name: c.runtime.covered_lsn for c in groups}
            return manifest.wal_lsn, covered
        segments = segment_paths(self.wal_dir)
        if segments and segments[0][0] > 1:
            log.error(
                "no intact snapshot in %s, and the write-ahead log starts at record "
                "%d: records before it are gone, so the replayed state is partial",
                self.snap_dir,
                segments[0][0],
            )
        return 0, {}

    def _replay(self, wal_lsn: int, covered: dict[str, int]) -> tuple[int, int]:
        last, count = wal_lsn, 0
        started = time.perf_counter()
        reader = LogReader(self.wal_dir, wal_lsn, self._truncate_corrupt)
        # Records on a group the store does not hold, by group: warned about at the
        # end unless a later record deletes that group (a snapshot taken while the
        # group was being deleted holds neither it nor its last records).
        orphans: dict[str, list[tuple[int, str, DomainError]]] = {}
        for header, arrays in reader:
            lsn, op, group = int(header["lsn"]), header["op"], header["group"]
            last = max(last, lsn)
            self.last_term = int(header.get("term", 0))
            if covered.get(group, -1) >= lsn:
                continue
            try:
                self._apply(header, arrays, reader.voided)
                count += 1
            except NotFound as exc:
                if op != "delete":
                    orphans.setdefault(group, []).append((lsn, op, exc))
            except DomainError as exc:
                _not_replayed(lsn, op, group, exc)
            if op == "delete" and orphans.pop(group, None):
                log.debug("records on %r before its deletion skipped", group)
        for group, records in orphans.items():
            for orphan_lsn, orphan_op, error in records:
                _not_replayed(orphan_lsn, orphan_op, group, error)
        if count or reader.skipped:
            log.info(
                "replayed %d write-ahead log records after record %d in %.3f s "
                "(%d segments before it not read)",
                count,
                wal_lsn,
                time.perf_counter() - started,
                reader.skipped,
            )
        reader.cut_torn_tail()  # the log goes on after its last intact record
        return last, count

    def _apply(
        self, h: dict[str, Any], arrays: list[np.ndarray[Any, Any]], voided: int = 0
    ) -> None:
        """Redo one logged change through the store's replay methods; ``voided``:
        how many records read so far were refused when written."""
        if h["op"] in ("push", "push_rows"):
            self._check_t(h, voided)
        redo(self.store, h, arrays, self.wal_dir)

    def _check_t(self, h: dict[str, Any], voided: int) -> None:
        """A push record names the T it was to step at; say so if replay differs.

        A push logged while earlier pushes of its group waited for their fsync
        counted them in its T; each of them that was refused (``voided``) steps it
        one T earlier, so that is no missing record.
        """
        t = h.get("t")  # absent in records written before it was logged
        if t is None:
            return
        now = self.store.describe(h["group"]).update_count
        if not now <= t <= now + voided:
            log.warning(
                "write-ahead log record %d (push on %r) was applied at T=%d, replay "
                "is at T=%d: records before it are missing; replaying it at T=%d",
                h["lsn"],
                h["group"],
                t,
                now,
                now,
            )

    # -- replication (onnxps.server.replication) -------------------------------------
    def apply(self, header: dict[str, Any], arrays: list[np.ndarray[Any, Any]]) -> None:
        """Apply one record shipped by a replicated shard's primary (as replay)."""
        self._apply(header, arrays)

    def adopt_snapshot(self, received: str) -> tuple[int, dict[str, int]]:
        """Make the snapshot directory ``received`` this server's whole state (a
        standby catching up): every group is dropped, the snapshots and the log are
        replaced, the snapshot is restored, and the log starts again after it.
        Returns the snapshot's wal lsn and covered lsn per group.

        Until it is done the directory holds ``ADOPTING`` (``adopting`` is True):
        a server that crashed meanwhile restarts with a partial state and knows it.
        """
        # reads of a group not back yet are UNAVAILABLE (retried), not NOT_FOUND
        name = os.path.basename(received)
        with (
            self._lock,
            self.store.replacing_state(f"adopting its primary's snapshot ({name})"),
        ):
            return self._adopt(received)

    def _adopt(self, received: str) -> tuple[int, dict[str, int]]:
        """Under the lock: ``adopt_snapshot``'s work."""
        marker = os.path.join(self.root, "ADOPTING")
        with open(marker, "wb") as f:
            os.fsync(f.fileno())
        fsync_dir(self.root)
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        for view in self.store.groups():
            self.store.replay_delete(view.name)
        shutil.rmtree(self.snap_dir, ignore_errors=True)
        shutil.rmtree(self.wal_dir, ignore_errors=True)
        os.makedirs(self.wal_dir)
        os.makedirs(self.snap_dir)
        os.rename(received, os.path.join(self.snap_dir, os.path.basename(received)))
        self._index = LogIndex(self.wal_dir)  # the log it indexed is gone
        wal_lsn, covered = self._restore()
        # Records after wal_lsn follow from the primary (a group's covered ones
        # too: logged, not applied again), so the log goes on right after it.
        next_lsn = wal_lsn + 1
        if self.mode == "wal":
            self.journal = WriteAheadLog(
                self.wal_dir, next_lsn, self._on_wal_error, self._on_wal_recover
            )
        else:
            self._base_lsn = next_lsn - 1
        self._signature = self._current_signature()
        # the snapshot's rename and the new log are on disk before the marker
        # goes: a power loss never leaves an eligible member with neither
        fsync_dir(self.snap_dir)
        fsync_dir(self.wal_dir)
        os.unlink(marker)
        fsync_dir(self.root)
        return wal_lsn, covered

    # -- history: rewind and fork (``_history``) ---------------------------------------
    def history(self, group: str) -> GroupHistory:
        """Group ``group``'s line: the steps it can go back to."""
        view = self.store.describe(group)  # NOT_FOUND first
        if self.journal is None:
            raise FailedPrecondition(
                f"group {group!r} has no history on this server: it keeps no "
                f"write-ahead log (--durability {self.mode}); start it with "
                "--durability wal to rewind and fork groups",
                reason="NO_HISTORY",
                metadata={"group": group},
            )
        self._index.refresh(self.journal.durable_lsn())
        return build(
            group,
            view.consistency.mode == "sync",
            self._index.records(group),
            snapshot_points(self.snap_dir, group),
        )

    def rewind(self, group: str, to_step: int) -> Rewound:
        """Set ``group`` back to its state right after step ``to_step`` (a logged
        change): from the nearest base at or before it and the group's records."""
        started = time.perf_counter()
        # one at a time with snapshots: what they prune is what this reads
        with self._lock:
            reached = self.history(group).reach(to_step, self.wal_dir, read_base)
            before, after = self.store.rewind(reached.capture.image)
        done = Rewound(group, before, after, reached, time.perf_counter() - started)
        _log_reached("rewound", done)
        return done

    def fork(self, group: str, new_group: str, at_step: int) -> Rewound:
        """A new group ``new_group`` with ``group``'s state right after step
        ``at_step`` (logged as its create)."""
        started = time.perf_counter()
        with self._lock:
            reached = self.history(group).reach(at_step, self.wal_dir, read_base)
            self.store.fork(renamed(reached.capture.image, new_group))
        now = self.store.describe(group).update_count
        return Rewound(new_group, now, at_step, reached, time.perf_counter() - started)

    def records_after(self, group: str, lsn: int) -> list[Record]:
        """Where ``group``'s durable log records after ``lsn`` are, in log order (a
        resharding's move follows them: read them with a ``RecordReader``)."""
        if self.journal is None:
            raise FailedPrecondition(
                f"group {group!r} cannot be followed on this server: it keeps no "
                f"write-ahead log (--durability {self.mode}); a move copies it "
                "under the fence instead",
                reason="NO_HISTORY",
                metadata={"group": group},
            )
        self._index.refresh(self.journal.durable_lsn())
        return [r for r in self._index.records(group) if r.lsn > lsn]

    def retained_bytes(self) -> tuple[int, int]:
        """The bytes the kept snapshots and the log's segments hold on disk."""
        return _tree_bytes(self.snap_dir), _tree_bytes(self.wal_dir)

    @property
    def adopting(self) -> bool:
        """A snapshot adoption began and has not finished (see ``adopt_snapshot``)."""
        return os.path.exists(os.path.join(self.root, "ADOPTING"))

    # -- snapshots ------------------------------------------------------------------
    def snapshot(self, force: bool = True) -> SaveResult | None:
        """Write a snapshot now (unless nothing changed and not ``force``)."""
        with self._lock:
            signature = self._current_signature()
            if not force and signature == self._signature:
                return None
            started = time.perf_counter()
            try:
                written = self._write(signature)
            except OSError as exc:
                log.error(
                    "snapshot to %s failed: %s; serving from memory, and the "
                    "snapshots already on disk are unchanged",
                    self.snap_dir,
                    exc,
                )
                self._snapshot_failed = True
                self._serving(False)
                raise
            if self._snapshot_failed and not self._wal_failed:
                self._serving(True)
            self._snapshot_failed = False
            log.info(
                "snapshot %s: %d groups, %d bytes in %.3f s",
                written.path,
                written.groups,
                written.bytes,
                time.perf_counter() - started,
            )
            return written

    def set_position(
        self, position: Callable[[], AbstractContextManager[int | None]] | None
    ) -> None:
        """On a replicated shard's standby, records are logged before they are
        applied: a snapshot must say what memory holds, not what the log holds
        (else a restart's replay starts after records never applied, and loses
        them). ``position()`` is a context in which no record is applied, giving
        the last lsn applied (None: this server is the primary, the log's)."""
        self._position = position

    def _write(self, signature: Any) -> SaveResult:
        gen = next_generation(self.snap_dir)
        held = self._position() if self._position is not None else nullcontext(None)
        with held as applied:
            if self.journal is not None:
                wal_lsn = self.journal.rotate()
                lsn_now: Callable[[], int] = self.journal.last_lsn
            else:
                wal_lsn = self._base_lsn
                lsn_now = lambda: self._base_lsn  # noqa: E731
            if applied is not None:  # a standby: what it applied, and not after
                wal_lsn = min(wal_lsn, applied)
                lsn_now = lambda: applied  # noqa: E731
            # Groups are captured one at a time, each written before the next is
            # copied, so one scratch buffer serves them all.
            captures = self.store.capture(lsn_now, self._scratch)
            try:
                written = write_snapshot(self.snap_dir, gen, captures, wal_lsn)
            finally:
                self._scratch.trim()
        self._signature = signature
        self._prune()
        return written

    def _prune(self) -> None:
        """Drop the snapshots retention does not keep, then the log segments
        every kept snapshot is past (see ``_retained``)."""
        snapshots = list_snapshots(self.snap_dir)
        kept = self._retained(snapshots)
        for _, path in snapshots[len(kept) :]:
            shutil.rmtree(path, ignore_errors=True)
        oldest = None
        for _, path in kept:
            try:
                wal_lsn = read_manifest(path).wal_lsn
            except SnapshotError:
                return  # a damaged snapshot may need any segment; keep them all
            oldest = wal_lsn if oldest is None else min(oldest, wal_lsn)
        if oldest is None:
            return
        segments = segment_paths(self.wal_dir)
        for (_, path), (next_first, _) in zip(segments, segments[1:], strict=False):
            if next_first - 1 <= oldest:
                os.unlink(path)

    def _retained(self, snapshots: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The snapshots kept (newest first): the newest ``keep``, and those younger
        than ``keep_seconds``; then, over ``keep_bytes`` (snapshots and the log they
        need), the oldest go until it fits or one is left."""
        now = time.time()
        count = self.keep
        while count < len(snapshots) and self.keep_seconds > 0:
            age = now - os.path.getmtime(snapshots[count][1])
            if age > self.keep_seconds:
                break
            count += 1
        kept = snapshots[:count]
        if self.keep_bytes <= 0:
            return kept
        sizes = [_tree_bytes(path) for _, path in kept]
        while len(kept) > 1:
            try:
                since = read_manifest(kept[-1][1]).wal_lsn
            except SnapshotError:
                break  # a damaged one may need any segment: not counted
            if sum(sizes) + self._log_bytes_after(since) <= self.keep_bytes:
                break
            kept, sizes = kept[:-1], sizes[:-1]
        return kept

    def _log_bytes_after(self, lsn: int) -> int:
        """The bytes of the log's segments a snapshot at ``lsn`` needs."""
        segments = segment_paths(self.wal_dir)
        total = 0
        for k, (_, path) in enumerate(segments):
            nxt = segments[k + 1][0] if k + 1 < len(segments) else None
            if nxt is None or nxt - 1 > lsn:
                try:
                    total += os.path.getsize(path)
                except FileNotFoundError:
                    pass
        return total

    def _current_signature(self) -> Any:
        groups = tuple(
            (v.name, v.incarnation, v.update_count, v.learning_rate, v.pending)
            for v in self.store.groups()
        )
        lsn = self.journal.last_lsn() if self.journal is not None else 0
        return lsn, groups

    # -- the running server ---------------------------------------------------------
    def save(self) -> SaveResult:
        """A snapshot now, for the Save RPC; FailedPrecondition when writing fails."""
        try:
            written = self.snapshot(force=True)
        except OSError as exc:
            raise FailedPrecondition(
                f"snapshot to {self.snap_dir} failed: {exc}; the server keeps "
                "serving from memory and the older snapshots are intact"
            ) from exc
        assert written is not None
        return written

    def start_periodic(self, interval: float) -> None:
        if interval <= 0 or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.snapshot(force=False)
                except OSError:
                    pass  # logged, health says NOT_SERVING; try again next time
                except Exception:
                    log.exception("periodic snapshot failed")

        self._thread = threading.Thread(
            target=loop, name="onnxps-snapshot", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Graceful shutdown: a last snapshot, then close the log."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        try:
            self.snapshot(force=False)
        except OSError:
            pass  # logged
        if self.journal is not None:
            self.journal.close()
            self.store.set_journal(None)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def alarms(self) -> set[str]:
        """Why this data directory does not keep changes now: ``DISK_FULL``,
        ``WAL_UNLINKED`` or ``WAL_WRITE_FAILED`` (the log refuses every change),
        ``SNAPSHOT_FAILED`` (the last snapshot could not be written)."""
        out = set()
        wal = self.journal.alarm() if self.journal is not None else None
        if wal is not None:
            out.add(wal)
        if self._snapshot_failed:
            out.add("SNAPSHOT_FAILED")
        return out

    def _on_wal_error(self, exc: OSError) -> None:
        self._wal_failed = True
        self._serving(False)

    def _on_wal_recover(self) -> None:
        self._wal_failed = False
        if not self._snapshot_failed:
            self._serving(True)

    def _serving(self, serving: bool) -> None:
        if self._set_serving is not None:
            self._set_serving(serving)


@dataclass(frozen=True)
class Rewound:
    """A rewind or a fork done: the group (a fork's new one), T before and after,
    how its state was reached, and how long it took."""

    group: str
    from_step: int
    to_step: int
    reached: Reached
    seconds: float


def _log_reached(what: str, done: Rewound) -> None:
    r = done.reached
    log.info(
        "%s group %s at T=%d (T was %d) in %.3f s: the %s at T=%d read in %.3f s, "
        "%d records replayed in %.3f s, logged and installed in %.3f s",
        what,
        done.group,
        done.to_step,
        done.from_step,
        done.seconds,
        r.base.kind,
        r.base_step,
        r.read_seconds,
        r.replayed,
        r.replay_seconds,
        done.seconds - r.read_seconds - r.replay_seconds,
    )


def _tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def _not_replayed(lsn: int, op: str, group: str, exc: DomainError) -> None:
    log.warning(
        "write-ahead log record %d (%s on %r) not replayed: %s", lsn, op, group, exc
    )


class _Scratch:
    """A reusable copy buffer; kept between snapshots up to ``RETAIN`` bytes."""

    RETAIN = 64 << 20

    def __init__(self) -> None:
        self._buf: np.ndarray[Any, Any] | None = None

    def __call__(self, nbytes: int) -> np.ndarray[Any, Any]:
        if self._buf is None or self._buf.nbytes < nbytes:
            self._buf = None
            self._buf = np.empty(nbytes, np.uint8)
        return self._buf

    def trim(self) -> None:
        if self._buf is not None and self._buf.nbytes > self.RETAIN:
            self._buf = None
