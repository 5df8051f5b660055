"""The onnxps client: push and pull in the ONNX input and output ordering."""

from __future__ import annotations

import enum
import functools
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, TypeVar, overload

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.v1 import parameter_server_pb2_grpc as pb_grpc

from ._cluster import SHARD_METADATA_KEY, Layout, fan_out
from ._errors import (
    ClientClosedError,
    DeadlineExceededError,
    RpcError,
    UnavailableError,
    translate,
)
from ._optimizers import Adagrad, Adam, Async, Momentum, OptimizerSpec, Sync
from .codec import (
    CHUNK_BYTES,
    PROTO_TO_DTYPE,
    SERVICE,
    TensorAssembler,
    chunk_messages,
    header_tensor,
    tensor_to_array,
    write_tensor,
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

log = logging.getLogger("onnxps.client")

Array = np.ndarray[Any, Any]
Transport = Literal["auto", "unary", "stream"]

STREAM_THRESHOLD_BYTES = 1 << 20
SPLIT_BYTES = 64 << 20  # a cluster splits a group whose X is larger
_RESEND_BACKOFF_MAX = 2.0  # seconds between a push's resends, at most

# The one retry mechanism for every call: the channel retries UNAVAILABLE (the server
# is down or draining), within the call's deadline. A push is also resent, with the
# same (client_id, seq), while UNAVAILABLE reaches the client after the channel gave
# up (e.g. a stream the channel cannot replay), until its deadline: the server applies
# it exactly once. The calls that are safe to repeat (reads, and pushes, which the
# server deduplicates) are also retried on CANCELLED: a server that stops cancels the
# calls it had received but not yet started, and none of them ran.
_SAFE_TO_REPEAT = (
    "Push",
    "PushStream",
    "Pull",
    "PullStream",
    "DescribeGroup",
    "ListGroups",
    "Heartbeat",
    "Apply",
    "ApplyStream",
)


def _retry_policy(*codes: str) -> dict[str, Any]:
    return {
        "maxAttempts": 5,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": list(codes),
    }


_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE, "method": m} for m in _SAFE_TO_REPEAT],
            "retryPolicy": _retry_policy("UNAVAILABLE", "CANCELLED"),
        },
        {
            "name": [{"service": SERVICE}],
            "retryPolicy": _retry_policy("UNAVAILABLE"),
        },
    ]
}
# A restarted server is found within about two seconds (gRPC's default reconnect
# backoff grows to two minutes, longer than any push waits).
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", json.dumps(_SERVICE_CONFIG)),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    alive: bool
    lease_remaining_seconds: float


@dataclass(frozen=True)
class PartInfo:
    """One part of a group on a cluster (an unsplit group has one)."""

    name: str  # the group's name on that shard
    shard: int
    address: str
    update_count: int
    element_count: int


@dataclass(frozen=True)
class GroupInfo:
    name: str
    optimizer: OptimizerSpec
    learning_rate: float
    update_count: int
    dtype: np.dtype[Any]
    tensors: list[tuple[str, tuple[int, ...]]]
    consistency: Async | Sync
    allow_non_finite: bool
    element_count: int
    state_bytes: int
    lease_seconds: float
    workers: list[WorkerInfo] = field(default_factory=list)
    pending_contributions: int = 0
    quorum: int = 0
    parts: tuple[PartInfo, ...] = ()  # on a cluster: where its elements live

    @property
    def nbytes(self) -> int:
        """Bytes of X_1..X_n (one pull without state, one push)."""
        return self.element_count * self.dtype.itemsize


@dataclass(frozen=True)
class PushResult:
    update_count: int  # T after the push (sync: T when it was buffered)
    applied: bool  # False: buffered until the sync quorum pushes
    duplicate: bool  # a retry the server had already taken
    values: list[Array] | None = None  # X_1..X_n when asked for


@dataclass(frozen=True)
class LeaseInfo:
    """A worker's lease on a group, as the server answered join or leave."""

    lease_seconds: float  # renew before this runs out
    update_count: int
    live_workers: int
    quorum: int


@dataclass(frozen=True)
class SaveInfo:
    """The snapshot the server wrote on ``save``."""

    path: str
    groups: int
    bytes: int


class _Deadline:
    """One absolute deadline for a whole call, whatever it sends and resends."""

    __slots__ = ("at", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self, what: str, details: str) -> DeadlineExceededError:
        why = f"{what} within {self.seconds:g} s"
        if details and details.lower() != "deadline exceeded":
            why += f" ({details})"
        return DeadlineExceededError(why)


R = TypeVar("R")
_PartPush = tuple[int, pb.PushRequest, list[Array]]  # shard, request, gradients


def until_landed(call: Callable[[], R], deadline: _Deadline) -> R:
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


def _lease_info(msg: Any) -> LeaseInfo:
    return LeaseInfo(msg.lease_seconds, msg.update_count, msg.live_workers, msg.quorum)


def _optimizer_from_proto(spec: pb.OptimizerSpec) -> OptimizerSpec:
    kind = spec.WhichOneof("kind")
    if kind == "adagrad":
        a = spec.adagrad
        return Adagrad(a.epsilon, a.decay_factor, a.norm_coefficient)
    if kind == "momentum":
        m = spec.momentum
        mode: Literal["standard", "nesterov"] = (
            "nesterov" if m.mode == "nesterov" else "standard"
        )
        return Momentum(m.alpha, m.beta, mode, m.norm_coefficient)
    d = spec.adam
    return Adam(d.alpha, d.beta, d.epsilon, d.norm_coefficient, d.norm_coefficient_post)


def _group_info(msg: pb.GroupInfo) -> GroupInfo:
    c = msg.consistency
    consistency: Async | Sync
    if c.mode == pb.CONSISTENCY_MODE_SYNC:
        consistency = Sync(
            c.sync_workers, "sum" if c.reduction == pb.REDUCTION_SUM else "mean"
        )
    else:
        consistency = Async(c.max_staleness if c.HasField("max_staleness") else None)
    return GroupInfo(
        name=msg.name,
        optimizer=_optimizer_from_proto(msg.optimizer),
        learning_rate=msg.learning_rate,
        update_count=msg.update_count,
        dtype=PROTO_TO_DTYPE[msg.dtype].newbyteorder("="),
        tensors=[(t.name, tuple(t.dims)) for t in msg.tensors],
        consistency=consistency,
        allow_non_finite=msg.allow_non_finite,
        element_count=msg.element_count,
        state_bytes=msg.state_bytes,
        lease_seconds=msg.lease_seconds,
        workers=[
            WorkerInfo(w.worker_id, w.alive, w.lease_remaining_seconds)
            for w in msg.workers
        ],
        pending_contributions=msg.pending_contributions,
        quorum=msg.quorum,
    )


_RESEND_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


_TRANSPORTS = ("auto", "unary", "stream")


def _check_client_arguments(
    address: Any,
    timeout: Any,
    transport: Any,
    chunk_bytes: Any,
    unexpected: Mapping[str, Any],
) -> None:
    """TypeError/ValueError that say what ``Client(...)`` takes."""
    if unexpected:
        names = ", ".join(sorted(unexpected))
        raise TypeError(
            f"Client() got unexpected argument(s) {names}: it takes the server address "
            "('host:port') and connection options (timeout=, token=, TLS, "
            "transport=); tensors are given to create_group(), gradients to push()"
        )
    if isinstance(address, list | tuple) and address:  # a cluster's shards
        bad = [a for a in address if not (isinstance(a, str) and a.strip())]
        if bad:
            raise TypeError(
                "Client(address): the server's 'host:port' as a string, or a "
                "cluster's shards as a list of them in shard order; the list holds "
                f"{type(bad[0]).__name__}"
            )
    elif not isinstance(address, str) or not address.strip():
        raise TypeError(
            f"Client(address): the server's 'host:port' as a string, e.g. "
            f"Client('127.0.0.1:50051'), or a cluster's shards as a list of them, "
            f"got {type(address).__name__}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout is seconds (a number), got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if transport not in _TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(_TRANSPORTS)}, got {transport!r}"
        )
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an integer >= 1, got {chunk_bytes!r}")


def _spec(value: Any, what: str, kind: Any = (Async, Sync)) -> Any:
    """``value`` when it is an instance of ``kind`` (or has its ``to_proto``); else
    a TypeError that says so (the class itself, ``Adam`` for ``Adam()``, is the usual
    slip)."""
    if isinstance(value, type):
        raise TypeError(
            f"{what} must be an instance, e.g. {value.__name__}(), not the class "
            f"{value.__name__}"
        )
    if not isinstance(value, kind) and not callable(getattr(value, "to_proto", None)):
        names = (
            "Adagrad(), Momentum(), Nesterov() or Adam()"
            if kind is OptimizerSpec
            else "Async() or Sync(workers)"
        )
        raise TypeError(f"{what} must be one of {names}, got {value!r}")
    return value


def _named_tensors(tensors: Any) -> list[tuple[str, Any]]:
    """``{name: array}`` or ``[(name, array), ...]`` as a list of pairs."""
    if isinstance(tensors, Mapping):
        items = list(tensors.items())
    elif isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        items = None
    else:
        items = list(tensors)
    if items is None or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in items
    ):
        raise TypeError(
            "tensors must name each tensor, in the ONNX order: {'w': w0, 'b': b0} "
            "or [('w', w0), ('b', b0)]"
        )
    return items


class _State(enum.Enum):
    UNOPENED = 1
    OPEN = 2
    CLOSED = 3


class Client:
    """A connection to one onnxps server, or to a cluster of shards.

    ``address`` is ``"host:port"`` (one server) or a list of the shards' addresses
    in shard order (a cluster; README "A cluster of shards"): each call is routed
    to the shards holding its group, and a group whose X is larger than
    ``split_bytes`` is split across them.

    Every call takes ``timeout=`` (seconds) and falls back to the client's default.
    It is one deadline for the whole call: every retry of the channel and every
    resend of a push happen within it. The channel is opened on first use; after
    ``close()`` (or leaving the ``with`` block) every call raises
    ``ClientClosedError``.
    """

    def __init__(
        self,
        address: str | Sequence[str] = "",  # required: a default only to say so
        *,
        timeout: float = 60.0,
        client_id: str | None = None,
        token: str | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        server_name_override: str | None = None,
        transport: Transport = "auto",
        stream_threshold_bytes: int = STREAM_THRESHOLD_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        split_bytes: int = SPLIT_BYTES,
        **unexpected: NoReturn,
    ) -> None:
        _check_client_arguments(address, timeout, transport, chunk_bytes, unexpected)
        if root_certificates is not None and not isinstance(root_certificates, bytes):
            raise TypeError(
                "root_certificates is the PEM bytes of the CA, not a path: pass "
                "open(path, 'rb').read()"
            )
        # A list of addresses is a cluster: shard i at addresses[i] (README, "A
        # cluster of shards").
        self.addresses = [address] if isinstance(address, str) else list(address)
        self.address = ",".join(self.addresses)
        self.shards: int | None = (
            None if isinstance(address, str) else len(self.addresses)
        )
        self.split_bytes = split_bytes
        self.timeout = timeout
        self.client_id = client_id or uuid.uuid4().hex
        self.transport: Transport = transport
        self.stream_threshold_bytes = stream_threshold_bytes
        self.chunk_bytes = chunk_bytes
        self._token = token
        self._tls = (root_certificates, private_key, certificate_chain)
        self._secure = root_certificates is not None or certificate_chain is not None
        self._server_name_override = server_name_override
        self._state = _State.UNOPENED
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._stubs: dict[int, pb_grpc.ParameterServerServiceStub] = {}
        self._layouts: dict[str, Layout] = {}
        # group -> the parts of a push that did not land (sent first by the next)
        self._unfinished: dict[str, tuple[list[_PartPush], list[_PartPush]]] = {}
        # Seqs start at the wall clock in microseconds, not 1: a worker restarted with
        # the same client_id must not repeat seqs the server remembers, or its first
        # pushes would be answered as duplicates and silently dropped.
        self._seq = itertools.count(time.time_ns() // 1000)
        self._sizes: dict[str, int] = {}
        self._heartbeats: dict[str, tuple[threading.Event, threading.Thread]] = {}

    # -- lifecycle -----------------------------------------------------------------
    def __enter__(self) -> Client:
        if self._state is _State.CLOSED:
            raise ClientClosedError("this client was closed; create a new Client")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop heartbeats, close the channel; later calls raise ClientClosedError."""
        with self._lock:
            if self._state is _State.CLOSED:
                return
            self._state = _State.CLOSED
            beats = list(self._heartbeats.values())
            self._heartbeats.clear()
        for stop, thread in beats:
            stop.set()
            thread.join(timeout=5)
        for channel in self._channels.values():
            channel.close()

    def _get_stub(self, shard: int = 0) -> pb_grpc.ParameterServerServiceStub:
        with self._lock:
            if self._state is _State.CLOSED:
                raise ClientClosedError("this client was closed; create a new Client")
            stub = self._stubs.get(shard)
            if stub is None:
                address = self.addresses[shard]
                options = list(_CHANNEL_OPTIONS)
                if self._server_name_override:
                    options.append(
                        ("grpc.ssl_target_name_override", self._server_name_override)
                    )
                if self._secure:
                    roots, key, chain = self._tls
                    creds = grpc.ssl_channel_credentials(roots, key, chain)
                    channel = grpc.secure_channel(address, creds, options)
                else:
                    channel = grpc.insecure_channel(address, options)
                self._channels[shard] = channel
                stub = self._stubs[shard] = pb_grpc.ParameterServerServiceStub(channel)
                self._state = _State.OPEN
            return stub

    def _metadata(self, shard: int = 0) -> list[tuple[str, str]] | None:
        md = [("authorization", f"Bearer {self._token}")] if self._token else []
        if self.shards is not None:
            md.append((SHARD_METADATA_KEY, f"{shard}/{self.shards}"))
        return md or None

    def _deadline(self, timeout: float | None) -> _Deadline:
        return _Deadline(self.timeout if timeout is None else timeout)

    def _call(
        self,
        method: str,
        request: Any,
        deadline: _Deadline | float | None,
        what: str | None = None,
        shard: int = 0,
    ) -> Any:
        """Invoke one RPC; the only place grpc errors turn into the client's own.

        ``deadline`` is the call's (shared by every send of it) or a timeout for a
        call of its own; ``what`` says what was awaited, for DeadlineExceededError.
        """
        if not isinstance(deadline, _Deadline):
            deadline = self._deadline(deadline)
        what = what or f"{method} was not answered"
        fn = self._method(method, shard)
        try:
            return fn(
                request, timeout=deadline.remaining(), metadata=self._metadata(shard)
            )
        except grpc.RpcError as exc:
            raise self._error(exc, deadline, what) from None

    def _stream_call(
        self, method: str, request: Any, deadline: _Deadline, what: str, shard: int = 0
    ) -> Iterator[Any]:
        fn = self._method(method, shard)
        try:
            yield from fn(
                request, timeout=deadline.remaining(), metadata=self._metadata(shard)
            )
        except grpc.RpcError as exc:
            raise self._error(exc, deadline, what) from None

    @staticmethod
    def _error(exc: grpc.RpcError, deadline: _Deadline, what: str) -> RpcError:
        error = translate(exc)
        if isinstance(error, DeadlineExceededError):
            return deadline.expired(what, error.details)
        if error.code == grpc.StatusCode.CANCELLED:
            # This client never cancels a call it waits on: the server did, because
            # it is stopping (a graceful stop cancels what it had not yet started).
            return UnavailableError(
                f"{what}: the server cancelled the call (it is stopping), so it may "
                f"or may not have taken effect ({error.details})",
                grpc.StatusCode.CANCELLED,
            )
        return error

    def _method(self, name: str, shard: int = 0) -> Any:
        stub = self._get_stub(shard)
        return getattr(stub, name)

    def _use_stream(self, nbytes: int) -> bool:
        if self.transport == "auto":
            return nbytes > self.stream_threshold_bytes
        return self.transport == "stream"

    # -- groups --------------------------------------------------------------------
    def create_group(
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
        """Create a group; the order of ``tensors`` is the ONNX order from then on.

        ``state`` (V_1..V_n then H_1..H_n, as the operator has them) and
        ``update_count`` resume a group whose optimizer state was saved elsewhere.
        On a cluster, a group above ``split_bytes`` is split across the shards.
        """
        items = _named_tensors(tensors)
        arrays = [np.asarray(a) for _, a in items]
        state_arrays = [np.asarray(a) for a in state or ()]
        req = pb.CreateGroupRequest(
            group=name,
            optimizer=_spec(optimizer, "optimizer", OptimizerSpec).to_proto(),
            learning_rate=learning_rate,
            consistency=_spec(consistency or Async(), "consistency").to_proto(),
            allow_non_finite=allow_non_finite,
            update_count=update_count,
            lease_seconds=lease_seconds or 0.0,
        )
        deadline = self._deadline(timeout)
        if self.shards is not None:
            from . import _sharded

            names = [n for n, _ in items]
            return _sharded.create_group(
                self, req, names, arrays, state_arrays, deadline
            )
        info = _group_info(
            self._create_request(
                0, req, [n for n, _ in items], arrays, state_arrays, deadline
            )
        )
        self._sizes[name] = info.nbytes
        return info

    def _create_request(
        self,
        shard: int,
        template: pb.CreateGroupRequest,
        names: Sequence[str],
        arrays: Sequence[Array],
        state_arrays: Sequence[Array],
        deadline: _Deadline,
    ) -> pb.GroupInfo:
        req = pb.CreateGroupRequest()
        req.CopyFrom(template)
        nbytes = sum(a.nbytes for a in [*arrays, *state_arrays])
        if self._use_stream(nbytes):
            req.tensors.extend(
                header_tensor(a, n) for n, a in zip(names, arrays, strict=True)
            )
            req.state.extend(header_tensor(a) for a in state_arrays)

            def chunks() -> Iterator[Any]:
                yield pb.CreateGroupStreamRequest(header=req)
                yield from chunk_messages(
                    pb.CreateGroupStreamRequest,
                    [*arrays, *state_arrays],
                    self.chunk_bytes,
                )

            msg = self._call("CreateGroupStream", chunks(), deadline, shard=shard)
        else:
            for n, a in zip(names, arrays, strict=True):
                write_tensor(req.tensors.add(), a, n)
            for a in state_arrays:
                write_tensor(req.state.add(), a)
            msg = self._call("CreateGroup", req, deadline, shard=shard)
        group: pb.GroupInfo = msg.group
        return group

    def describe_group(self, name: str, *, timeout: float | None = None) -> GroupInfo:
        if self.shards is not None:
            from . import _sharded

            return _sharded.describe_group(self, name, self._deadline(timeout))
        req = pb.DescribeGroupRequest(group=name)
        info = _group_info(self._call("DescribeGroup", req, timeout).group)
        self._sizes[name] = info.nbytes
        return info

    def list_groups(
        self, prefix: str = "", *, timeout: float | None = None
    ) -> list[GroupInfo]:
        if self.shards is not None:
            from . import _sharded

            return _sharded.list_groups(self, prefix, self._deadline(timeout))
        msg = self._call("ListGroups", pb.ListGroupsRequest(prefix=prefix), timeout)
        return [_group_info(g) for g in msg.groups]

    def delete_group(self, name: str, *, timeout: float | None = None) -> bool:
        self._sizes.pop(name, None)
        if self.shards is not None:
            from . import _sharded

            return _sharded.delete_group(self, name, self._deadline(timeout))
        msg = self._call("DeleteGroup", pb.DeleteGroupRequest(group=name), timeout)
        return bool(msg.deleted)

    def set_learning_rate(
        self, name: str, learning_rate: float, *, timeout: float | None = None
    ) -> GroupInfo:
        if self.shards is not None:
            from . import _sharded

            return _sharded.set_learning_rate(
                self, name, learning_rate, self._deadline(timeout)
            )
        req = pb.SetLearningRateRequest(group=name, learning_rate=learning_rate)
        return _group_info(self._call("SetLearningRate", req, timeout).group)

    # -- push ----------------------------------------------------------------------
    @overload
    def push(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = ...,
        learning_rate: float | None = ...,
        return_values: Literal[False] = ...,
        timeout: float | None = ...,
    ) -> int: ...

    @overload
    def push(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = ...,
        learning_rate: float | None = ...,
        return_values: Literal[True],
        timeout: float | None = ...,
    ) -> list[Array]: ...

    def push(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = None,
        learning_rate: float | None = None,
        return_values: bool = False,
        timeout: float | None = None,
    ) -> int | list[Array]:
        """Push G_1..G_n (ONNX order). Returns the new T, or X_1..X_n with
        ``return_values=True`` (after the step, in sync mode)."""
        result = self.push_detailed(
            group,
            *gradients,
            base_version=base_version,
            learning_rate=learning_rate,
            return_values=return_values,
            timeout=timeout,
        )
        if return_values:
            assert result.values is not None
            return result.values
        return result.update_count

    def push_detailed(
        self,
        group: str,
        *gradients: Any,
        base_version: int | None = None,
        learning_rate: float | None = None,
        return_values: bool = False,
        timeout: float | None = None,
    ) -> PushResult:
        """Like ``push``, with everything the server said about it."""
        deadline = self._deadline(timeout)
        arrays = [np.asarray(g) for g in gradients]
        req = pb.PushRequest(
            group=group,
            client_id=self.client_id,
            seq=next(self._seq),
            return_values=return_values,
        )
        if base_version is not None:
            req.base_version = base_version
        if learning_rate is not None:
            req.learning_rate = learning_rate
        if self.shards is not None:
            from . import _sharded

            return _sharded.push(self, req, arrays, deadline)
        msg = self._push_one(0, req, arrays, deadline)
        values = None
        if return_values:
            values = [tensor_to_array(t, t.name).copy() for t in msg.values]
        return PushResult(msg.update_count, msg.applied, msg.duplicate, values)

    def _push_one(
        self,
        shard: int,
        template: pb.PushRequest,
        arrays: Sequence[Array],
        deadline: _Deadline,
    ) -> Any:
        """One push (or a part's) to one shard: the reply message."""
        req = pb.PushRequest()
        req.CopyFrom(template)
        stream = self._use_stream(sum(a.nbytes for a in arrays))
        if stream:
            req.gradients.extend(header_tensor(a) for a in arrays)
        else:
            for a in arrays:
                write_tensor(req.gradients.add(), a)

        def chunks() -> Iterator[Any]:
            yield pb.PushStreamRequest(header=req)
            yield from chunk_messages(pb.PushStreamRequest, arrays, self.chunk_bytes)

        return self._send_push(req, chunks if stream else None, deadline, shard)

    def _send_push(
        self,
        req: pb.PushRequest,
        chunks: Callable[[], Iterator[Any]] | None,
        deadline: _Deadline,
        shard: int = 0,
    ) -> Any:
        what = f"the push to group {req.group} (seq {req.seq}) was not answered"
        if chunks is not None:
            stream = chunks
            return self._resending(
                lambda: self._call("PushStream", stream(), deadline, what, shard),
                req.group,
                req.seq,
                deadline,
            )
        return self._resending(
            lambda: self._call("Push", req, deadline, what, shard),
            req.group,
            req.seq,
            deadline,
        )

    def _resending(
        self, send: Callable[[], Any], group: str, seq: int, deadline: _Deadline
    ) -> Any:
        """Send a push, and resend it (same seq) while the server is unavailable,
        until the deadline: the server answers a repeat with its first result."""
        backoff = 0.1
        unavailable: RpcError | None = None
        while True:
            try:
                return send()
            except DeadlineExceededError:
                if unavailable is None:
                    raise
                raise self._gone(group, seq, deadline, unavailable) from None
            except RpcError as exc:
                if exc.code not in _RESEND_CODES:
                    raise
                unavailable = exc
            pause = min(backoff, deadline.remaining())
            if pause <= 0:
                raise self._gone(group, seq, deadline, unavailable)
            log.info(
                "push to %s seq %d: %s; resending in %.1f s",
                group,
                seq,
                unavailable.code.name,
                pause,
            )
            time.sleep(pause)
            backoff = min(_RESEND_BACKOFF_MAX, backoff * 2)

    def _gone(
        self, group: str, seq: int, deadline: _Deadline, last: RpcError
    ) -> UnavailableError:
        return UnavailableError(
            f"the server at {self.address} stayed unavailable for "
            f"{deadline.seconds:g} s ({last.details}); the push to group "
            f"{group} (seq {seq}) may not have been applied",
            reason=last.reason,  # the last refusal's details (e.g. WAL_WRITE_FAILED)
            metadata=last.metadata,
            violations=last.violations,
        )

    # -- pull ----------------------------------------------------------------------
    def pull(
        self,
        group: str,
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> list[Array]:
        """X_1..X_n, or with ``state=True`` X..., V..., H... (ONNX output order).

        ``min_version`` waits (within the deadline) until the group's T reaches it.
        """
        return self.pull_versioned(
            group, state=state, min_version=min_version, timeout=timeout
        )[1]

    def pull_versioned(
        self,
        group: str,
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> tuple[int, list[Array]]:
        """(T, arrays): the tensors and the update count they belong to.

        On a cluster, T is the lowest of the parts' (with pushes in flight, parts
        can be a push apart); ``min_version`` waits for every part."""
        deadline = self._deadline(timeout)
        if self.shards is not None:
            from . import _sharded

            return _sharded.pull(self, group, state, min_version, deadline)
        return self._pull_one(0, group, state, min_version, deadline)

    def _pull_one(
        self,
        shard: int,
        group: str,
        state: bool,
        min_version: int | None,
        deadline: _Deadline,
    ) -> tuple[int, list[Array]]:
        req = pb.PullRequest(group=group, with_state=state, min_version=min_version)
        if min_version is not None:
            what = f"group {group} did not reach T={min_version}"
        else:
            what = f"the pull of group {group} was not answered"
        size = self._sizes.get(group)
        if size is None and self.transport == "auto":
            describe = pb.DescribeGroupRequest(group=group)
            msg = self._call("DescribeGroup", describe, deadline, shard=shard)
            size = self._sizes[group] = _group_info(msg.group).nbytes
        if self._use_stream(size or 0):
            stream_req = pb.PullStreamRequest(
                group=group, with_state=state, min_version=min_version
            )
            it = self._stream_call("PullStream", stream_req, deadline, what, shard)
            first = next(it)
            header = first.header
            names = [t.name for t in header.tensors]
            asm = TensorAssembler(list(header.tensors), names)
            for msg in it:
                asm.add(msg.chunk)
            return header.update_count, asm.finish()
        msg = self._call("Pull", req, deadline, what, shard)
        return msg.update_count, [
            tensor_to_array(t, t.name).copy() for t in msg.tensors
        ]

    # -- rows ----------------------------------------------------------------------
    def push_rows(
        self,
        group: str,
        gradients: Mapping[str, Any],
        *,
        base_version: int | None = None,
        learning_rate: float | None = None,
        timeout: float | None = None,
    ) -> PushResult:
        """One step in which only the given rows change.

        ``gradients`` maps a tensor name to ``(indices, rows)`` (int64 (k,) and
        (k, *shape[1:])) or to a dense gradient of the whole tensor; tensors not
        named keep every row. Repeated indices are summed first. The indices and rows
        travel in ~1 MiB chunks (no size ceiling); a push the server did not answer
        (UNAVAILABLE) is resent with the same seq, and answered once."""
        deadline = self._deadline(timeout)
        shard, part = self._rows_target(group, deadline)
        header = pb.PushRowsHeader(
            group=part, client_id=self.client_id, seq=next(self._seq)
        )
        if base_version is not None:
            header.base_version = base_version
        if learning_rate is not None:
            header.learning_rate = learning_rate
        arrays: list[Array] = []
        for name, g in gradients.items():
            gr = header.gradients.add(name=name)
            if isinstance(g, tuple):
                indices = np.asarray(g[0])
                if indices.dtype.kind in "iu":
                    indices = indices.astype(np.int64, copy=False)
                gr.indices.CopyFrom(header_tensor(indices))
                arrays.append(indices)
                values = np.asarray(g[1])
            else:
                values = np.asarray(g)
            gr.values.CopyFrom(header_tensor(values))
            arrays.append(values)

        def chunks() -> Iterator[Any]:
            yield pb.PushRowsRequest(header=header)
            yield from chunk_messages(pb.PushRowsRequest, arrays, self.chunk_bytes)

        what = f"the row push to group {group} (seq {header.seq}) was not answered"
        msg = self._resending(
            lambda: self._call("PushRows", chunks(), deadline, what, shard),
            group,
            header.seq,
            deadline,
        )
        return PushResult(msg.update_count, msg.applied, msg.duplicate, None)

    def _rows_target(self, group: str, deadline: _Deadline) -> tuple[int, str]:
        """The shard and name of the one part row calls go to (a plain server: 0)."""
        if self.shards is None:
            return 0, group
        from . import _sharded

        targets = _sharded.part_targets(self, group, deadline)
        if len(targets) != 1:
            raise ValueError(
                f"group {group!r} is split into {len(targets)} parts across the "
                "cluster; row pushes and pulls need a group held by one shard "
                "(create it with a larger split_bytes)"
            )
        return targets[0]

    def pull_rows(
        self,
        group: str,
        selections: Mapping[str, Any],
        *,
        state: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
    ) -> dict[str, Array]:
        """Rows of tensors: ``{name: indices}`` in, ``{name: rows}`` out (with
        ``state``, also ``"V:name"`` and ``"H:name"`` as the operator has them)."""
        deadline = self._deadline(timeout)
        shard, part = self._rows_target(group, deadline)
        header = pb.PullRowsHeader(group=part, with_state=state)
        if min_version is not None:
            header.min_version = min_version
        arrays = []
        for name, idx in selections.items():
            indices = np.asarray(idx)
            if indices.dtype.kind in "iu":
                indices = indices.astype(np.int64, copy=False)
            header.tensors.add(name=name, indices=header_tensor(indices))
            arrays.append(indices)

        def chunks() -> Iterator[Any]:
            yield pb.PullRowsRequest(header=header)
            yield from chunk_messages(pb.PullRowsRequest, arrays, self.chunk_bytes)

        what = f"the row pull of group {group} was not answered"
        it = self._stream_call("PullRows", chunks(), deadline, what, shard)
        first = next(it).header
        names = [t.name for t in first.rows]
        asm = TensorAssembler(list(first.rows), names)
        for msg in it:
            asm.add(msg.chunk)
        return dict(zip(names, asm.finish(), strict=True))

    # -- apply ---------------------------------------------------------------------
    def apply(
        self, optimizer: OptimizerSpec, *inputs: Any, timeout: float | None = None
    ) -> list[Array]:
        """Run one ONNX node remotely: ``R, T, X..., G..., V..., H...`` in,
        ``X_new..., V_new..., H_new...`` out."""
        arrays = [np.asarray(a) for a in inputs]
        if len(arrays) >= 2 and arrays[1].dtype.kind in "iu":
            arrays[1] = arrays[1].astype(np.int64)
        optimizer = _spec(optimizer, "optimizer", OptimizerSpec)
        if self._use_stream(sum(a.nbytes for a in arrays)):
            header = pb.ApplyRequest(
                optimizer=optimizer.to_proto(),
                inputs=[header_tensor(a) for a in arrays],
            )

            def chunks() -> Iterator[Any]:
                yield pb.ApplyStreamRequest(request=header)
                yield from chunk_messages(
                    pb.ApplyStreamRequest, arrays, self.chunk_bytes
                )

            it = self._stream_call(
                "ApplyStream",
                chunks(),
                self._deadline(timeout),
                "ApplyStream was not answered",
            )
            first = next(it).response
            asm = TensorAssembler(
                list(first.outputs), [f"output {i}" for i in range(len(first.outputs))]
            )
            for msg in it:
                asm.add(msg.chunk)
            return asm.finish()
        req = pb.ApplyRequest(optimizer=optimizer.to_proto())
        for a in arrays:
            write_tensor(req.inputs.add(), a)
        msg = self._call("Apply", req, timeout)
        return [
            tensor_to_array(t, f"output {i}").copy() for i, t in enumerate(msg.outputs)
        ]

    # -- workers -------------------------------------------------------------------
    def join(
        self, group: str, *, worker_id: str | None = None, timeout: float | None = None
    ) -> LeaseInfo:
        """Join a group as a worker and keep the lease alive in the background
        (on a cluster: on every part of the group)."""
        wid = worker_id or self.client_id
        targets = [(0, group)]
        if self.shards is not None:
            from . import _sharded

            targets = _sharded.part_targets(self, group, self._deadline(timeout))
        lease = self._lease_call("JoinGroup", targets, wid, self._deadline(timeout))
        stop = threading.Event()
        interval = max(0.05, lease.lease_seconds / 3)

        def beat() -> None:
            while not stop.wait(interval):
                for shard, name in targets:
                    beat_req = pb.HeartbeatRequest(group=name, worker_id=wid)
                    try:
                        self._call(
                            "Heartbeat",
                            beat_req,
                            min(interval * 2, self.timeout),
                            shard=shard,
                        )
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
        targets = [(0, group)]
        if self.shards is not None:
            from . import _sharded

            targets = _sharded.part_targets(self, group, self._deadline(timeout))
        wid = worker_id or self.client_id
        return self._lease_call("LeaveGroup", targets, wid, self._deadline(timeout))

    def _lease_call(
        self,
        method: str,
        targets: Sequence[tuple[int, str]],
        worker_id: str,
        deadline: _Deadline,
    ) -> LeaseInfo:
        """Join or leave every part; the lease as the first part answered it."""
        request = pb.JoinGroupRequest if method == "JoinGroup" else pb.LeaveGroupRequest
        calls = [
            functools.partial(
                self._call,
                method,
                request(group=name, worker_id=worker_id),
                deadline,
                shard=shard,
            )
            for shard, name in targets
        ]
        if self.shards is not None:
            calls = [functools.partial(until_landed, c, deadline) for c in calls]
        return _lease_info(fan_out(calls)[0])

    # -- durability ----------------------------------------------------------------
    def save(self, *, timeout: float | None = None) -> SaveInfo:
        """Ask the server (every shard of a cluster) to write a snapshot now; a
        cluster's paths are joined with ", " in shard order."""
        deadline = self._deadline(timeout)
        shards = range(self.shards or 1)
        replies = fan_out(
            [
                functools.partial(
                    self._call, "Save", pb.SaveRequest(), deadline, None, i
                )
                for i in shards
            ]
        )
        return SaveInfo(
            ", ".join(m.path for m in replies),
            sum(m.groups for m in replies),
            sum(m.bytes for m in replies),
        )

    def export(self, path: str | os.PathLike[str], prefix: str = "") -> list[str]:
        """Write every group whose name starts with ``prefix`` (tensors, optimizer
        state, T, learning rate) to one .npz file; returns the group names."""
        from ._transfer import export_groups

        return export_groups(self, path, prefix)

    def import_(
        self,
        path: str | os.PathLike[str],
        *,
        existing: Literal["fail", "skip", "replace"] = "fail",
    ) -> list[str]:
        """Create the groups of a file written by ``export``; returns their names.

        The file is checked whole first. A group the server already has makes the
        import fail before anything is created (``existing="fail"``), is left as it
        is (``"skip"``, not in the result) or is replaced by the file's.
        """
        from ._transfer import import_groups

        return import_groups(self, path, existing=existing).imported
