"""``AsyncClient``: the onnxps client for asyncio, on ``grpc.aio``.

The same calls, arguments, results, exceptions and deadlines as ``Client``, on one
server or a cluster of shards: both perform the operations of
``_requests.ClientCore``, routed by ``_routes``; only the way an RPC is
made differs (and the calls of a cluster's parts run as tasks, not threads).
Cancelling the task of a call cancels its RPCs (every shard's), and the servers let
go of them at once (a waiting ``pull(min_version=...)`` or sync push frees its
wait).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import grpc
import grpc.aio
import numpy as np
from onnxps.wire.encoding import EncodingRangeError

from ._datachannel import ChannelBroken
from ._discovery import follows
from ._errors import ClientClosedError, RpcError, surfaced
from ._ops import (
    Blocking,
    Effect,
    Op,
    OpRun,
    Parallel,
    Pause,
    PushCall,
    Transfer,
    as_method,
)
from ._records import LeaseInfo
from ._requests import ClientCore, State
from ._settings import channel_credentials, channel_options, multicallable

__all__ = ["AsyncClient"]

Array = np.ndarray[Any, Any]
P = ParamSpec("P")
R = TypeVar("R")
_Awaited = Coroutine[Any, Any, R]


def _awaiting(
    op: Callable[Concatenate[ClientCore, P], Op[R]],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]]:
    """An AsyncClient method that runs the shared operation ``op`` to its result
    (the client's own ``op``, by name: on a cluster it routes the call)."""
    name = op.__name__

    async def method(self: AsyncClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        built: Op[R] = getattr(self, name)(*args, **kwargs)
        try:
            return await self._run(built)
        except RpcError as exc:
            raise surfaced(exc, method.__name__)  # noqa: B904 (the same error)

    as_method(method, op, "AsyncClient")
    return method


class AsyncClient(ClientCore):
    """A connection to one onnxps server, or to a cluster of shards, for asyncio:
    every call is a coroutine.

    Takes the arguments of ``Client`` and behaves the same (one deadline per call,
    exactly-once resends of a push, TLS and tokens, unary or chunked streams by
    size, a list of shard addresses routed as ``Client`` routes it, frames on a
    call channel by default, their socket's steps in a worker thread).
    Use it as
    ``async with AsyncClient(address) as ps:``; the channels open on first use, in
    the running event loop.
    """

    def _setup(self) -> None:
        super()._setup()
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._callables: dict[tuple[int, str], Any] = {}
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
        self._drop_pending()
        for task in beats:
            task.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        channels = list(self._channels.values())
        self._channels.clear()
        for channel in channels:
            await channel.close(None)
        self._close_transports()

    def _method(self, name: str, shard: int = 0) -> Any:
        self._check_open()
        channel = self._channels.get(shard)
        if channel is None:
            address = self.addresses[shard]
            options = channel_options(
                self._server_name_override, follows=self._discovery is not None
            )
            creds = channel_credentials(self._tls)
            if creds is not None:
                channel = grpc.aio.secure_channel(address, creds, options)
            else:
                channel = grpc.aio.insecure_channel(address, options)
            self._channels[shard] = channel
            self._state = State.OPEN
        key = (shard, name)
        fn = self._callables.get(key)
        if fn is None:
            fn = self._callables[key] = multicallable(channel, name)
        return fn

    async def _run(self, op: Op[R]) -> R:
        """Perform an operation's effects as coroutines; return its result."""
        run = OpRun(op)
        try:
            while (effect := run.next_effect()) is not None:
                try:
                    run.reply(await self._perform(effect))
                except Exception as exc:  # raised in the operation, to handle
                    run.fail(exc)
        except BaseException:  # asyncio.CancelledError: the operation is closed
            run.abandon()
            raise
        result: R = run.result
        return result

    async def _parallel(self, ops: tuple[Op[Any], ...]) -> list[Any]:
        """Run ``ops`` as tasks; their results, or the first failure in order once
        every one ended. Cancelled, it cancels them all (and so their RPCs)."""
        if len(ops) == 1:
            return [await self._run(ops[0])]

        async def outcome(op: Op[Any]) -> tuple[bool, Any]:
            # an op may return an exception as its value (``_sharded.attempt``):
            # only what it raised is a failure
            try:
                return True, await self._run(op)
            except Exception as exc:
                return False, exc

        results = await asyncio.gather(*(outcome(op) for op in ops))
        for ok, r in results:
            if not ok:
                raise r
        return [r for _, r in results]

    async def _perform(self, effect: Effect) -> Any:
        if isinstance(effect, Pause):
            await asyncio.sleep(effect.seconds)
            return None
        if isinstance(effect, Parallel):
            return await self._parallel(effect.ops)
        if isinstance(effect, Transfer):
            return await self._transfer(effect)
        if isinstance(effect, Blocking):
            try:
                return await asyncio.to_thread(effect.fn)
            except asyncio.CancelledError:
                if effect.cancel is not None:
                    effect.cancel()
                raise
        shard = effect.shard or 0
        while True:
            fn = self._method(effect.method, shard)
            timeout = effect.deadline.remaining()
            try:
                call = fn(
                    effect.request(), timeout=timeout, metadata=self._metadatas[shard]
                )
                if effect.reader is None:
                    return await call
                reader = effect.reader()
                async for msg in call:
                    reader.add(msg)
                return reader.finish()
            except grpc.RpcError as exc:
                error = effect.error(exc)
                if not await self._followed(shard, error, effect.deadline):
                    raise error from None

    async def _followed(self, shard: int, error: Exception, deadline: Any) -> bool:
        """As ``Client._followed``: a replicated cluster's shard refused with
        NOT_PRIMARY or UNAVAILABLE; point it at the primary etcd names (True:
        resend)."""
        discovery = self._discovery
        if discovery is None or deadline.remaining() <= 0.05 or not follows(error):
            return False
        await asyncio.sleep(min(0.05, deadline.remaining() / 2))
        end = time.monotonic() + max(0.0, deadline.remaining() - 0.05)
        address = await asyncio.to_thread(discovery.primary, shard, end)
        if address is None:
            return False
        if self.addresses[shard] != address:
            self.addresses[shard] = address
            self.address = ",".join(self.addresses)
            channel = self._channels.pop(shard, None)
            for key in [k for k in self._callables if k[0] == shard]:
                del self._callables[key]
            if channel is not None:
                await channel.close(None)
        return True

    async def _transfer(self, t: Transfer) -> tuple[Any, Any]:
        """A unary call in flight while a worker thread moves its frames across
        the data channel (closed if the task is cancelled, which ends the IO)."""
        call, ch = t.call, t.channel
        shard = call.shard or 0
        fn = self._method(call.method, shard)
        rpc = fn(
            call.request(),
            timeout=call.deadline.remaining(),
            metadata=self._metadatas[shard],
        )

        def frames() -> Any:
            if t.send is not None:
                ch.send_frame(t.transfer_id, t.send, call.deadline.remaining())
            if t.receive:
                return ch.recv_frame(
                    t.transfer_id,
                    call.deadline.remaining(),
                    t.into,
                    t.widen,
                    t.widen_dtype,
                )
            return None

        try:
            frame = await asyncio.to_thread(frames)
        except EncodingRangeError:  # met mid-frame: the server steps nothing
            ch.close()
            rpc.cancel()
            raise
        except (OSError, ChannelBroken) as exc:
            ch.close()
            try:  # the server's word on it, when it refused the call
                left = max(call.deadline.remaining(), 0.001)
                await asyncio.wait_for(rpc, left)
            except grpc.RpcError as err:
                raise call.error(err) from None
            except TimeoutError:
                rpc.cancel()
                expired = call.deadline.expired(call.what, "the data channel stalled")
                raise expired from None
            raise ChannelBroken(f"the data channel failed mid-call ({exc})") from None
        except asyncio.CancelledError:
            ch.close()
            rpc.cancel()
            raise
        try:
            return await rpc, frame
        except grpc.RpcError as err:
            ch.close()
            raise call.error(err) from None
        except asyncio.CancelledError:
            ch.close()
            raise

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
    rewind = _awaiting(ClientCore._rewind)
    fork = _awaiting(ClientCore._fork)
    history = _awaiting(ClientCore._history)
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
        """Join a group as a worker (on a cluster: every part of it); a task of the
        event loop keeps the lease."""
        wid = worker_id or self.client_id
        targets, lease = await self._run(self._join_parts(group, wid, timeout))
        interval = self._heartbeat_interval(lease)

        async def beat() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self._run(self._heartbeats_op(targets, wid, interval))
                except ClientClosedError:
                    return

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
        return await self._run(self._leave_parts(group, wid, timeout))
