"""The onnxps client: push and pull in the ONNX input and output ordering."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from ._errors import ClientClosedError, RpcError
from ._records import GroupInfo, LeaseInfo, PushResult, SaveInfo, WorkerInfo
from ._requests import (
    Call,
    ClientCore,
    Op,
    OpRun,
    Pause,
    PushCall,
    State,
    as_method,
    channel_credentials,
    channel_options,
    log,
)

__all__ = [
    "Client",
    "GroupInfo",
    "LeaseInfo",
    "PushResult",
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
    """A Client method that runs the shared operation ``op`` to its result."""

    def method(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(op(self, *args, **kwargs))

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
    """A connection to one onnxps server.

    Every call takes ``timeout=`` (seconds) and falls back to the client's default.
    It is one deadline for the whole call: every retry of the channel and every
    resend of a push happen within it. The channel is opened on first use; after
    ``close()`` (or leaving the ``with`` block) every call raises
    ``ClientClosedError``. ``AsyncClient`` is the same client for asyncio.
    """

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.ParameterServerServiceStub | None = None
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
        if self._channel is not None:
            self._channel.close()

    def _get_stub(self) -> pb_grpc.ParameterServerServiceStub:
        with self._lock:
            self._check_open()
            if self._stub is None:
                options = channel_options(self._server_name_override)
                creds = channel_credentials(self._tls)
                if creds is not None:
                    self._channel = grpc.secure_channel(self.address, creds, options)
                else:
                    self._channel = grpc.insecure_channel(self.address, options)
                self._stub = pb_grpc.ParameterServerServiceStub(self._channel)
                self._state = State.OPEN
            return self._stub

    def _method(self, name: str) -> Any:
        stub = self._get_stub()
        return getattr(stub, name)

    def _run(self, op: Op[R]) -> R:
        """Perform an operation's effects with blocking calls; return its result."""
        run = OpRun(op)
        while (effect := run.next_effect()) is not None:
            try:
                run.reply(self._perform(effect))
            except RpcError as exc:
                run.fail(exc)
        result: R = run.result
        return result

    def _perform(self, effect: Call | Pause) -> Any:
        if isinstance(effect, Pause):
            time.sleep(effect.seconds)
            return None
        fn = self._method(effect.method)
        timeout = effect.deadline.remaining()
        try:
            reply = fn(effect.request(), timeout=timeout, metadata=self._metadata())
            if effect.reader is None:
                return reply
            reader = effect.reader()
            for msg in reply:
                reader.add(msg)
            return reader.finish()
        except grpc.RpcError as exc:
            raise effect.error(exc) from None

    # -- calls ---------------------------------------------------------------------
    # Each is the shared operation of ClientCore, run with blocking grpc calls.
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
    apply = _blocking(ClientCore._apply)
    save = _blocking(ClientCore._save)
    export = _blocking(ClientCore._export)
    import_ = _blocking(ClientCore._import_)

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
        """Join a group as a worker and keep the lease alive in the background."""
        wid = worker_id or self.client_id
        lease = self._run(self._join_op(group, wid, timeout))
        stop = threading.Event()
        interval = self._heartbeat_interval(lease)

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self._run(self._heartbeat_op(group, wid, interval))
                except ClientClosedError:
                    return
                except RpcError as exc:
                    log.warning("heartbeat for %s in %s failed: %s", wid, group, exc)

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
        return self._run(self._leave_op(group, worker_id or self.client_id, timeout))
