"""``AsyncClient``: the onnxps client for asyncio, on ``grpc.aio``.

The same calls, arguments, results, exceptions and deadlines as ``Client``: both
perform the operations of ``_requests.ClientCore``; only the way an RPC is made
differs. Cancelling the task of a call cancels its RPC, and the server lets go of
it at once (a waiting ``pull(min_version=...)`` or sync push frees its wait).
"""

from __future__ import annotations

import asyncio
import enum
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

import grpc
import grpc.aio
import numpy as np
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from ._errors import ClientClosedError, RpcError
from ._optimizers import Async, OptimizerSpec, Sync
from ._records import GroupInfo, LeaseInfo, PushResult, SaveInfo
from ._requests import (
    Call,
    ClientCore,
    Op,
    OpRun,
    Pause,
    channel_credentials,
    channel_options,
    log,
    push_reply,
)
from ._transfer import export_op, import_op

__all__ = ["AsyncClient"]

Array = np.ndarray[Any, Any]
R = TypeVar("R")


class _State(enum.Enum):
    UNOPENED = 1
    OPEN = 2
    CLOSED = 3


class AsyncClient(ClientCore):
    """A connection to one onnxps server, for asyncio: every call is a coroutine.

    Takes the arguments of ``Client`` and behaves the same (one deadline per call,
    exactly-once resends of a push, TLS and tokens, unary or chunked streams by
    size). Use it as ``async with AsyncClient(address) as ps:``; the channel opens
    on the first call, in the running event loop.
    """

    def _setup(self) -> None:
        self._state = _State.UNOPENED
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ParameterServerServiceStub | None = None
        self._heartbeats: dict[str, asyncio.Task[None]] = {}

    # -- lifecycle -----------------------------------------------------------------
    async def __aenter__(self) -> AsyncClient:
        if self._state is _State.CLOSED:
            raise ClientClosedError("this client was closed; create a new AsyncClient")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop heartbeats, close the channel; later calls raise ClientClosedError."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        beats = list(self._heartbeats.values())
        self._heartbeats.clear()
        for task in beats:
            task.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    def _method(self, name: str) -> Any:
        if self._state is _State.CLOSED:
            raise ClientClosedError("this client was closed; create a new AsyncClient")
        if self._stub is None:
            options = channel_options(self._server_name_override)
            creds = channel_credentials(self._tls)
            if creds is not None:
                self._channel = grpc.aio.secure_channel(self.address, creds, options)
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options)
            self._stub = pb_grpc.ParameterServerServiceStub(self._channel)
            self._state = _State.OPEN
        return getattr(self._stub, name)

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

    # -- groups --------------------------------------------------------------------
    async def create_group(
        self,
        name: str,
        optimizer: OptimizerSpec,
        *,
        learning_rate: float,
        tensors: Mapping[str, Any] | Sequence[tuple[str, Any]],
        consistency: Async | Sync | None = None,
        allow_non_finite: bool = False,
        state: Sequence[Any] | None = None,
        update_count: int = 0,
        lease_seconds: float | None = None,
        timeout: float | None = None,
    ) -> GroupInfo:
        """See ``Client.create_group``."""
        op = self._create_group_op(
            name,
            optimizer,
            learning_rate,
            tensors,
            consistency,
            allow_non_finite,
            state,
            update_count,
            lease_seconds,
            timeout,
        )
        return await self._run(op)

    async def describe_group(
        self, name: str, *, timeout: float | None = None
    ) -> GroupInfo:
        return await self._run(self._describe_group_op(name, self._deadline(timeout)))

    async def list_groups(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> list[GroupInfo]:
        return await self._run(self._list_groups_op(prefix, timeout))

    async def delete_group(self, name: str, *, timeout: float | None = None) -> bool:
        return await self._run(self._delete_group_op(name, timeout))

    async def set_learning_rate(
        self, name: str, learning_rate: float, *, timeout: float | None = None
    ) -> GroupInfo:
        return await self._run(self._set_learning_rate_op(name, learning_rate, timeout))

    # -- push ----------------------------------------------------------------------
    @overload
    async def push(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = ...,
        learning_rate: float | None = ...,
        return_values: Literal[False] = ...,
        timeout: float | None = ...,
    ) -> int: ...

    @overload
    async def push(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = ...,
        learning_rate: float | None = ...,
        return_values: Literal[True],
        timeout: float | None = ...,
    ) -> list[Array]: ...

    async def push(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = None,
        learning_rate: float | None = None,
        return_values: bool = False,
        timeout: float | None = None,
    ) -> int | list[Array]:
        """See ``Client.push``. The push (its seq, deadline and, unary, its bytes) is
        built when the coroutine starts."""
        op = self._push_op(
            group, gradients, base_version, learning_rate, return_values, timeout
        )
        return push_reply(await self._run(op), return_values)

    async def push_detailed(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = None,
        learning_rate: float | None = None,
        return_values: bool = False,
        timeout: float | None = None,
    ) -> PushResult:
        """See ``Client.push_detailed``."""
        op = self._push_op(
            group, gradients, base_version, learning_rate, return_values, timeout
        )
        return await self._run(op)

    # -- pull ----------------------------------------------------------------------
    async def pull(
        self,
        group: str,
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> list[Array]:
        """See ``Client.pull``."""
        return (await self._run(self._pull_op(group, state, min_version, timeout)))[1]

    async def pull_versioned(
        self,
        group: str,
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> tuple[int, list[Array]]:
        """See ``Client.pull_versioned``."""
        return await self._run(self._pull_op(group, state, min_version, timeout))

    # -- apply ---------------------------------------------------------------------
    async def apply(
        self, optimizer: OptimizerSpec, *inputs: Any, timeout: float | None = None
    ) -> list[Array]:
        """See ``Client.apply``."""
        return await self._run(self._apply_op(optimizer, inputs, timeout))

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

    # -- durability ----------------------------------------------------------------
    async def save(self, *, timeout: float | None = None) -> SaveInfo:
        """See ``Client.save``."""
        return await self._run(self._save_op(timeout))

    async def export(self, path: str | os.PathLike[str], prefix: str = "") -> list[str]:
        """See ``Client.export`` (the file is written from the event loop)."""
        return await self._run(export_op(self, path, prefix))

    async def import_(self, path: str | os.PathLike[str]) -> list[str]:
        """See ``Client.import_``."""
        return await self._run(import_op(self, path))
