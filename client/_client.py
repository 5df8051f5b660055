"""The onnxps client: push and pull in the ONNX input and output ordering."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc
from onnxps.wire.encoding import EncodingRangeError

from ._cluster import fan_out
from ._datachannel import ChannelBroken
from ._discovery import follows
from ._errors import ClientClosedError, RpcError, surfaced
from ._ops import (
    Blocking,
    Call,
    Deadline,
    Effect,
    Op,
    Parallel,
    Pause,
    PushCall,
    Transfer,
    as_method,
    one_call,
)
from ._records import (
    GroupInfo,
    HistoryInfo,
    HistoryStep,
    LeaseInfo,
    PartInfo,
    PushResult,
    RewindInfo,
    SaveInfo,
    WorkerInfo,
)
from ._requests import ClientCore, State
from ._settings import channel_credentials, channel_options, multicallable

log = logging.getLogger("onnxps.client")

__all__ = [
    "Client",
    "GroupInfo",
    "LeaseInfo",
    "PartInfo",
    "HistoryInfo",
    "HistoryStep",
    "PushResult",
    "RewindInfo",
    "SaveInfo",
    "WorkerInfo",
]

Array = np.ndarray[Any, Any]
P = ParamSpec("P")
R = TypeVar("R")

BACKGROUND_PUSHES = 4  # threads of a client's background pushes


def _blocking(
    op: Callable[Concatenate[ClientCore, P], Op[R]],
) -> Callable[Concatenate[Client, P], R]:
    """A Client method that runs the shared operation ``op`` to its result (the
    Client's own ``op``, by name: on a cluster it routes the call)."""
    name = op.__name__

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        built: Op[R] = getattr(self, name)(*args, **kwargs)
        try:
            return self._run(built)
        except RpcError as exc:
            raise surfaced(exc, method.__name__)  # noqa: B904 (the same error)

    as_method(method, op, "Client")
    return method


def _unary_snapshot(client: Client, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``push_background``'s (group, *gradients), the gradient arrays copied when
    the push goes as one unary message (at most the stream threshold): the caller
    may change them as soon as the call returns. A streamed push's are not."""
    group, *gradients = args
    arrays = [g for g in gradients if isinstance(g, np.ndarray)]
    if sum(a.nbytes for a in arrays) > client.stream_threshold_bytes:
        return args
    return (group, *(g.copy() if isinstance(g, np.ndarray) else g for g in gradients))


def _in_background(
    op: Callable[Concatenate[ClientCore, P], Op[R]],
) -> Callable[Concatenate[Client, P], Future[R]]:
    """A Client method that builds ``op`` now and runs it on a background thread."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        return self._submit(op(self, *_unary_snapshot(self, args), **kwargs))

    as_method(method, op, "Client", "push_background")
    method.__doc__ = """Start ``push_detailed`` on a background thread and return its
    future at once, so the next step computes while this push travels.

    The push is built now: its deadline and seq start now, and a push of at most
    ``stream_threshold_bytes`` (1 MiB by default) has copied the gradients, so the
    next step may write into them at once; a larger one reads them as it sends,
    so leave them unchanged until the future is done. Bad arguments raise here.
    ``close()`` waits for pending pushes."""
    return method


class Client(ClientCore):
    """A connection to one onnxps server, or to a cluster of shards.

    ``address`` is ``"host:port"`` (one server) or a list of the shards' addresses
    in shard order (a cluster; docs/cluster.md): each call is routed to the shards
    holding its group, and a group whose X is larger than ``split_bytes`` is split
    across them. A host without a port (``"localhost"``) means port 50051, the one
    ``onnxps serve`` listens on.

    ``address`` may be ``"etcd://H:P[,H:P]/PREFIX"``: a replicated cluster, whose
    shard count and primaries are read from etcd and followed across failovers
    (docs/cluster.md, "Replicated shards"). ``"etcds://..."`` reads etcd over TLS:
    ``coordinator_ca`` (PEM file etcd's certificate chains to) and, when etcd asks
    for one, ``coordinator_cert`` and ``coordinator_key`` (this client's); none
    given, ``ONNXPS_COORDINATOR_CA``, ``_CERT`` and ``_KEY`` name them.

    ``frames="auto"`` (the default; ``"on"`` is the same) sends small Push and Pull
    calls (requests up to 1 MiB) as frames on a call channel beside gRPC, to a
    server that offers a data port (``onnxps serve`` does by default): the same
    checks, errors and exactly once, without gRPC's per-call cost
    (docs/transports.md, "Frame calls"); ``"off"`` sends every call over gRPC.

    ``address`` may also be ``"unix:///path/to.sock"`` (or ``"unix:relative"``): a
    server listening on a Unix socket. ``shared_memory`` chooses the same-host
    transport (docs/transports.md): ``"auto"`` (the default) moves the tensors of
    large pushes and pulls through /dev/shm when a hello proves client and server
    share host and user, and sends bytes over gRPC otherwise (logged once);
    ``"on"`` raises ``SharedMemoryError`` where it cannot work; ``"off"`` never
    uses it.

    Every call takes ``timeout=`` (seconds) and falls back to the client's default.
    It is one deadline for the whole call: every retry of the channel and every
    resend of a push happen within it. The channel is opened on first use; after
    ``close()`` (or leaving the ``with`` block) every call raises
    ``ClientClosedError``. ``AsyncClient`` is the same client for asyncio.
    """

    def _setup(self) -> None:
        super()._setup()
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, pb_grpc.ParameterServerServiceStub] = {}
        self._callables: dict[tuple[int, str], Any] = {}
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
        self._drop_pending()
        for stop, thread in beats:
            stop.set()
            thread.join(timeout=5)
        for channel in self._channels.values():
            channel.close()
        self._close_transports()

    def _get_stub(self, shard: int = 0) -> pb_grpc.ParameterServerServiceStub:
        with self._lock:
            self._check_open()
            stub = self._stubs.get(shard)
            if stub is None:
                address = self.addresses[shard]
                options = channel_options(
                    self._server_name_override, follows=self._discovery is not None
                )
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
        fn = self._callables.get((shard, name))
        if fn is not None and self._state is not State.CLOSED:
            return fn
        self._get_stub(shard)  # opens the channel (or raises: the client closed)
        fn = self._callables[(shard, name)] = multicallable(self._channels[shard], name)
        return fn

    def _run(self, op: Op[R]) -> R:
        """Perform an operation's effects with blocking calls; return its result.
        Stopped before the end, the operation is closed (``OpRun.abandon``)."""
        reply: Any = None
        error: Exception | None = None
        try:
            while True:
                try:
                    effect = op.send(reply) if error is None else op.throw(error)
                except StopIteration as stop:
                    result: R = stop.value
                    return result
                try:
                    reply, error = self._perform(effect), None
                except Exception as exc:  # raised in the operation, to handle
                    reply, error = None, exc
        except BaseException:
            op.close()
            raise

    def _perform(self, effect: Effect) -> Any:
        if isinstance(effect, Pause):
            time.sleep(effect.seconds)
            return None
        if isinstance(effect, Transfer):
            return self._transfer(effect)
        if isinstance(effect, Blocking):
            return effect.fn()
        if isinstance(effect, Parallel):
            return fan_out([functools.partial(self._run, op) for op in effect.ops])
        shard = effect.shard or 0
        while True:
            fn = self._method(effect.method, shard)
            timeout = effect.deadline.remaining()
            try:
                reply = fn(
                    effect.request(), timeout=timeout, metadata=self._metadatas[shard]
                )
                if effect.reader is None:
                    return reply
                reader = effect.reader()
                for msg in reply:
                    reader.add(msg)
                return reader.finish()
            except grpc.RpcError as exc:
                error = effect.error(exc)
                if not self._followed(shard, error, effect.deadline):
                    raise error from None

    def _followed(self, shard: int, error: Exception, deadline: Deadline) -> bool:
        """A replicated cluster's shard answered NOT_PRIMARY or UNAVAILABLE: wait for
        its primary in etcd and point the shard's channel there (True: resend)."""
        if self._discovery is None or deadline.remaining() <= 0.05:
            return False
        if not follows(error):
            return False
        time.sleep(min(0.05, deadline.remaining() / 2))
        end = time.monotonic() + max(0.0, deadline.remaining() - 0.05)
        address = self._discovery.primary(shard, end)
        if address is None:
            return False
        with self._lock:
            if self.addresses[shard] != address:
                self.addresses[shard] = address
                self.address = ",".join(self.addresses)
                channel = self._channels.pop(shard, None)
                self._stubs.pop(shard, None)
                for key in [k for k in self._callables if k[0] == shard]:
                    del self._callables[key]
                if channel is not None:
                    channel.close()
        return True

    def _transfer(self, t: Transfer) -> tuple[Any, Any]:
        """A unary call in flight while its frames cross the data channel."""
        call, ch = t.call, t.channel
        fn = self._method(call.method, call.shard or 0)
        future = fn.future(
            call.request(),
            timeout=call.deadline.remaining(),
            metadata=self._metadatas[call.shard or 0],
        )
        frame = None
        try:
            if t.send is not None:
                ch.send_frame(t.transfer_id, t.send, call.deadline.remaining())
            if t.receive:
                frame = ch.recv_frame(
                    t.transfer_id,
                    call.deadline.remaining(),
                    t.into,
                    t.widen,
                    t.widen_dtype,
                )
        except EncodingRangeError:  # met mid-frame: the server steps nothing
            ch.close()
            future.cancel()
            raise
        except (OSError, ChannelBroken) as exc:
            ch.close()
            try:  # the server's word on it, when it refused the call
                future.result(timeout=max(call.deadline.remaining(), 0.001))
            except grpc.RpcError as rpc:
                raise call.error(rpc) from None
            except grpc.FutureTimeoutError:
                future.cancel()
                expired = call.deadline.expired(call.what, "the data channel stalled")
                raise expired from None
            raise ChannelBroken(f"the data channel failed mid-call ({exc})") from None
        try:
            return future.result(), frame
        except grpc.RpcError as rpc:
            ch.close()
            raise call.error(rpc) from None

    def _call(
        self,
        method: str,
        request: Any,
        deadline: Deadline | float | None,
        what: str | None = None,
        shard: int = 0,
    ) -> Any:
        """One unary RPC to ``shard`` (``onnxps status`` asks each shard): its
        reply. ``deadline`` is the call's or a timeout for a call of its own."""
        if not isinstance(deadline, Deadline):
            deadline = self._deadline(deadline)
        what = what or f"{method} was not answered"
        call = Call(method, lambda: request, deadline, what, shard=shard)
        return self._run(one_call(call))

    # -- calls ---------------------------------------------------------------------
    # Each is the shared operation of ClientCore, run with blocking grpc calls (on a
    # cluster, its route sends it to the shards of its group).
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
    rewind = _blocking(ClientCore._rewind)
    fork = _blocking(ClientCore._fork)
    history = _blocking(ClientCore._history)
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

    # -- workers -------------------------------------------------------------------
    def join(
        self, group: str, *, worker_id: str | None = None, timeout: float | None = None
    ) -> LeaseInfo:
        """Join a group as a worker and keep the lease alive in the background
        (on a cluster: on every part of the group)."""
        wid = worker_id or self.client_id
        targets, lease = self._run(self._join_parts(group, wid, timeout))
        stop = threading.Event()
        interval = self._heartbeat_interval(lease)

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self._run(self._heartbeats_op(targets, wid, interval))
                except ClientClosedError:
                    return

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
        wid = worker_id or self.client_id
        return self._run(self._leave_parts(group, wid, timeout))
