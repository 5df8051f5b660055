"""Tensor bytes on the data channel (``TensorTransport``, see ``_transport``): one
frame on a socket beside gRPC (``_datachannel`` has the socket's side), and the link
that opens, pools and refuses channels per server."""

from __future__ import annotations

import functools
import logging
import math
import ssl
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import grpc
import numpy as np
from onnxps.v1 import parameter_server_pb2 as pb
from onnxps.wire.codec import ENCODED, TensorFormatError, header_tensors, tensor_spec
from onnxps.wire.encoding import widen_into

from ._datachannel import (
    ChannelBroken,
    ChannelPool,
    ChannelRefused,
    DataChannel,
    connect,
    split_frame,
    tls_context,
)
from ._errors import (
    DataChannelError,
    FailedPreconditionError,
    ResourceExhaustedError,
    RpcError,
    UnavailableError,
)
from ._grpc_transport import GrpcHost, pull_waited, pushed_what
from ._ops import Blocking, Call, Deadline, Op, Transfer, unary_request, what
from ._records import PushResult
from ._replies import inline_values, tcp_host

__all__ = [
    "DATA_CHANNEL_THRESHOLD_BYTES",
    "ChannelHost",
    "ChannelTransport",
    "DataChannelLink",
    "DataChannelMode",
]

log = logging.getLogger("onnxps.client")

Array = np.ndarray[Any, Any]
DataChannelMode = Literal["auto", "on", "off"]
Specs = Sequence[tuple[np.dtype[Any], Sequence[int]]]

# With data_channel="auto", calls with at least this many tensor bytes use it.
DATA_CHANNEL_THRESHOLD_BYTES = 1 << 20
# Refusals of a data channel's hello that mean "not this server": use gRPC.
_DATA_HELLO_REFUSALS = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
_HELLO_SECONDS = 3.0
# Refusals of a call on the channel after which it goes over gRPC instead.
_CHANNEL_FALLBACK_REASONS = frozenset(
    {
        "DATA_CHANNEL_UNKNOWN",
        "DATA_CHANNEL_BUSY",
        "DATA_CHANNEL_OFF",
        "DATA_TRANSFER_STALE",
        # a replicated shard's server that is no longer the primary: the call
        # goes over gRPC, which follows to the new one (the same seq: once)
        "NOT_PRIMARY",
    }
)
# Failures of a call on a channel that may send it over gRPC (``_falls_back``).
_CHANNEL_FAILURES = (
    ChannelBroken,
    UnavailableError,
    FailedPreconditionError,
    ResourceExhaustedError,
)
_F32 = np.dtype(np.float32)


class ChannelHost(GrpcHost, Protocol):
    """What the link reads from its client, live."""

    @property
    def TRANSFERS(self) -> bool: ...  # noqa: N802 (the client's class constant)

    addresses: list[str]
    data_channel: DataChannelMode


def _falls_back(exc: Exception) -> bool:
    """Whether a failed call on a channel goes over gRPC instead (the channel
    broke, or the server refused the channel, not the call). A call on a channel
    counts as a stream on the server: at its stream limit, a unary call may
    still be served."""
    if isinstance(exc, FailedPreconditionError):
        return exc.reason in _CHANNEL_FALLBACK_REASONS
    if isinstance(exc, ResourceExhaustedError):
        return exc.reason == "STREAM_LIMIT"
    return True


class DataChannelLink:
    """The data channels of one client, per shard (0: the one server): "auto"
    (with transport="auto") carries the bytes of calls of at least
    DATA_CHANNEL_THRESHOLD_BYTES when the server offers a channel, "on" every push
    and pull (DataChannelError where it cannot), "off" never."""

    def __init__(
        self,
        host: ChannelHost,
        tls: tuple[bytes | None, bytes | None, bytes | None],
        server_name_override: str | None,
        dtypes: dict[str, np.dtype[Any]],
    ) -> None:
        self.host = host
        self._tls = tls
        self._server_name_override = server_name_override
        self._tls_context: ssl.SSLContext | None = None
        # each group's dtype as last seen: an encoded pull widens into it
        self.dtypes = dtypes
        self.pools: dict[int, ChannelPool] = {}
        self.refused: dict[int, str] = {}
        # the address each shard's pool and refusal are of: a replicated
        # cluster's primary moves, and its channels and refusal stay behind
        self._of: dict[int, str] = {}

    def pool(self, shard: int) -> ChannelPool:
        address = self.host.addresses[shard]
        if self._of.get(shard, address) != address:
            old = self.pools.pop(shard, None)
            if old is not None:
                old.close()
            self.refused.pop(shard, None)
        self._of[shard] = address
        pool = self.pools.get(shard)
        if pool is None:
            pool = self.pools.setdefault(shard, ChannelPool())
        return pool

    def close(self) -> None:
        for pool in list(self.pools.values()):
            pool.close()

    def transport(
        self, nbytes: int, deadline: Deadline, shard: int = 0
    ) -> Op[ChannelTransport | None]:
        """The data channel transport to ``shard`` for a call of ``nbytes``
        tensor bytes, or None (bytes over gRPC)."""
        ch = yield from self.channel(nbytes, deadline, shard)
        return None if ch is None else ChannelTransport(self, ch, shard)

    def channel(
        self, nbytes: int, deadline: Deadline, shard: int = 0
    ) -> Op[DataChannel | None]:
        """A data channel to ``shard`` for a call of ``nbytes`` tensor bytes, or
        None: an idle one, else a new one (hello, connect)."""
        host = self.host
        if host.data_channel == "off" or not host.TRANSFERS:
            return None
        if host.data_channel == "auto" and (
            host.transport != "auto" or nbytes < DATA_CHANNEL_THRESHOLD_BYTES
        ):
            return None
        address = tcp_host(host.addresses[shard])
        if address is None:
            self.refuse("the address is not host:port", shard)
            return None
        pool = self.pool(shard)  # (forgets a refusal of a primary that moved)
        if shard in self.refused:
            self.refuse(self.refused[shard], shard)
            return None
        ch = pool.take()
        if ch is not None:
            return ch
        try:
            call = Call(
                "DataChannelHello",
                unary_request(pb.DataChannelHelloRequest()),
                # A hello never costs the call more than a few seconds of its own
                # (and a server that is away leaves the call most of its time)
                Deadline(min(deadline.remaining() / 4, _HELLO_SECONDS)),
                what("the data channel hello"),
                shard=shard,
            )
            msg = yield call
        except RpcError as exc:
            if exc.code in _DATA_HELLO_REFUSALS:
                self.refuse(f"{exc.code.name}: {exc.details}", shard)
                return None
            # The server is away, draining or stopped: this call goes over gRPC
            # (and rides through that, or times out, as before); the next call
            # asks again.
            return None
        try:
            opening = functools.partial(
                connect,
                address,
                msg.port,
                msg.ticket,
                min(deadline.remaining(), _HELLO_SECONDS),
                self.context(),
                self._server_name_override,
            )
            opened: DataChannel = yield Blocking(opening)
            return opened
        # (LookupError: a Python that cannot load its idna codec cannot resolve)
        except (OSError, LookupError, ChannelRefused, ChannelBroken) as exc:
            why = f"cannot connect to its port {address}:{msg.port} ({exc})"
            self.refuse(why, shard)
            return None

    def context(self) -> ssl.SSLContext | None:
        """The TLS of this client's channels (None: plain TCP)."""
        if self._tls[0] is None and self._tls[2] is None:
            return None
        if self._tls_context is None:
            self._tls_context = tls_context(*self._tls)
        return self._tls_context

    def refuse(self, why: str, shard: int = 0) -> None:
        """Remember why ``shard`` gives no data channel: "on" raises, "auto" falls
        back to gRPC (logged once)."""
        first = shard not in self.refused
        self.refused[shard] = why
        address = self.host.addresses[shard]
        if self.host.data_channel == "on":
            raise DataChannelError(
                f"data_channel='on' but the server at {address} gives this "
                f"client no data channel: {why}"
            )
        if first:
            log.info(
                "no data channel with %s (%s); tensor bytes go over gRPC",
                address,
                why,
            )


class ChannelTransport:
    """One call's tensors as one frame each way on data channel ``ch`` (to
    ``shard``); everything else on gRPC. Where the channel fails without the
    server saying why, a push or pull answers None: the seam sends it over gRPC
    (a push with the same seq: applied once)."""

    def __init__(self, link: DataChannelLink, ch: DataChannel, shard: int) -> None:
        self.link = link
        self.ch = ch
        self.shard = shard

    def push(
        self,
        template: pb.PushRequest,
        arrays: Sequence[Any],
        deadline: Deadline,
        out: Sequence[Array] | None,
    ) -> Op[PushResult | None]:
        ch = self.ch
        req = pb.PushRequest()
        req.CopyFrom(template)
        req.gradients.extend(header_tensors(arrays))
        tid = ch.next_transfer()
        req.transfer.channel = ch.id
        req.transfer.transfer_id = tid
        into: list[Array] | None = None
        if req.return_values:
            into = [
                out[i] if out is not None and out[i].flags.c_contiguous else
                np.empty(a.shape, ENCODED.get(a.dtype, (a.dtype,))[0])
                for i, a in enumerate(arrays)
            ]  # fmt: skip
        call = Call("Push", unary_request(req), deadline, pushed_what(req))
        try:
            msg, frame = yield Transfer(call, ch, tid, arrays, req.return_values, into)
        except _CHANNEL_FAILURES as exc:
            if not _falls_back(exc):
                raise
            log.info("data channel: %s; the push goes over gRPC", exc)
            return None
        self.link.pool(self.shard).give_back(ch)
        values = None
        if req.return_values and msg.values_on_channel:
            values = (
                frame
                if isinstance(frame, list)
                else split_frame(frame, [tensor_spec(t, t.name) for t in msg.values])
            )
        elif req.return_values:
            values = inline_values(msg, out)
        return PushResult(msg.update_count, msg.applied, msg.duplicate, values)

    def pull(
        self, request: pb.PullRequest, deadline: Deadline, out: Sequence[Array] | None
    ) -> Op[tuple[int, list[Array]] | None]:
        """An encoded X is widened here as it lands, into ``out`` where it fits,
        else into one buffer of the group's dtype as last seen (float32 if never:
        any other is converted after, exactly), then cut per the reply."""
        ch = self.ch
        req = pb.PullRequest()
        req.CopyFrom(request)
        tid = ch.next_transfer()
        req.transfer.channel = ch.id
        req.transfer.transfer_id = tid
        into = None
        if out is not None and all(
            isinstance(o, np.ndarray) and o.flags.c_contiguous and o.flags.writeable
            for o in out
        ):
            into = list(out)
        call = Call("Pull", unary_request(req), deadline, pull_waited(req))
        widen = int(req.encoding)
        guess = None
        if into is None and widen:
            guess = self.link.dtypes.get(req.group, _F32)
        try:
            msg, frame = yield Transfer(call, ch, tid, None, True, into, widen, guess)
        except _CHANNEL_FAILURES as exc:
            if not _falls_back(exc):
                raise
            log.info("data channel: %s; the pull goes over gRPC", exc)
            return None
        self.link.pool(self.shard).give_back(ch)
        specs = [tensor_spec(t, t.name, encoded=True) for t in msg.tensors]
        if specs and not req.with_state:
            self.link.dtypes[req.group] = specs[0][0]
        return msg.update_count, _landed(frame, specs, msg.tensors, widen, guess)


def _landed(
    frame: Any,
    specs: Specs,
    tensors: Sequence[pb.Tensor],
    widen: int,
    guess: np.dtype[Any] | None,
) -> list[Array]:
    """The reply's arrays from what landed: a whole frame of bytes, or arrays the
    channel wrote into (``out``, or one widened buffer when ``guess`` was given)."""
    if not isinstance(frame, list) and widen:
        # landed whole (an out= of other sizes): widen now
        if frame.size % 2 or any(t.encoding != widen for t in tensors):
            raise TensorFormatError(
                f"the data channel frame of {frame.size} bytes does not hold "
                f"the reply's X in encoding {widen}"
            )
        flat = np.empty(frame.size // 2, specs[0][0] if specs else _F32)
        widen_into(flat, frame, widen)
        return cut_flat(flat, specs)
    if isinstance(frame, list) and guess is not None:  # widened into one buffer
        return cut_flat(frame[0], specs)
    if isinstance(frame, list):
        _check_out(frame, specs)
        return frame
    return split_frame(frame, specs)


def _check_out(frame: list[Array], specs: Specs) -> None:
    """``out`` as ``pull(out=)`` says it must be, for these specs."""
    if len(frame) != len(specs):
        raise ValueError(
            f"out holds {len(frame)} arrays; the pull returned {len(specs)}"
        )
    for i, (a, (d, dims)) in enumerate(zip(frame, specs, strict=True)):
        if (a.dtype, a.shape) != (d, tuple(dims)):
            raise ValueError(
                f"out[{i}] must be a {d} array of shape {tuple(dims)}, got "
                f"{a.dtype} {a.shape}"
            )


def cut_flat(flat: Array, specs: Specs) -> list[Array]:
    """Views of the widened values in ``flat`` per ``specs`` (converted, exactly,
    where the group's dtype is not ``flat``'s)."""
    arrays = []
    at = 0
    for dtype, dims in specs:
        count = math.prod(dims)
        piece = flat[at : at + count].reshape(tuple(dims))
        arrays.append(piece if piece.dtype == dtype else piece.astype(dtype))
        at += count
    if at != flat.size:
        raise TensorFormatError(
            f"the data channel frame holds {flat.size} elements; the reply's "
            f"tensors declare {at}"
        )
    return arrays
