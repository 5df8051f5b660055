"""The onnxps client: push and pull in the ONNX input and output ordering."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from ._cluster import Layout, fan_out
from ._encoding import Encoding
from ._errors import (
    ClientClosedError,
    InvalidArgumentError,
    RpcError,
    UnavailableError,
)
from ._records import (
    GroupInfo,
    LeaseInfo,
    PartInfo,
    PushResult,
    RowsPage,
    SaveInfo,
    WorkerInfo,
    group_info,
    lease_info,
)
from ._requests import (
    Call,
    ClientCore,
    Deadline,
    Op,
    OpRun,
    Pause,
    PushCall,
    State,
    as_method,
    channel_credentials,
    channel_options,
    log,
    multicallable,
)

__all__ = [
    "Client",
    "GroupInfo",
    "LeaseInfo",
    "PartInfo",
    "PushResult",
    "SaveInfo",
    "WorkerInfo",
]

Array = np.ndarray[Any, Any]
P = ParamSpec("P")
R = TypeVar("R")

BACKGROUND_PUSHES = 4  # threads of a client's background pushes

# the names the cluster calls (_sharded) use
_Deadline = Deadline
_group_info = group_info
# shard, request (a dense push's, or a row push's header), gradients
_PartPush = tuple[int, pb.PushRequest | pb.PushRowsHeader, list[Array]]


def until_landed(call: Callable[[], R], deadline: Deadline) -> R:
    """``call()``, resent while its server is unavailable, until the deadline (a
    cluster's calls: a shard pod restarting must not fail the worker). A push
    carries the same (client_id, seq) each time, so it lands exactly once."""
    backoff = 0.1
    while True:
        try:
            return call()
        except UnavailableError:
            pause = min(backoff, deadline.remaining())
            if pause <= 0:
                raise
            time.sleep(pause)
            backoff = min(1.0, backoff * 2)


def _lazy(call: Callable[[], R]) -> Op[R]:
    """An operation that, when run, makes its calls itself with ``call()`` (a
    cluster's: blocking, one per shard, through the client's ``_call``)."""
    yield from ()  # a generator: nothing runs before the operation does
    return call()


def _blocking(
    op: Callable[Concatenate[ClientCore, P], Op[R]],
) -> Callable[Concatenate[Client, P], R]:
    """A Client method that runs the shared operation ``op`` to its result (the
    Client's own ``op``, by name: on a cluster it routes the call)."""
    name = op.__name__

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        built: Op[R] = getattr(self, name)(*args, **kwargs)
        return self._run(built)

    as_method(method, op, "Client")
    return method


def _in_background(
    op: Callable[Concatenate[ClientCore, P], Op[R]],
) -> Callable[Concatenate[Client, P], Future[R]]:
    """A Client method that builds ``op`` now and runs it on a background thread."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        return self._submit(op(self, *args, **kwargs))

    as_method(method, op, "Client", "push_background")
    method.__doc__ = """Start ``push_detailed`` on a background thread and return its
    future at once, so the next step computes while this push travels.

    The push is built now: its deadline and seq start now, and a unary push has
    copied the gradients; a streamed one reads them as it sends, so leave them
    unchanged until the future is done. ``close()`` waits for pending pushes."""
    return method


class Client(ClientCore):
    """A connection to one onnxps server, or to a cluster of shards.

    ``address`` is ``"host:port"`` (one server) or a list of the shards' addresses
    in shard order (a cluster; README "A cluster of shards"): each call is routed
    to the shards holding its group, and a group whose X is larger than
    ``split_bytes`` is split across them.

    ``address`` may also be ``"unix:///path/to.sock"`` (or ``"unix:relative"``): a
    server listening on a Unix socket. ``shared_memory`` chooses the same-host
    transport (README "Same host: Unix sockets and shared memory"): ``"auto"`` (the
    default) moves the tensors of large pushes and pulls through /dev/shm when a
    hello proves client and server share host and user, and sends bytes over gRPC
    otherwise (logged once); ``"on"`` raises ``SharedMemoryError`` where it cannot
    work; ``"off"`` never uses it.

    Every call takes ``timeout=`` (seconds) and falls back to the client's default.
    It is one deadline for the whole call: every retry of the channel and every
    resend of a push happen within it. The channel is opened on first use; after
    ``close()`` (or leaving the ``with`` block) every call raises
    ``ClientClosedError``. ``AsyncClient`` is the same client for asyncio.
    """

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, pb_grpc.ParameterServerServiceStub] = {}
        self._callables: dict[tuple[int, str], Any] = {}
        self._layouts: dict[str, Layout] = {}
        # group -> the parts of a push that did not land (sent first by the next)
        self._unfinished: dict[str, tuple[list[_PartPush], list[_PartPush]]] = {}
        self._heartbeats: dict[str, tuple[threading.Event, threading.Thread]] = {}
        self._background: ThreadPoolExecutor | None = None

    # -- lifecycle -----------------------------------------------------------------
    def __enter__(self) -> Client:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Finish the background pushes, stop heartbeats, close the channel; later
        calls raise ClientClosedError."""
        with self._lock:
            background, self._background = self._background, None
        if background is not None:
            background.shutdown(wait=True)
        with self._lock:
            if self._state is State.CLOSED:
                return
            self._state = State.CLOSED
            beats = list(self._heartbeats.values())
            self._heartbeats.clear()
        for stop, thread in beats:
            stop.set()
            thread.join(timeout=5)
        for channel in self._channels.values():
            channel.close()
        self._close_shared_memory()

    def _get_stub(self, shard: int = 0) -> pb_grpc.ParameterServerServiceStub:
        with self._lock:
            self._check_open()
            stub = self._stubs.get(shard)
            if stub is None:
                address = self.addresses[shard]
                options = channel_options(self._server_name_override)
                creds = channel_credentials(self._tls)
                if creds is not None:
                    channel = grpc.secure_channel(address, creds, options)
                else:
                    channel = grpc.insecure_channel(address, options)
                self._channels[shard] = channel
                stub = self._stubs[shard] = pb_grpc.ParameterServerServiceStub(channel)
                self._state = State.OPEN
            return stub

    def _method(self, name: str, shard: int = 0) -> Any:
        self._get_stub(shard)  # opens the channel
        key = (shard, name)
        fn = self._callables.get(key)
        if fn is None:
            fn = self._callables[key] = multicallable(self._channels[shard], name)
        return fn

    def _run(self, op: Op[R], shard: int = 0) -> R:
        """Perform an operation's effects with blocking calls (to ``shard`` of a
        cluster); return its result."""
        run = OpRun(op)
        while (effect := run.next_effect()) is not None:
            try:
                run.reply(self._perform(effect, shard))
            except RpcError as exc:
                run.fail(exc)
        result: R = run.result
        return result

    def _perform(self, effect: Call | Pause, shard: int = 0) -> Any:
        if isinstance(effect, Pause):
            time.sleep(effect.seconds)
            return None
        fn = self._method(effect.method, shard)
        timeout = effect.deadline.remaining()
        try:
            reply = fn(
                effect.request(), timeout=timeout, metadata=self._metadata(shard)
            )
            if effect.reader is None:
                return reply
            reader = effect.reader()
            for msg in reply:
                reader.add(msg)
            return reader.finish()
        except grpc.RpcError as exc:
            raise effect.error(exc) from None

    # -- one shard's calls (the cluster's, in _sharded, are made of these) ----------
    def _call(
        self,
        method: str,
        request: Any,
        deadline: Deadline | float | None,
        what: str | None = None,
        shard: int = 0,
    ) -> Any:
        """One unary RPC to ``shard``: its reply. ``deadline`` is the call's (shared
        by every send of it) or a timeout for a call of its own."""
        if not isinstance(deadline, Deadline):
            deadline = self._deadline(deadline)
        what = what or f"{method} was not answered"
        call = Call(method, lambda: request, deadline, what)
        return self._run(self._call_op(call), shard)

    def _create_request(
        self,
        shard: int,
        template: pb.CreateGroupRequest,
        names: Sequence[str],
        arrays: Sequence[Array],
        state_arrays: Sequence[Array],
        deadline: Deadline,
    ) -> pb.GroupInfo:
        op = self._create_op(template, names, arrays, state_arrays, deadline)
        return self._run(op, shard)

    def _push_one(
        self,
        shard: int,
        template: pb.PushRequest | pb.PushRowsHeader,
        arrays: Sequence[Array],
        deadline: Deadline,
    ) -> Any:
        """One push (or a part's) to one shard: the reply message."""
        if isinstance(template, pb.PushRowsHeader):
            op = self._rows_send_op(template.group, template, list(arrays), deadline)
            return self._run(op, shard)
        return self._run(self._push_op(template, arrays, deadline), shard)

    def _pull_one(
        self,
        shard: int,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding = "native",
    ) -> tuple[int, list[Array]]:
        op = self._pull_op(group, state, min_version, deadline, encoding)
        return self._run(op, shard)

    # -- a cluster's operations: routed to the shards holding the group --------------
    def _create_parts(
        self,
        req: pb.CreateGroupRequest,
        names: list[str],
        arrays: list[Array],
        state_arrays: list[Array],
        deadline: Deadline,
        *,
        table_arrays: Sequence[Sequence[Array]] = (),
    ) -> Op[GroupInfo]:
        if self.shards is None:
            return super()._create_parts(
                req, names, arrays, state_arrays, deadline, table_arrays=table_arrays
            )
        from . import _sharded

        if req.tables:
            from . import _ids_cluster

            return _lazy(
                lambda: _ids_cluster.create_group(
                    self, req, names, table_arrays, deadline
                )
            )

        return _lazy(
            lambda: _sharded.create_group(
                self, req, names, arrays, state_arrays, deadline
            )
        )

    def _describe_group(
        self, name: str, *, timeout: float | None = None
    ) -> Op[GroupInfo]:
        if self.shards is None:
            return super()._describe_group(name, timeout=timeout)
        from . import _sharded

        deadline = self._deadline(timeout)
        return _lazy(lambda: _sharded.describe_group(self, name, deadline))

    def _list_groups(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> Op[list[GroupInfo]]:
        if self.shards is None:
            return super()._list_groups(prefix, timeout=timeout)
        from . import _sharded

        deadline = self._deadline(timeout)
        return _lazy(lambda: _sharded.list_groups(self, prefix, deadline))

    def _delete_group(self, name: str, *, timeout: float | None = None) -> Op[bool]:
        if self.shards is None:
            return super()._delete_group(name, timeout=timeout)
        from . import _sharded

        self._sizes.pop(name, None)
        deadline = self._deadline(timeout)
        return _lazy(lambda: _sharded.delete_group(self, name, deadline))

    def _set_learning_rate(
        self, name: str, learning_rate: float, *, timeout: float | None = None
    ) -> Op[GroupInfo]:
        if self.shards is None:
            return super()._set_learning_rate(name, learning_rate, timeout=timeout)
        from . import _sharded

        deadline = self._deadline(timeout)
        return _lazy(
            lambda: _sharded.set_learning_rate(self, name, learning_rate, deadline)
        )

    def _push_parts(
        self, req: pb.PushRequest, arrays: list[Array], deadline: Deadline
    ) -> Op[PushResult]:
        if self.shards is None:
            return super()._push_parts(req, arrays, deadline)
        from . import _sharded

        return _lazy(lambda: _sharded.push(self, req, arrays, deadline))

    def _pull_parts(
        self,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: Deadline,
        encoding: Encoding = "native",
    ) -> Op[tuple[int, list[Array]]]:
        if self.shards is None:
            return super()._pull_parts(group, state, min_version, deadline, encoding)
        from . import _sharded

        return _lazy(
            lambda: _sharded.pull(self, group, state, min_version, deadline, encoding)
        )

    def _save(self, *, timeout: float | None = None) -> Op[SaveInfo]:
        """Ask the server (every shard of a cluster) to write a snapshot now; a
        cluster's paths are joined with ", " in shard order."""
        if self.shards is None:
            return super()._save(timeout=timeout)
        deadline = self._deadline(timeout)

        def save_all() -> SaveInfo:
            replies = fan_out(
                [
                    functools.partial(
                        self._call, "Save", pb.SaveRequest(), deadline, None, i
                    )
                    for i in range(self.shards or 1)
                ]
            )
            return SaveInfo(
                ", ".join(m.path for m in replies),
                sum(m.groups for m in replies),
                sum(m.bytes for m in replies),
            )

        return _lazy(save_all)

    # -- calls ---------------------------------------------------------------------
    # Each is the shared operation of ClientCore, run with blocking grpc calls (on a
    # cluster, the operations above route it to the shards of its group).
    create_group = _blocking(ClientCore._create_group)
    describe_group = _blocking(ClientCore._describe_group)
    list_groups = _blocking(ClientCore._list_groups)
    delete_group = _blocking(ClientCore._delete_group)
    set_learning_rate = _blocking(ClientCore._set_learning_rate)
    push_detailed = _blocking(ClientCore._push_detailed)
    pull = _blocking(ClientCore._pull)
    pull_versioned = _blocking(ClientCore._pull_versioned)
    push_rows = _blocking(ClientCore._push_rows)
    pull_rows = _blocking(ClientCore._pull_rows)
    list_rows = _blocking(ClientCore._list_rows)
    count_rows = _blocking(ClientCore._count_rows)
    export_rows = _blocking(ClientCore._export_rows)
    apply = _blocking(ClientCore._apply)
    save = _blocking(ClientCore._save)
    export = _blocking(ClientCore._export)
    import_ = _blocking(ClientCore._import_)
    tensor_buffers = _blocking(ClientCore._tensor_buffers)

    # the runner's type has self; the annotation is the type callers see
    push: PushCall[int, list[Array]] = cast(Any, _blocking(ClientCore._push))

    push_background = _in_background(ClientCore._push_detailed)

    def _submit(self, op: Op[R]) -> Future[R]:
        with self._lock:
            self._check_open()
            if self._background is None:
                self._background = ThreadPoolExecutor(
                    BACKGROUND_PUSHES, thread_name_prefix="onnxps-push"
                )
            return self._background.submit(self._run, op)

    # -- rows ----------------------------------------------------------------------
    def _push_rows(
        self,
        group: str,
        gradients: Mapping[str, Any],
        *,
        base_version: int | None = None,
        learning_rate: float | None = None,
        encoding: Encoding | None = None,
        timeout: float | None = None,
    ) -> Op[PushResult]:
        if self.shards is None:
            return super()._push_rows(
                group,
                gradients,
                base_version=base_version,
                learning_rate=learning_rate,
                encoding=encoding,
                timeout=timeout,
            )
        from . import _rowsplit

        deadline = self._deadline(timeout)
        enc = self._encoding(encoding, self.gradient_encoding, "encoding")

        def push() -> PushResult:
            return _rowsplit.push_rows(
                self, group, gradients, base_version, learning_rate, deadline, enc
            )

        return _lazy(push)

    def _pull_rows(
        self,
        group: str,
        selections: Mapping[str, Any],
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> Op[dict[str, Array]]:
        if self.shards is None:
            return super()._pull_rows(
                group, selections, state=state, min_version=min_version, timeout=timeout
            )
        from . import _rowsplit

        deadline = self._deadline(timeout)

        def pull() -> dict[str, Array]:
            return _rowsplit.pull_rows(
                self, group, selections, state, min_version, deadline
            )

        return _lazy(pull)

    def _ids_layout(self, group: str, deadline: Deadline) -> Layout | None:
        """The layout of a group of ids tables split by id (``_ids_cluster``)."""
        from . import _ids_cluster, _sharded

        found = _sharded.layout(self, group, deadline)
        return found if _ids_cluster.is_ids_layout(found) else None

    def _list_rows(
        self,
        group: str,
        table: str,
        *,
        page_token: str = "",
        page_size: int = 0,
        values: bool = False,
        state: bool = False,
        timeout: float | None = None,
    ) -> Op[RowsPage]:
        if self.shards is None:
            return super()._list_rows(
                group,
                table,
                page_token=page_token,
                page_size=page_size,
                values=values,
                state=state,
                timeout=timeout,
            )
        deadline = self._deadline(timeout)

        def page() -> RowsPage:
            from . import _ids_cluster

            found = self._ids_layout(group, deadline)
            if found is not None:
                return _ids_cluster.list_rows(
                    self, found, table, page_token, page_size, values, state, deadline
                )
            shard, part = self._rows_target(group, deadline)
            op = self._list_rows_op(
                part, table, page_token, page_size, values, state, deadline
            )
            result: RowsPage = self._run(op, shard)
            return result

        return _lazy(page)

    def _rows_target(self, group: str, deadline: Deadline) -> tuple[int, str]:
        """The shard and name of the one part ``list_rows`` asks about a group
        that is not split by id (a plain server: 0). A group split into parts of
        fixed tensors has no ids tables: refused here as its server would."""
        if self.shards is None:
            return 0, group
        from . import _sharded

        targets = _sharded.part_targets(self, group, deadline)
        if len(targets) != 1:
            raise InvalidArgumentError(
                f"group {group!r} has no ids tables: it is split into "
                f"{len(targets)} parts of fixed tensors, and list_rows lists the "
                "ids of an ids table",
                reason="UNKNOWN_TENSOR",
                metadata={"group": group},
            )
        return targets[0]

    # -- workers -------------------------------------------------------------------
    def join(
        self, group: str, *, worker_id: str | None = None, timeout: float | None = None
    ) -> LeaseInfo:
        """Join a group as a worker and keep the lease alive in the background
        (on a cluster: on every part of the group)."""
        wid = worker_id or self.client_id
        targets = self._lease_targets(group, timeout)
        lease = self._lease_call("JoinGroup", targets, wid, timeout)
        stop = threading.Event()
        interval = self._heartbeat_interval(lease)

        def beat() -> None:
            while not stop.wait(interval):
                for shard, name in targets:
                    try:
                        self._run(self._heartbeat_op(name, wid, interval), shard)
                    except ClientClosedError:
                        return
                    except RpcError as exc:
                        log.warning("heartbeat for %s in %s failed: %s", wid, name, exc)

        thread = threading.Thread(
            target=beat, name=f"onnxps-lease-{group}", daemon=True
        )
        with self._lock:
            old = self._heartbeats.pop(group, None)
            self._heartbeats[group] = (stop, thread)
        if old is not None:
            old[0].set()
        thread.start()
        return lease

    def leave(
        self, group: str, *, worker_id: str | None = None, timeout: float | None = None
    ) -> LeaseInfo:
        """Leave a group: stop the heartbeats and give the lease back."""
        with self._lock:
            beat = self._heartbeats.pop(group, None)
        if beat is not None:
            beat[0].set()
            beat[1].join(timeout=5)
        targets = self._lease_targets(group, timeout)
        wid = worker_id or self.client_id
        return self._lease_call("LeaveGroup", targets, wid, timeout)

    def _lease_targets(
        self, group: str, timeout: float | None
    ) -> list[tuple[int, str]]:
        if self.shards is None:
            return [(0, group)]
        from . import _sharded

        return _sharded.part_targets(self, group, self._deadline(timeout))

    def _lease_call(
        self,
        method: str,
        targets: Sequence[tuple[int, str]],
        worker_id: str,
        timeout: float | None,
    ) -> LeaseInfo:
        """Join or leave every part; the lease as the first part answered it."""
        if self.shards is None:
            lease_op = self._join_op if method == "JoinGroup" else self._leave_op
            return self._run(lease_op(targets[0][1], worker_id, timeout))
        deadline = self._deadline(timeout)
        request = pb.JoinGroupRequest if method == "JoinGroup" else pb.LeaveGroupRequest
        calls = [
            functools.partial(
                until_landed,
                functools.partial(
                    self._call,
                    method,
                    request(group=name, worker_id=worker_id),
                    deadline,
                    None,
                    shard,
                ),
                deadline,
            )
            for shard, name in targets
        ]
        return lease_info(fan_out(calls)[0])
