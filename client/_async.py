"""``AsyncClient``: the onnxps client for asyncio, on ``grpc.aio``.

The same calls, arguments, results, exceptions and deadlines as ``Client``: both
perform the operations of ``_requests.ClientCore``; only the way an RPC is made
differs. Cancelling the task of a call cancels its RPC, and the server lets go of
it at once (a waiting ``pull(min_version=...)`` or sync push frees its wait).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import grpc
import grpc.aio
import numpy as np
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from ._errors import ClientClosedError, RpcError
from ._records import LeaseInfo
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
    multicallable,
)

__all__ = ["AsyncClient"]

Array = np.ndarray[Any, Any]
P = ParamSpec("P")
R = TypeVar("R")
_Awaited = Coroutine[Any, Any, R]


def _awaiting(
    op: Callable[Concatenate[ClientCore, P], Op[R]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]]:
    """An AsyncClient method that runs the shared operation ``op`` to its result."""

    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self._run(op(self, *args, **kwargs))

    as_method(method, op, "AsyncClient")
    return method


class AsyncClient(ClientCore):
    """A connection to one onnxps server, for asyncio: every call is a coroutine.

    Takes the arguments of ``Client`` and behaves the same (one deadline per call,
    exactly-once resends of a push, TLS and tokens, unary or chunked streams by
    size). Use it as ``async with AsyncClient(address) as ps:``; the channel opens
    on the first call, in the running event loop.
    """

    def _setup(self) -> None:
        if self.shards is not None:
            raise ValueError(
                "AsyncClient talks to one server; a cluster needs Client for now "
                f"(got {self.shards} shard addresses)"
            )
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ParameterServerServiceStub | None = None
        self._callables: dict[str, Any] = {}
        self._heartbeats: dict[str, asyncio.Task[None]] = {}

    # -- lifecycle -----------------------------------------------------------------
    async def __aenter__(self) -> AsyncClient:
        self._check_open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop heartbeats, close the channel; later calls raise ClientClosedError."""
        if self._state is State.CLOSED:
            return
        self._state = State.CLOSED
        beats = list(self._heartbeats.values())
        self._heartbeats.clear()
        for task in beats:
            task.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close(None)
        self._close_shared_memory()

    def _method(self, name: str) -> Any:
        self._check_open()
        if self._stub is None:
            options = channel_options(self._server_name_override)
            creds = channel_credentials(self._tls)
            if creds is not None:
                self._channel = grpc.aio.secure_channel(self.address, creds, options)
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options)
            self._stub = pb_grpc.ParameterServerServiceStub(self._channel)
            self._state = State.OPEN
        fn = self._callables.get(name)
        if fn is None:
            fn = self._callables[name] = multicallable(self._channel, name)
        return fn

    async def _run(self, op: Op[R]) -> R:
        """Perform an operation's effects as coroutines; return its result."""
        run = OpRun(op)
        while (effect := run.next_effect()) is not None:
            try:
                run.reply(await self._perform(effect))
            except RpcError as exc:
                run.fail(exc)
        result: R = run.result
        return result

    async def _perform(self, effect: Call | Pause) -> Any:
        if isinstance(effect, Pause):
            await asyncio.sleep(effect.seconds)
            return None
        fn = self._method(effect.method)
        timeout = effect.deadline.remaining()
        try:
            call = fn(effect.request(), timeout=timeout, metadata=self._metadata())
            if effect.reader is None:
                return await call
            reader = effect.reader()
            async for msg in call:
                reader.add(msg)
            return reader.finish()
        except grpc.RpcError as exc:
            raise effect.error(exc) from None

    # -- calls ---------------------------------------------------------------------
    # Each is the shared operation of ClientCore, run with grpc.aio calls.
    create_group = _awaiting(ClientCore._create_group)
    describe_group = _awaiting(ClientCore._describe_group)
    list_groups = _awaiting(ClientCore._list_groups)
    delete_group = _awaiting(ClientCore._delete_group)
    set_learning_rate = _awaiting(ClientCore._set_learning_rate)
    push_detailed = _awaiting(ClientCore._push_detailed)
    pull = _awaiting(ClientCore._pull)
    pull_versioned = _awaiting(ClientCore._pull_versioned)
    push_rows = _awaiting(ClientCore._push_rows)
    pull_rows = _awaiting(ClientCore._pull_rows)
    list_rows = _awaiting(ClientCore._list_rows)
    count_rows = _awaiting(ClientCore._count_rows)
    export_rows = _awaiting(ClientCore._export_rows)
    apply = _awaiting(ClientCore._apply)
    save = _awaiting(ClientCore._save)
    export = _awaiting(ClientCore._export)  # writes the file from the event loop
    import_ = _awaiting(ClientCore._import_)
    tensor_buffers = _awaiting(ClientCore._tensor_buffers)

    # the runner's type has self; the annotation is the type callers see
    push: PushCall[Coroutine[Any, Any, int], Coroutine[Any, Any, list[Array]]] = cast(
        Any, _awaiting(ClientCore._push)
    )

    # -- workers -------------------------------------------------------------------
    async def join(
        self, group: str, *, worker_id: str | None = None, timeout: float | None = None
    ) -> LeaseInfo:
        """Join a group as a worker; a task of the event loop keeps the lease."""
        wid = worker_id or self.client_id
        lease = await self._run(self._join_op(group, wid, timeout))
        interval = self._heartbeat_interval(lease)

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self._run(self._heartbeat_op(group, wid, interval))
                except ClientClosedError:
                    return
                except RpcError as exc:
                    log.warning("heartbeat for %s in %s failed: %s", wid, group, exc)

        old = self._heartbeats.pop(group, None)
        if old is not None:
            old.cancel()
        self._heartbeats[group] = asyncio.create_task(beat())
        return lease

    async def leave(
        self, group: str, *, worker_id: str | None = None, timeout: float | None = None
    ) -> LeaseInfo:
        """Leave a group: stop the heartbeats and give the lease back."""
        beat = self._heartbeats.pop(group, None)
        if beat is not None:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
        wid = worker_id or self.client_id
        return await self._run(self._leave_op(group, wid, timeout))
