"""``RemoteOptimizer``: a ``torch.optim.Optimizer`` whose state lives on onnxps.

The parameters are the tensors X_1..X_n of one onnxps group, in parameter order. A
step is one push of every gradient with ``return_values=True``: the server applies
its ONNX operator and answers with the new X, which is written back into the
parameters in place: CPU parameters through NumPy views of their storage, into
which the client assembles the reply's chunks as they arrive (no copy of X);
parameters on another device through one host copy each way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Literal, cast, overload

import numpy as np
import torch
from onnxps.client import (
    Adam,
    AlreadyExistsError,
    Async,
    Client,
    FailedPreconditionError,
    GroupInfo,
    NotFoundError,
    OptimizerSpec,
    PushResult,
    Sync,
)
from onnxps.wire.image import STATE_NAMES

__all__ = ["STATE_DICT_FORMAT_VERSION", "RemoteOptimizer"]

Array = np.ndarray[Any, Any]
ParamsT = Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
MissingGrad = Literal["zeros", "error"]
OnStale = Literal["raise", "skip"]

STATE_DICT_FORMAT_VERSION = 1
_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}


def _tensor(item: Any) -> torch.Tensor:
    return item[1] if isinstance(item, tuple) else item  # type: ignore[no-any-return]


def _check_lr(lr: float) -> None:
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be finite and >= 0, got {lr!r}")


def _trained(params: ParamsT, one_group: str) -> list[Any]:
    """The parameters (tensors or ``(name, tensor)`` pairs) that require grad; a
    ``ValueError`` for parameter groups (dicts: ``one_group`` says why not) and for
    none that requires grad."""
    items: list[Any] = list(params)
    if any(isinstance(item, dict) for item in items):
        raise ValueError(
            f"{one_group} learning rate); pass tensors or (name, tensor) pairs, not "
            "dicts"
        )
    trained = [item for item in items if _tensor(item).requires_grad]
    if not trained:
        raise ValueError("no parameter requires grad: nothing to optimize")
    return trained


def _host(t: torch.Tensor) -> Array:
    """The tensor's values as an ndarray: a view of a CPU tensor, else one copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.numpy()


def _write(p: torch.Tensor, value: Array) -> None:
    """Copy ``value`` into ``p``'s storage (the parameter object stays the same)."""
    if p.device.type == "cpu":
        np.copyto(p.detach().numpy(), value)
    else:
        src = value if value.flags.writeable else value.copy()
        p.detach().copy_(torch.from_numpy(src))


def _same_attribute(theirs: Any, asked: Any) -> bool:
    """Float attributes travel as float32: compare them at that precision."""
    if isinstance(asked, float) and isinstance(theirs, float):
        return bool(np.float32(asked) == np.float32(theirs))
    return bool(theirs == asked)


class RemoteOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that steps on an onnxps server.

    ``params`` are tensors or ``(name, tensor)`` pairs (``model.named_parameters()``),
    one parameter group: the server group has one learning rate R. Tensors with
    ``requires_grad=False`` are left out of the group. The first optimizer to
    construct the group creates it from its parameters; the others join and copy
    the server's X into theirs.

    ``missing_grad``: a parameter without ``.grad`` at ``step()`` pushes zeros
    (``"zeros"``; the server's operator still decays/accumulates its state and can
    move it, as torch.optim does for a zero gradient) or raises (``"error"``).
    ``on_stale``: a push refused as too stale (``Async(max_staleness=...)``, or
    computed before the group was rewound: ``REWOUND``) raises (``"raise"``) or
    drops the gradient and copies the server's X (``"skip"``).
    """

    def __init__(
        self,
        params: ParamsT,
        client: Client,
        *,
        group: str,
        lr: float,
        optimizer: OptimizerSpec | None = None,
        consistency: Async | Sync | None = None,
        allow_non_finite: bool = False,
        lease_seconds: float | None = None,
        join: bool = False,
        missing_grad: MissingGrad = "zeros",
        on_stale: OnStale = "raise",
        timeout: float | None = None,
    ) -> None:
        _check_lr(lr)
        if missing_grad not in ("zeros", "error"):
            raise ValueError(
                f"missing_grad must be 'zeros' or 'error', not {missing_grad!r}"
            )
        if on_stale not in ("raise", "skip"):
            raise ValueError(f"on_stale must be 'raise' or 'skip', not {on_stale!r}")
        trained = _trained(
            params,
            "RemoteOptimizer takes one parameter group (the server group has one",
        )
        super().__init__(cast(ParamsT, trained), {"lr": lr})
        self.client = client
        self.group = group
        self.missing_grad: MissingGrad = missing_grad
        self.on_stale: OnStale = on_stale
        self.timeout = timeout
        self.skipped_steps = 0
        ps = self._params()
        names = self.param_groups[0].get("param_names")
        self.names: tuple[str, ...] = tuple(names or (f"p{i}" for i in range(len(ps))))
        self.shapes: tuple[tuple[int, ...], ...] = tuple(tuple(p.shape) for p in ps)
        self.dtype = self._dtype(ps)
        self._zeros: dict[int, Array] = {}
        self._version = 0
        spec = optimizer if optimizer is not None else Adam()
        self._info = self._create_or_attach(
            spec, consistency, allow_non_finite, lease_seconds
        )
        self._server_lr = self._info.learning_rate
        self._joined = False
        if join:
            self.join()

    # -- construction --------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return list(self.param_groups[0]["params"])

    @staticmethod
    def _dtype(ps: Sequence[torch.Tensor]) -> np.dtype[Any]:
        kinds = {p.dtype for p in ps}
        if len(kinds) != 1 or not kinds <= _DTYPES.keys():
            raise ValueError(
                "an onnxps group holds one dtype, float32 or float64; the parameters "
                f"are {sorted(str(k) for k in kinds)}"
            )
        return _DTYPES[kinds.pop()]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.param_groups:
            raise ValueError(
                "a RemoteOptimizer's tensors are fixed when its group is created; "
                "create another RemoteOptimizer (another group) for more parameters"
            )
        super().add_param_group(param_group)

    def _host_tensors(self) -> list[tuple[str, Array]]:
        return [(n, _host(p)) for n, p in zip(self.names, self._params(), strict=True)]

    def _create_or_attach(
        self,
        spec: OptimizerSpec,
        consistency: Async | Sync | None,
        allow_non_finite: bool,
        lease_seconds: float | None,
    ) -> GroupInfo:
        tensors = self._host_tensors()
        try:
            return self.client.create_group(
                self.group,
                spec,
                learning_rate=float(self.param_groups[0]["lr"]),
                tensors=tensors,
                consistency=consistency,
                allow_non_finite=allow_non_finite,
                lease_seconds=lease_seconds,
                timeout=self.timeout,
            )
        except AlreadyExistsError:
            pass
        info = self.client.describe_group(self.group, timeout=self.timeout)
        self._check_matches(info, spec)
        self.pull()
        return info

    def _check_matches(self, info: GroupInfo, spec: OptimizerSpec) -> None:
        mine = [(n, s) for n, s in zip(self.names, self.shapes, strict=True)]
        if info.tensors != mine or info.dtype != self.dtype:
            raise ValueError(
                f"group {self.group!r} exists with {info.dtype} tensors "
                f"{info.tensors}, but these parameters are {self.dtype} {mine}"
            )
        theirs = info.optimizer
        asked = {k: v for k, v in dataclasses.asdict(spec).items() if v is not None}
        if type(theirs) is not type(spec) or any(
            not _same_attribute(getattr(theirs, k), v) for k, v in asked.items()
        ):
            raise ValueError(
                f"group {self.group!r} exists with optimizer {theirs}, "
                f"not the {spec} asked for"
            )

    # -- leases --------------------------------------------------------------------
    def join(self) -> None:
        """Join the group as a worker (a lease kept alive by the client)."""
        self.client.join(self.group, timeout=self.timeout)
        self._joined = True

    def leave(self) -> None:
        """Give the lease back (a no-op when not joined)."""
        if self._joined:
            self._joined = False
            self.client.leave(self.group, timeout=self.timeout)

    # -- step ----------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The server's T that the parameters hold (the base of the next push)."""
        return self._version

    def pull(self) -> int:
        """Copy the server's X into the parameters; returns its T."""
        self._check_shapes(self._params())
        out = self._in_place()
        t, values = self.client.pull_versioned(
            self.group, timeout=self.timeout, out=out
        )
        if out is None:
            self._write_all(values)
        self._version = t
        return t

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Push every gradient (one push, parameter order) and write X back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self.gradients()
        out = self._in_place()
        try:
            result = self._push(grads, float(self.param_groups[0]["lr"]), out)
        except FailedPreconditionError as exc:
            self._stale(exc)
            return loss
        self._took(result, out)
        return loss

    def _start(self) -> tuple[Future[PushResult], list[Array] | None]:
        """Start this step's push on the client's background thread: its future
        and the parameters' views X will be written into (None: ``_took`` copies
        it). ``BucketedOptimizer``'s buckets step so."""
        grads = self.gradients()
        out = self._in_place()
        lr = self._push_lr(float(self.param_groups[0]["lr"]))
        future = self.client.push_background(
            self.group,
            *grads,
            base_version=self._version,
            learning_rate=lr,
            return_values=True,
            timeout=self.timeout,
            out=out,
        )
        return future, out

    def _finish(self, future: Future[PushResult], out: list[Array] | None) -> None:
        """Wait for a push ``_start`` began and take its X (``step()``'s end)."""
        try:
            result = future.result()
        except FailedPreconditionError as exc:
            self._stale(exc)
            return
        self._took(result, out)

    def _stale(self, exc: FailedPreconditionError) -> None:
        """A refused push: raise, or (``on_stale="skip"``) count it and pull X."""
        if self.on_stale == "raise" or exc.reason not in ("STALE_PUSH", "REWOUND"):
            raise exc
        self.skipped_steps += 1
        self.pull()

    def _took(self, result: PushResult, out: list[Array] | None) -> None:
        assert result.values is not None
        if out is None:
            self._write_all(result.values)
        self._version = result.update_count + (0 if result.applied else 1)

    def _in_place(self) -> list[Array] | None:
        """The parameters as NumPy views X can be written straight into (the
        client assembles the reply in them): when every one is a CPU tensor."""
        ps = self._params()
        if any(p.device.type != "cpu" for p in ps):
            return None
        return [p.detach().numpy() for p in ps]

    def gradients(self) -> list[Array]:
        """G_1..G_n as pushed: host arrays (views of CPU grads), zeros for none."""
        ps = self._params()
        self._check_shapes(ps)
        return [self._gradient(i, p) for i, p in enumerate(ps)]

    def _gradient(self, i: int, p: torch.Tensor) -> Array:
        g = p.grad
        if g is None:
            if self.missing_grad == "error":
                raise ValueError(
                    f"parameter {self.names[i]!r} has no gradient this step; "
                    "missing_grad='zeros' pushes zeros for it"
                )
            zeros = self._zeros.get(i)
            if zeros is None:
                zeros = self._zeros[i] = np.zeros(self.shapes[i], self.dtype)
            return zeros
        if g.layout != torch.strided:
            raise ValueError(
                f"parameter {self.names[i]!r} has a {g.layout} gradient; onnxps "
                "pushes dense gradients"
            )
        return _host(g)

    def _check_shapes(self, ps: Sequence[torch.Tensor]) -> None:
        for name, shape, p in zip(self.names, self.shapes, ps, strict=True):
            if tuple(p.shape) != shape or _DTYPES.get(p.dtype) != self.dtype:
                raise ValueError(
                    f"parameter {name!r} is now {p.dtype} {tuple(p.shape)}, but group "
                    f"{self.group!r} holds it as {self.dtype} {shape}: a group's "
                    "tensors keep their shapes; create a new group for a new shape"
                )

    def _push(
        self, grads: Sequence[Array], lr: float, out: list[Array] | None = None
    ) -> PushResult:
        return self.client.push_detailed(
            self.group,
            *grads,
            base_version=self._version,
            learning_rate=self._push_lr(lr),
            return_values=True,
            timeout=self.timeout,
            out=out,
        )

    def _push_lr(self, lr: float) -> float | None:
        """The push's R: ``lr``; None in a sync group, whose R is the group's."""
        if not isinstance(self._info.consistency, Sync):
            return lr
        # A sync step uses the group's R, not the pushes': set it when it changed
        # (the previous step has been taken, so it applies to the next one).
        if lr != self._server_lr:
            self.client.set_learning_rate(self.group, lr, timeout=self.timeout)
            self._server_lr = lr
        return None

    def _write_all(self, values: Sequence[Array]) -> None:
        ps = self._params()
        self._check_shapes(ps)
        with torch.no_grad():
            for p, value in zip(ps, values, strict=True):
                _write(p, value)

    # -- checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, with the server's V/H per parameter and its T.

        ``state[i]`` holds the operator's accumulators of parameter i by their ONNX
        names (``"V"``, ``"H"``); ``"onnxps"`` holds T and the group's definition.
        """
        sd = super().state_dict()
        info = self.client.describe_group(self.group, timeout=self.timeout)
        t, arrays = self.client.pull_versioned(
            self.group, state=True, timeout=self.timeout
        )
        kind = type(info.optimizer).__name__
        n = len(self.names)
        sd["state"] = {
            i: {
                name: torch.from_numpy(arrays[n * (k + 1) + i])
                for k, name in enumerate(STATE_NAMES[kind])
            }
            for i in range(n)
        }
        sd["onnxps"] = {
            "format_version": STATE_DICT_FORMAT_VERSION,
            "group": self.group,
            "update_count": t,
            "optimizer": kind,
            "attributes": dataclasses.asdict(info.optimizer),
            "learning_rate": info.learning_rate,
            "names": list(self.names),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore lr and the server's V, H and T: the group is created again from
        the parameters (load the model's state dict first) and the saved state.

        In a job of several workers, one loads; the others construct (or ``pull``)
        after it.
        """
        meta = state_dict.get("onnxps")
        if not isinstance(meta, dict):
            raise ValueError(
                "not a RemoteOptimizer state dict: it has no 'onnxps' entry "
                "(a torch.optim checkpoint does not carry the server's V, H and T)"
            )
        version = meta.get("format_version")
        if version != STATE_DICT_FORMAT_VERSION:
            raise ValueError(
                f"RemoteOptimizer state dict format_version {version!r}: this "
                f"version reads {STATE_DICT_FORMAT_VERSION}"
            )
        info = self._current_info()
        kind = type(info.optimizer).__name__
        if meta["optimizer"] != kind:
            raise ValueError(
                f"the state dict is of a {meta['optimizer']} group, but group "
                f"{self.group!r} is {kind}"
            )
        state = self._state_arrays(state_dict["state"], STATE_NAMES[kind])
        super().load_state_dict({**state_dict, "state": {}})
        self._recreate(info, state, int(meta["update_count"]))

    def send_parameters(self) -> int:
        """Make the parameters' values the server's X (after the model loaded
        weights: ``load_state_dict``, ``onnxps.torch.load_safetensors``); returns
        T. The group is created again with them and everything else it had:
        optimizer, V/H state, T, consistency, lease settings (the learning rate:
        this optimizer's). Other workers that joined it must join again."""
        info = self._current_info()
        t, arrays = self.client.pull_versioned(
            self.group, state=True, timeout=self.timeout
        )
        self._recreate(info, list(arrays[len(self.names) :]), t)
        return t

    def _current_info(self) -> GroupInfo:
        try:
            return self.client.describe_group(self.group, timeout=self.timeout)
        except NotFoundError:
            return self._info

    def _state_arrays(
        self, saved: dict[Any, dict[str, Any]], names: Sequence[str]
    ) -> list[Array]:
        if len(saved) != len(self.names):
            raise ValueError(
                f"the state dict has state for {len(saved)} parameters, this "
                f"optimizer has {len(self.names)}"
            )
        arrays = []
        for name in names:
            for i, shape in enumerate(self.shapes):
                a = np.asarray(_host(saved[i][name]), dtype=self.dtype)
                if a.shape != shape:
                    raise ValueError(
                        f"saved {name} of parameter {self.names[i]!r} has shape "
                        f"{a.shape}, the parameter {shape}"
                    )
                arrays.append(a)
        return arrays

    def _recreate(self, info: GroupInfo, state: list[Array], update_count: int) -> None:
        joined = self._joined
        self.leave()
        try:
            self.client.delete_group(self.group, timeout=self.timeout)
        except NotFoundError:
            pass  # deleted meanwhile (or the server lost it): create it all the same
        lr = float(self.param_groups[0]["lr"])
        tensors = self._host_tensors()
        self._info = self.client.create_group(
            self.group,
            info.optimizer,
            learning_rate=lr,
            tensors=tensors,
            consistency=info.consistency,
            allow_non_finite=info.allow_non_finite,
            state=state,
            update_count=update_count,
            lease_seconds=info.lease_seconds,
            timeout=self.timeout,
        )
        self._server_lr = lr
        self._version = update_count
        if joined:
            self.join()
