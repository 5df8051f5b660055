"""``BucketedOptimizer``: gradients pushed in buckets while backward still runs.

As ``DistributedDataParallel`` buckets its allreduce, the parameters are split, in
the reverse of their order (the order backward produces their gradients), into
buckets of about ``bucket_bytes``, each one onnxps group stepped by a
``RemoteOptimizer`` of its own. A gradient hook counts the gradients of each
bucket; when its last one is accumulated, the bucket's push starts on the
client's background thread, so the server steps it while backward computes the
next bucket. ``step()`` pushes what is left and waits for every bucket's X.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast, overload

import numpy as np
import torch
from onnxps.client import Async, Client, OptimizerSpec, PushResult, Sync

from ._optimizer import (
    STATE_DICT_FORMAT_VERSION,
    MissingGrad,
    ParamsT,
    RemoteOptimizer,
    _check_lr,
    _trained,
)

__all__ = ["BUCKET_BYTES", "BucketedOptimizer"]

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb
Pending = tuple[Future[PushResult], list[np.ndarray[Any, Any]] | None]


def _split(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices in buckets: from the last parameter back, each bucket
    closed once it holds ``bucket_bytes`` or more; each in parameter order."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        held += sizes[i]
        if held >= bucket_bytes:
            buckets.append(sorted(current))
            current, held = [], 0
    if current:
        buckets.append(sorted(current))
    return buckets


class BucketedOptimizer(torch.optim.Optimizer):
    """A ``RemoteOptimizer`` whose pushes overlap backward: one push per bucket.

    Takes ``RemoteOptimizer``'s arguments (one parameter group, one dtype) but
    ``on_stale`` (a push refused as stale raises, as ``"raise"``), and
    ``bucket_bytes`` (25 MiB, DDP's default). Bucket k is the group
    ``f"{group}.{k}"`` (bucket 0 holds the last parameters). ``step()`` keeps
    ``torch.optim``'s meaning: when it returns, every bucket's step is applied
    and the parameters hold the server's new X. What differs from
    ``RemoteOptimizer``: a bucket's gradients are read when backward has
    accumulated them: a gradient changed between ``backward()`` and ``step()``
    (clipping, scaling) after its bucket was pushed makes ``step()`` raise
    ``RuntimeError`` (the step was taken with backward's gradients), and a second
    ``backward()`` before ``step()`` (gradient accumulation) raises
    ``RuntimeError``; use ``RemoteOptimizer`` for those. X is written into the
    parameters when their bucket's reply comes, which can be before ``step()``:
    after backward has used them (a model that reads a parameter's value in
    backward after its gradient is complete, through ``.detach()`` or a custom
    ``autograd.Function``, needs ``RemoteOptimizer``).
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
        bucket_bytes: int = BUCKET_BYTES,
        timeout: float | None = None,
    ) -> None:
        _check_lr(lr)
        if not (isinstance(bucket_bytes, int) and bucket_bytes >= 1):
            raise ValueError(
                f"bucket_bytes must be an integer >= 1, got {bucket_bytes!r}"
            )
        trained = _trained(
            params,
            "BucketedOptimizer takes one parameter group (the server groups have one",
        )
        super().__init__(cast(ParamsT, trained), {"lr": lr})
        self.client = client
        self.group = group
        named = [
            item if isinstance(item, tuple) else (f"p{i}", item)
            for i, item in enumerate(trained)
        ]
        sizes = [p.numel() * p.element_size() for _, p in named]
        self.buckets: list[RemoteOptimizer] = [
            RemoteOptimizer(
                [named[i] for i in indices],
                client,
                group=f"{group}.{k}",
                lr=lr,
                optimizer=optimizer,
                consistency=consistency,
                allow_non_finite=allow_non_finite,
                lease_seconds=lease_seconds,
                join=join,
                missing_grad=missing_grad,
                timeout=timeout,
            )
            for k, indices in enumerate(_split(sizes, bucket_bytes))
        ]
        self._arrived = [0] * len(self.buckets)
        self._pending: dict[int, Pending] = {}
        self._sent: dict[int, list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(k))  # type: ignore[no-untyped-call]
            for k, bucket in enumerate(self.buckets)
            for p in bucket._params()
        ]

    def _hook(self, k: int) -> Callable[[torch.Tensor], None]:
        size = len(self.buckets[k]._params())

        def accumulated(p: torch.Tensor) -> None:
            if k in self._pending:
                raise RuntimeError(
                    f"a second backward() before step(): bucket {k} (group "
                    f"{self.group}.{k}) was pushed already. BucketedOptimizer pushes "
                    "each backward's gradients as they come; for gradient "
                    "accumulation use RemoteOptimizer"
                )
            self._arrived[k] += 1
            if self._arrived[k] == size:
                self._launch(k)

        return accumulated

    def _launch(self, k: int) -> None:
        bucket = self.buckets[k]
        bucket.param_groups[0]["lr"] = self.param_groups[0]["lr"]
        self._pending[k] = bucket._start()
        self._sent[k] = [
            (p, p.grad, p.grad._version) for p in bucket._params() if p.grad is not None
        ]

    def _check_unchanged(self) -> None:
        """RuntimeError when a gradient changed after its bucket was pushed."""
        sent, self._sent = self._sent, {}
        for k, grads in sorted(sent.items()):
            for p, g, version in grads:
                if p.grad is not g or g._version != version:
                    name = self.buckets[k].names[
                        [id(q) for q in self.buckets[k]._params()].index(id(p))
                    ]
                    raise RuntimeError(
                        f"the gradient of {name!r} changed after backward() "
                        f"(clipping, scaling?), but bucket {k} (group {self.group}."
                        f"{k}) had pushed it already: the step was taken with the "
                        "gradients backward made. Use RemoteOptimizer to change "
                        "gradients before step()"
                    )

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Push the buckets backward did not complete, then wait for every one:
        on return each bucket's step is applied and its X is in the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for k in range(len(self.buckets)):
            if k not in self._pending:
                self._launch(k)
        pending, self._pending = self._pending, {}
        self._arrived = [0] * len(self.buckets)
        failure: BaseException | None = None
        for k in sorted(pending):
            try:
                self.buckets[k]._finish(*pending[k])
            except BaseException as exc:  # wait for the others all the same
                failure = failure or exc
        if failure is not None:
            raise failure
        self._check_unchanged()
        return loss

    @property
    def versions(self) -> list[int]:
        """Each bucket's T that the parameters hold, bucket order."""
        return [b.version for b in self.buckets]

    def pull(self) -> list[int]:
        """Copy the server's X of every bucket into the parameters; their T."""
        return [b.pull() for b in self.buckets]

    def join(self) -> None:
        for b in self.buckets:
            b.join()

    def leave(self) -> None:
        for b in self.buckets:
            b.leave()

    def remove_hooks(self) -> None:
        """Stop pushing from backward (the parameters are then free of this
        optimizer's hooks); ``step()`` still pushes every bucket."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.param_groups:
            raise ValueError(
                "a BucketedOptimizer's tensors are fixed when its groups are created; "
                "create another optimizer (other groups) for more parameters"
            )
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict with each bucket's ``RemoteOptimizer`` state dict
        (the server's V, H and T) under ``"onnxps_buckets"``."""
        sd = super().state_dict()
        sd["onnxps_buckets"] = {
            "format_version": STATE_DICT_FORMAT_VERSION,
            "buckets": [b.state_dict() for b in self.buckets],
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore lr and every bucket's V, H and T (see ``RemoteOptimizer``)."""
        meta = state_dict.get("onnxps_buckets")
        if not isinstance(meta, dict):
            raise ValueError(
                "not a BucketedOptimizer state dict: it has no 'onnxps_buckets' entry"
            )
        saved = meta["buckets"]
        if len(saved) != len(self.buckets):
            raise ValueError(
                f"the state dict has {len(saved)} buckets, this optimizer "
                f"{len(self.buckets)}: construct it with the same bucket_bytes"
            )
        super().load_state_dict(
            {k: v for k, v in state_dict.items() if k != "onnxps_buckets"}
        )
        for bucket, sd in zip(self.buckets, saved, strict=True):
            bucket.load_state_dict(sd)
