"""``onnxps reshard etcd://H:P/PREFIX --shards M``: grow or shrink a running cluster
(docs/resharding.md), and ``reshard()`` / ``reshard_status()``, the same from Python.

Every group (a whole group, a split group's part, an ids table's part) whose
rendezvous placement over M shards differs from where it is now moves, one at a
time, while workers keep pushing and pulling:

1. the placement map (``PREFIX/placement`` in etcd) records the move under way
   (``moving``: its target holds the group's calls from then on);
2. the target is told the group comes (``MoveGroup`` BEGIN_IMPORT);
3. the source streams it to the target as a one-group snapshot with its
   exactly-once windows (``ExportGroup`` piped into ``ImportGroup``), where it is
   installed and made durable, while the source goes on serving it; then the
   group's log records written meanwhile, round after round, which the target
   logs and applies (a source without a write-ahead log, or ``follow=False``:
   none of this, the whole copy is made in step 4);
4. the source fences the group (its calls are answered MOVED, the changes in
   flight finish) and sends the records after the last one the target applied;
5. the map flips (``owners``: the target), the target serves the group
   (ACTIVATE), the source deletes its copy (RELEASE).

Each step is recorded in etcd (the map, and ``PREFIX/reshard``: what the
resharding is and what it moved) and may be done again: run the same command again
after the tool was killed, and it finishes the move under way and goes on.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc
from onnxps.client._cluster import base_name, shard_ranking
from onnxps.client._discovery import CoordinatorTls, Discovery
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.codec import SHARD_METADATA_KEY
from onnxps.wire.coordinator import (
    failure,
    gateway_clients,
    is_coordinator,
    parse_coordinator,
)

from ._args import EXIT_USAGE, add_connection_arguments, fail, read_tls_ca

__all__ = [
    "Move",
    "ReshardError",
    "ReshardReport",
    "add_arguments",
    "reshard",
    "reshard_status",
    "run",
]


class ReshardError(RuntimeError):
    """A resharding that cannot go on; the message says what to do."""

    until = 0.0  # a busy shard's copy is tried again until then (monotonic)


class _Busy(ReshardError):
    """A copy refused as UNAVAILABLE: a shard not ready yet; tried again."""


class _Gone(ReshardError):
    """The source no longer holds the group (deleted while it was copied)."""


class _NoLog(ReshardError):
    """The source keeps no write-ahead log: the group is copied under the fence."""


# A move follows its source's log until a round brings this few records (or this
# few bytes), then fences; after this many rounds it fences whatever is left.
FOLLOW_RECORDS = 2
FOLLOW_BYTES = 256 << 10
FOLLOW_ROUNDS = 20


@dataclass(frozen=True)
class Move:
    """One group (or part) moved: from and to which shard, its T, the bytes of
    its state sent, and how long its calls were held (fence to ACTIVATE)."""

    name: str
    source: int
    target: int
    update_count: int
    bytes: int
    held_seconds: float
    fenced_bytes: int = 0  # the bytes sent while its writes were held
    followed: bool = False  # copied unfenced, then its source's log followed


@dataclass
class ReshardReport:
    """What a ``reshard`` did: the shard counts, the moves, the map's version."""

    from_shards: int
    to_shards: int
    moves: list[Move] = field(default_factory=list)
    map_version: int = 0
    resumed: bool = False


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class _Etcd:
    """The keys a resharding reads and writes, over etcd's JSON gateway."""

    def __init__(self, url: str, tls: CoordinatorTls | None, timeout: float) -> None:
        self.address = parse_coordinator(url, tls)
        self.url = url
        self.prefix = self.address.prefix
        self._clients = gateway_clients(self.address, timeout)

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        last: Exception | None = None
        for client in self._clients:
            try:
                return client.post(client.get_url(path), json=payload)
            except Exception as exc:  # noqa: BLE001 - etcd3gw's or requests'
                last = exc
        raise ConnectionError(
            f"etcd at {self.url} did not answer: {failure(last) if last else None}"
        )

    def get(self, key: str) -> tuple[bytes, int] | None:
        """The value and mod_revision of ``key`` (None: absent)."""
        kvs = self._post("/kv/range", {"key": _b64(key.encode())}).get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return base64.b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0))

    def swap(self, key: str, value: bytes, revision: int) -> bool:
        """Put ``value`` if ``key`` is still at ``revision`` (0: absent)."""
        compare = {
            "key": _b64(key.encode()),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": str(revision),
        }
        put = {"request_put": {"key": _b64(key.encode()), "value": _b64(value)}}
        answer = self._post("/kv/txn", {"compare": [compare], "success": [put]})
        return bool(answer.get("succeeded", False))

    def put(self, key: str, value: bytes) -> None:
        self._post("/kv/put", {"key": _b64(key.encode()), "value": _b64(value)})


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class _Map:
    """Read-modify-write of the placement map and the resharding's record."""

    def __init__(self, etcd: _Etcd) -> None:
        self.etcd = etcd
        self.key = f"{etcd.prefix}/placement"
        self.state_key = f"{etcd.prefix}/reshard"
        self.layout_key = f"{etcd.prefix}/layout"

    def read(self) -> tuple[dict[str, Any], int]:
        found = self.etcd.get(self.key)
        if found is not None:
            return json.loads(found[0]), found[1]
        layout = self.etcd.get(self.layout_key)
        if layout is None:
            raise ReshardError(
                f"no onnxps cluster under {self.etcd.url}: {self.layout_key} is "
                "missing (start its servers with --coordinator first)"
            )
        count = int(layout[0])
        doc = {"version": 0, "shards": count, "serving": count, "owners": {},
               "moving": {}}  # fmt: skip
        return doc, 0

    def update(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply ``change`` to the map and write it with the next version (the
        map is compared-and-swapped: a concurrent writer makes it try again)."""
        for _ in range(100):
            doc, revision = self.read()
            doc.setdefault("owners", {})
            doc.setdefault("moving", {})
            change(doc)
            doc["version"] = int(doc.get("version", 0)) + 1
            if self.etcd.swap(self.key, _dumps(doc), revision):
                return doc
        raise ReshardError(f"{self.key} kept changing under this resharding")

    def state(self) -> dict[str, Any] | None:
        found = self.etcd.get(self.state_key)
        return None if found is None else dict(json.loads(found[0]))

    def save_state(self, state: dict[str, Any]) -> None:
        self.etcd.put(self.state_key, _dumps(state))


def target_shard(name: str, shards: int) -> int:
    """Where ``name`` (a group, or part k of one) goes in a cluster of ``shards``
    when nothing is placed yet: part k on the k-th shard of its group's
    rendezvous ranking (a whole group: the first)."""
    group, k, _ = base_name(name)
    ranking = shard_ranking(group, shards)
    return ranking[k % shards]


def plan_targets(held: list[tuple[str, int]], shards: int) -> dict[str, int]:
    """The shard of every name in ``held`` ((name, shard it is on)) in a cluster of
    ``shards``, moving as few as rendezvous placement allows: a group's K parts
    belong on the first K shards of its ranking; a part already on one of them
    stays, the others take the ones left, in ranking order (a whole group: its
    first shard). More parts than shards: part k on the (k mod M)-th."""
    by_group: dict[str, list[tuple[int, str, int]]] = {}
    for name, shard in held:
        group, k, count = base_name(name)
        by_group.setdefault(group, []).append((k, name, shard))
    out: dict[str, int] = {}
    for group, parts in by_group.items():
        parts.sort()
        if len(parts) > shards:
            out.update((name, target_shard(name, shards)) for _, name, _ in parts)
            continue
        ranking = shard_ranking(group, shards)[: len(parts)]
        taken: set[int] = set()
        staying = []
        for _, name, shard in parts:
            if shard in ranking and shard not in taken:
                taken.add(shard)
                out[name] = shard
            else:
                staying.append(name)
        free = [s for s in ranking if s not in taken]
        out.update(zip(staying, free, strict=True))
    return out


class _Shards:
    """A gRPC stub per shard's primary (found in etcd), with the call metadata."""

    def __init__(
        self,
        discovery: Discovery,
        token: str | None,
        roots: bytes | None,
        timeout: float,
    ) -> None:
        self.discovery = discovery
        self.token = token
        self.roots = roots
        self.timeout = timeout
        self._stubs: dict[int, tuple[str, Any]] = {}
        self._channels: list[grpc.Channel] = []

    def stub(self, shard: int) -> Any:
        address = self.discovery.primary(shard, time.monotonic() + self.timeout)
        if address is None:
            raise ReshardError(
                f"shard {shard} under {self.discovery.url} has no primary: start "
                f"its server (onnxps serve --coordinator ... --shard {shard}/M) "
                "and run this command again"
            )
        known = self._stubs.get(shard)
        if known is not None and known[0] == address:
            return known[1]
        if self.roots is not None:
            creds = grpc.ssl_channel_credentials(self.roots)
            channel = grpc.secure_channel(address, creds)
        else:
            channel = grpc.insecure_channel(address)
        self._channels.append(channel)
        stub = pb_grpc.ParameterServerServiceStub(channel)
        self._stubs[shard] = (address, stub)
        return stub

    def metadata(self, shard: int) -> list[tuple[str, str]]:
        md = [(SHARD_METADATA_KEY, f"{shard}/{shard + 1}")]
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        return md

    def call(
        self, shard: int, method: str, request: Any, patience: float | None = None
    ) -> Any:
        """A unary call to ``shard``'s primary, resent while it is unavailable or
        not the primary (a failover: the primary read again from etcd) for up to
        ``patience`` seconds (default: 3 timeouts)."""
        until = time.monotonic() + (3 * self.timeout if patience is None else patience)
        while True:
            try:
                fn = getattr(self.stub(shard), method)
                return fn(request, timeout=self.timeout, metadata=self.metadata(shard))
            except grpc.RpcError as exc:
                failover = exc.code() == grpc.StatusCode.UNAVAILABLE or (
                    exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                    and "not the primary" in str(exc.details())
                )
                if not failover or time.monotonic() + 0.2 > until:
                    raise ReshardError(
                        f"{method} on shard {shard} failed: {exc.code().name}: "
                        f"{exc.details()} (run the command again to resume)"
                    ) from None
            except ReshardError:  # no primary elected yet
                if time.monotonic() + 0.2 > until:
                    raise
            time.sleep(0.2)

    def listing(self, shard: int) -> list[str]:
        reply = self.call(shard, "ListGroups", pb.ListGroupsRequest())
        return [g.name for g in reply.groups]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


Progress = Callable[[Move, int, int], None]


class _Resharding:
    def __init__(
        self,
        etcd: _Etcd,
        shards: _Shards,
        progress: Progress | None,
        follow: bool = True,
    ):
        # follow: a source with a write-ahead log is followed (False: every
        # group is copied under the fence, as before)
        self.follow = follow
        self.etcd = etcd
        self.map = _Map(etcd)
        self.shards = shards
        self.progress = progress

    def _owned(self, doc: dict[str, Any]) -> list[tuple[str, int]]:
        """(name, shard) of every group the shards serve, per the map."""
        owners: dict[str, int] = doc.get("owners", {})
        moving: dict[str, Any] = doc.get("moving", {})
        found = []
        for shard in range(int(doc["serving"])):
            for name in self.shards.listing(shard):
                owner = moving[name]["from"] if name in moving else owners.get(name)
                if owner is None or owner == shard:
                    found.append((name, shard))
        return found

    def move(
        self, name: str, source: int, target: int, until: float | None = None
    ) -> Move | None:
        """Move ``name``; a copy refused as UNAVAILABLE (a shard's standby not
        caught up, a failover) is abandoned and tried again until ``until``
        (default: 10 timeouts from now). None: the group was deleted on its
        source meanwhile (nothing to move; the target dropped what it got)."""
        if until is None:
            until = time.monotonic() + 10 * self.shards.timeout
        step = pb.MoveGroupRequest
        # the target holds the group's calls before anything (the source reading
        # the map fences it, and its MOVED answers send calls there)
        self.shards.call(
            target, "MoveGroup", step(group=name, step=pb.MOVE_STEP_BEGIN_IMPORT)
        )
        # "copy": the source goes on serving it (not fenced on reading the map)
        # while it is copied and its log followed
        entry = {"from": source, "to": target, "copy": self.follow}
        self.map.update(lambda d: d["moving"].__setitem__(name, entry))
        try:
            _, sent, fenced, started = self._transfer(name, source, target, until)
        except _Gone:  # deleted while it was copied: its delete was followed
            self._abandon(name, source, target)
            return None
        except _Busy as exc:  # a shard not ready (a standby catching up)
            self._abandon(name, source, target)
            if time.monotonic() + 0.5 > exc.until:
                raise
            time.sleep(0.5)
            return self.move(name, source, target, exc.until)
        except ReshardError:
            self._abandon(name, source, target)
            raise
        doc = self.map.update(lambda d: _flip(d, name, target))
        version = int(doc["version"])
        activated = self.shards.call(
            target,
            "MoveGroup",
            step(group=name, step=pb.MOVE_STEP_ACTIVATE, map_version=version),
        )
        held = time.monotonic() - started
        self._release(name, source, target, version)
        followed = fenced < sent
        return Move(
            name, source, target, activated.update_count, sent, held, fenced, followed
        )

    def _transfer(
        self, name: str, source: int, target: int, until: float
    ) -> tuple[Any, int, int, float]:
        """Copy ``name`` to the target: followed (its snapshot unfenced, its log
        records until few are left, then the last ones fenced) when its source
        keeps a write-ahead log, else copied under the fence. Returns the last
        import's reply, the bytes sent, those sent fenced, and when the fence
        began (monotonic)."""
        if self.follow:
            try:
                return self._follow(name, source, target, until)
            except _NoLog:
                self.map.update(lambda d: d["moving"][name].pop("copy", None))
        started = time.monotonic()
        req = pb.ExportGroupRequest(group=name, to_shard=target, fence=True)
        imported, _ = self._copy(name, source, target, req, until)
        return imported, int(imported.bytes), int(imported.bytes), started

    def _follow(
        self, name: str, source: int, target: int, until: float
    ) -> tuple[Any, int, int, float]:
        req = pb.ExportGroupRequest
        # every export of the move asks the primary the snapshot came from: the
        # lsns are its log's (one that fails over cuts the move off: made again)
        via = self._primary(source, until)
        imported, lsn = self._copy(
            name,
            source,
            target,
            req(group=name, to_shard=target, follow=True),
            until,
            via,
        )
        sent = int(imported.bytes)
        for _ in range(FOLLOW_ROUNDS):
            ask = req(group=name, to_shard=target, records=True, after_lsn=lsn)
            reply, lsn = self._copy(name, source, target, ask, until, via)
            sent += int(reply.bytes)
            if reply.records <= FOLLOW_RECORDS or reply.bytes <= FOLLOW_BYTES:
                break
        # the cutover: the source fences (the map says so too, for a primary
        # that takes over), the last records drain to the target
        started = time.monotonic()
        self.map.update(lambda d: d["moving"][name].pop("copy", None))
        ask = req(group=name, to_shard=target, fence=True, records=True, after_lsn=lsn)
        last, _ = self._copy(name, source, target, ask, until, via)
        return last, sent + int(last.bytes), int(last.bytes), started

    def _primary(self, shard: int, until: float) -> Any:
        """``shard``'s primary's stub; none now (a failover, a lease run out
        under load) raises ``_Busy``: the move is made again until ``until``."""
        try:
            return self.shards.stub(shard)
        except ReshardError as exc:
            busy = _Busy(str(exc))
            busy.until = until
            raise busy from None

    def _abandon(self, name: str, source: int, target: int) -> None:
        """A copy that failed: the source serves the group again (the map did
        not flip), the target drops what it got; best effort (a resume redoes
        the move from the start)."""
        try:  # first: a server reading the map would fence it again
            self.map.update(lambda d: d["moving"].pop(name, None))
        except (ReshardError, ConnectionError):
            return  # the move stays recorded: a resume redoes it
        for shard, step in ((target, pb.MOVE_STEP_ABORT_IMPORT),
                            (source, pb.MOVE_STEP_UNFENCE)):  # fmt: skip
            try:
                req = pb.MoveGroupRequest(group=name, step=step)
                self.shards.call(shard, "MoveGroup", req, patience=0)
            except ReshardError:
                pass

    def _copy(
        self,
        name: str,
        source: int,
        target: int,
        request: pb.ExportGroupRequest,
        until: float = 0.0,
        via: Any = None,
    ) -> tuple[Any, int]:
        """Pipe what ``request`` exports from the source (a snapshot, or log
        records) into the target; returns the import's reply and the lsn the
        export's end names. A shard that fails over meanwhile (UNAVAILABLE,
        NOT_PRIMARY, the export cut off) raises ``_Busy``: the move is made
        again; a source with no log asked to be followed raises ``_NoLog``.
        ``via``: the source's stub to ask (default: its primary now)."""
        cut: list[grpc.RpcError] = []  # the export's failure, when it failed
        end: list[int] = []
        exporter = via or self._primary(source, until)
        importer = self._primary(target, until)

        def pieces() -> Iterator[pb.ImportGroupRequest]:
            try:
                exported = exporter.ExportGroup(
                    request,
                    timeout=self.shards.timeout * 10,
                    metadata=self.shards.metadata(source),
                )
                for msg in exported:
                    if msg.HasField("done"):
                        end.append(int(msg.done.wal_lsn))
                        yield pb.ImportGroupRequest(done=msg.done)
                    elif msg.HasField("record"):
                        yield pb.ImportGroupRequest(record=msg.record)
                    else:
                        yield pb.ImportGroupRequest(chunk=msg.chunk)
            except grpc.RpcError as exc:
                cut.append(exc)  # the target gets no end: it installs nothing

        try:
            reply = importer.ImportGroup(
                pieces(),
                timeout=self.shards.timeout * 10,
                metadata=self.shards.metadata(target),
            )
            return reply, end[0]
        except grpc.RpcError as exc:
            why = cut[0] if cut else exc
            if why.code() == grpc.StatusCode.FAILED_PRECONDITION and (
                "keeps no write-ahead log" in str(why.details())
            ):
                raise _NoLog(str(why.details())) from None
            if cut and why.code() == grpc.StatusCode.NOT_FOUND:
                raise _Gone(str(why.details())) from None
            failover = why.code() == grpc.StatusCode.UNAVAILABLE or (
                "not the primary" in str(why.details())
            )
            side = "exporting from" if cut else "importing into"
            error = (_Busy if failover else ReshardError)(
                f"moving {name} from shard {source} to shard {target} failed "
                f"{side} it: {why.code().name}: {why.details()} (run the command "
                "again to resume)"
            )
            error.until = until
            raise error from None

    def _release(self, name: str, source: int, target: int, version: int) -> None:
        req = pb.MoveGroupRequest(
            group=name,
            step=pb.MOVE_STEP_RELEASE,
            to_shard=target,
            map_version=version,
        )
        self.shards.call(source, "MoveGroup", req)

    def undo(self) -> ReshardReport:
        """Take a resharding under way back: the move in flight is abandoned if
        its map did not flip (its source serves it again), and the groups moved
        go back to their placement over the earlier count."""
        state = self.map.state()
        if state is None or state.get("state") != "running":
            raise ReshardError(
                f"no resharding is under way under {self.etcd.url} to undo (a "
                "finished one is taken back by resharding to the earlier count)"
            )
        back = int(state["from"])
        doc, _ = self.map.read()
        for name, m in list(doc.get("moving", {}).items()):
            self._abandon(name, int(m["from"]), int(m["to"]))
        state.update(to=back, undone=int(state["to"]))
        self.map.save_state(state)
        return self.run(back)

    def run(self, to: int) -> ReshardReport:
        state = self.map.state()
        doc, _ = self.map.read()
        resumed = state is not None and state.get("state") == "running"
        if resumed:
            assert state is not None
            if int(state["to"]) != to:
                raise ReshardError(
                    f"a resharding from {state['from']} to {state['to']} shards is "
                    f"under way under {self.etcd.url}: finish it first "
                    f"(onnxps reshard {self.etcd.url} --shards {state['to']})"
                )
            start = int(state["from"])
        else:
            start = int(doc["shards"])
            state = {"from": start, "to": to, "state": "running",
                     "started_unix": time.time(), "moved": []}  # fmt: skip
            self.map.save_state(state)
        report = ReshardReport(start, to, resumed=resumed)
        serving = max(start, to, int(doc.get("serving", start)))
        self.map.update(lambda d: d.__setitem__("serving", serving))
        for shard in range(serving):
            self.shards.stub(shard)  # every shard has a primary, before any move
        # a move the tool was killed in: the map flipped or not
        doc, _ = self.map.read()
        for name, m in list(doc.get("moving", {}).items()):
            self._record(state, report, self.move(name, int(m["from"]), int(m["to"])))
        if resumed:
            # the tool may have died between a flip and its source's release
            for name, owner in doc.get("owners", {}).items():
                for shard in range(serving):
                    if shard != owner:
                        self._release(name, shard, int(owner), int(doc["version"]))
        while True:
            doc, _ = self.map.read()
            held = self._owned(doc)
            targets = plan_targets(held, to)
            todo = [(n, s, targets[n]) for n, s in held if targets[n] != s]
            if not todo:
                break
            for name, source, target in sorted(todo):
                self._record(state, report, self.move(name, source, target))
        doc = self.map.update(lambda d: d.update(shards=to, serving=to))
        self.etcd.put(self.map.layout_key, str(to).encode())
        state.update(state="complete", finished_unix=time.time())
        self.map.save_state(state)
        report.map_version = int(doc["version"])
        return report

    def _record(
        self, state: dict[str, Any], report: ReshardReport, m: Move | None
    ) -> None:
        if m is None:  # deleted while it was moved: nothing moved
            return
        state.setdefault("moved", []).append([m.name, m.source, m.target])
        state.setdefault("holds", []).append(round(m.held_seconds, 4))
        state["bytes"] = int(state.get("bytes", 0)) + m.bytes
        self.map.save_state(state)
        report.moves.append(m)
        if self.progress is not None:
            self.progress(m, len(report.moves), 0)


def _flip(doc: dict[str, Any], name: str, target: int) -> None:
    doc["owners"][name] = target
    doc["moving"].pop(name, None)


def reshard(
    coordinator: str,
    shards: int,
    *,
    timeout: float = 10.0,
    token: str | None = None,
    root_certificates: bytes | None = None,
    coordinator_tls: CoordinatorTls | None = None,
    progress: Progress | None = None,
    undo: bool = False,
    follow: bool = True,
) -> ReshardReport:
    """Move the groups of the cluster under ``coordinator`` (``etcd://H:P/PREFIX``)
    so that it has ``shards`` shards; returns when every group is where it
    belongs. Start the servers of the new shards first (``--shard I/M``);
    stop those of dropped shards after it returns. Resumes a resharding to the
    same count left unfinished (the tool killed); ``ReshardError`` says what to do
    when it cannot go on. ``undo``: take back the resharding under way instead
    (``shards`` is then ignored): the groups it moved go back to where the
    earlier count places them. ``follow`` (default): a group whose source keeps
    a write-ahead log is copied while it is served and its log followed, and
    only its last records are sent under the fence; False: every group is
    copied whole under the fence."""
    if not is_coordinator(coordinator):
        raise ValueError(
            f"onnxps reshard works on a cluster found through etcd "
            f"(etcd://HOST:PORT/PREFIX), got {coordinator!r}"
        )
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    etcd = _Etcd(coordinator, coordinator_tls, timeout)
    discovery = Discovery(coordinator, tls=coordinator_tls)
    peers = _Shards(discovery, token, root_certificates, timeout)
    try:
        resharding = _Resharding(etcd, peers, progress, follow)
        return resharding.undo() if undo else resharding.run(shards)
    finally:
        peers.close()


def reshard_status(
    coordinator: str, *, coordinator_tls: CoordinatorTls | None = None
) -> dict[str, Any]:
    """Where a resharding stands: ``PREFIX/reshard`` (``from``, ``to``,
    ``state``: running or complete, ``moved``, ``holds``, ``bytes``) with the
    map's ``version``, ``serving`` and ``moving``; ``{}`` when none ran."""
    etcd = _Etcd(coordinator, coordinator_tls, 5.0)
    placement = _Map(etcd)
    state = placement.state()
    if state is None:
        return {}
    doc, _ = placement.read()
    return state | {
        "map_version": doc.get("version", 0),
        "serving": doc.get("serving"),
        "moving": doc.get("moving", {}),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Grow or shrink a running cluster found through etcd: move every group "
        "whose placement over --shards differs, one at a time, while workers "
        "go on (docs/resharding.md). Start the new shards' servers first "
        "(onnxps serve --coordinator ... --shard I/M); stop dropped shards' "
        "servers after it returns. Run it again to resume after a crash."
    )
    p.add_argument("coordinator", help="etcd://HOST:PORT/PREFIX of the cluster")
    p.add_argument("--shards", type=int, help="the shard count to reach")
    p.add_argument(
        "--undo",
        action="store_true",
        help="take back the resharding under way (unfinished): the groups it "
        "moved go back, the shard count stays the earlier one",
    )
    p.add_argument(
        "--status",
        action="store_true",
        help="show where the last resharding stands and exit",
    )
    p.add_argument(
        "--copy-under-fence",
        action="store_true",
        help="copy each group whole while its writes are held, also from a "
        "source with a write-ahead log (by default such a group is copied while "
        "it is served and its log followed; only its last records are sent "
        "while its writes are held)",
    )
    add_connection_arguments(p, timeout=10.0)


def _line(out: TextIO) -> Progress:
    tty = out.isatty()

    def show(m: Move, done: int, total: int) -> None:
        how = f" ({m.fenced_bytes} while held: its log followed)" if m.followed else ""
        text = (
            f"moved {m.name}: shard {m.source} -> {m.target}, T={m.update_count}, "
            f"{m.bytes} bytes{how}, writes held {m.held_seconds * 1000:.0f} ms"
        )
        if tty:
            print(f"\r[{done}] {text}\033[K", end="", file=out, flush=True)
        else:
            print(text, file=out, flush=True)

    return show


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    prog = "onnxps reshard"
    if not is_coordinator(args.coordinator):
        fail(prog, f"expected etcd://HOST:PORT/PREFIX, got {args.coordinator!r}",
             EXIT_USAGE)  # fmt: skip
    if args.status:
        state = reshard_status(args.coordinator)
        if not state:
            print(f"no resharding has run under {args.coordinator}", file=out)
            return 0
        holds = state.get("holds") or [0.0]
        print(
            f"resharding {state['from']} -> {state['to']} shards: {state['state']}; "
            f"{len(state.get('moved', []))} groups moved, "
            f"{state.get('bytes', 0)} bytes, longest hold {max(holds) * 1000:.0f} ms; "
            f"placement map version {state['map_version']}",
            file=out,
        )
        for name, m in sorted(state.get("moving", {}).items()):
            print(f"moving {name}: shard {m['from']} -> {m['to']}", file=out)
        return 0
    if args.shards is None and not args.undo:
        fail(prog, "give --shards M (the shard count to reach), or --status",
             EXIT_USAGE)  # fmt: skip
    roots = read_tls_ca(prog, args.tls_ca)
    try:
        report = reshard(
            args.coordinator,
            args.shards or 1,
            timeout=args.timeout,
            token=args.token or os.environ.get("ONNXPS_TOKEN"),
            root_certificates=roots,
            progress=_line(out),
            undo=args.undo,
            follow=not args.copy_under_fence,
        )
    except (ReshardError, ConnectionError, LookupError) as exc:
        fail(prog, str(exc))
    if out.isatty():
        print(file=out)
    moved = sum(m.bytes for m in report.moves)
    if args.undo:
        print(
            f"{args.coordinator}: the resharding is undone, back to "
            f"{report.to_shards} shards: {len(report.moves)} groups moved "
            f"({moved} bytes), placement map version {report.map_version}",
            file=out,
        )
        return 0
    print(
        f"{args.coordinator}: {report.from_shards} -> {report.to_shards} shards, "
        f"{len(report.moves)} groups moved ({moved} bytes), placement map version "
        f"{report.map_version}" + (" (resumed)" if report.resumed else ""),
        file=out,
    )
    return 0
