"""Optimizer and consistency specs, by their ONNX attribute names.

A field left as ``None`` takes the ONNX schema default on the server. Momentum has no
defaults in ONNX, so all four of its fields are required.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from onnxps.v1 import parameter_server_pb2 as pb

__all__ = ["Adagrad", "Adam", "Async", "Momentum", "Nesterov", "OptimizerSpec", "Sync"]


def _set(msg: object, spec: object) -> None:
    for f in fields(spec):  # type: ignore[arg-type]
        value = getattr(spec, f.name)
        if value is not None:
            setattr(msg, f.name, value)


@dataclass(frozen=True)
class Adagrad:
    epsilon: float | None = None
    decay_factor: float | None = None
    norm_coefficient: float | None = None

    def to_proto(self) -> pb.OptimizerSpec:
        msg = pb.Adagrad()
        _set(msg, self)
        return pb.OptimizerSpec(adagrad=msg)


@dataclass(frozen=True)
class Momentum:
    alpha: float
    beta: float
    mode: Literal["standard", "nesterov"] = "standard"
    norm_coefficient: float = 0.0

    def to_proto(self) -> pb.OptimizerSpec:
        msg = pb.Momentum()
        _set(msg, self)
        return pb.OptimizerSpec(momentum=msg)


def Nesterov(alpha: float, beta: float, norm_coefficient: float = 0.0) -> Momentum:  # noqa: N802
    """Momentum with ``mode="nesterov"``."""
    return Momentum(alpha, beta, "nesterov", norm_coefficient)


@dataclass(frozen=True)
class Adam:
    alpha: float | None = None
    beta: float | None = None
    epsilon: float | None = None
    norm_coefficient: float | None = None
    norm_coefficient_post: float | None = None

    def to_proto(self) -> pb.OptimizerSpec:
        msg = pb.Adam()
        _set(msg, self)
        return pb.OptimizerSpec(adam=msg)


OptimizerSpec = Adagrad | Momentum | Adam


@dataclass(frozen=True)
class Async:
    """Each push steps at once; refuse pushes older than T - max_staleness if set."""

    max_staleness: int | None = None

    def to_proto(self) -> pb.Consistency:
        msg = pb.Consistency(mode=pb.CONSISTENCY_MODE_ASYNC)
        if self.max_staleness is not None:
            msg.max_staleness = self.max_staleness
        return msg


@dataclass(frozen=True)
class Sync:
    """One step per quorum of ``workers`` pushes, combined by mean (or sum)."""

    workers: int
    reduction: Literal["mean", "sum"] = "mean"

    def to_proto(self) -> pb.Consistency:
        return pb.Consistency(
            mode=pb.CONSISTENCY_MODE_SYNC,
            sync_workers=self.workers,
            reduction=pb.REDUCTION_SUM
            if self.reduction == "sum"
            else pb.REDUCTION_MEAN,
        )
