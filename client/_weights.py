"""Groups to and from model weights files (.safetensors, .onnx): the operations
behind ``Client.export`` and ``Client.import_`` for those extensions.

The files hold X alone, by tensor name (``onnxps.wire.weights``). An export pulls
each group (a split group's parts joined, as ``pull`` joins them) and writes its
tensors; an import creates a group from the file's tensors, or writes them into a
group the server has already (same names, shapes and dtype), keeping its optimizer,
state, T and settings. Everything is checked before anything changes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from onnxps.wire.image import GroupDefinition, ImageFormatError
from onnxps.wire.onnx_weights import (
    OnnxTraining,
    onnx_target,
    read_onnx,
    write_onnx_into,
)
from onnxps.wire.weights import (
    Progress,
    Weights,
    WeightsFileError,
    file_format,
    read_safetensors,
    write_safetensors,
)

from ._optimizers import Async, OptimizerSpec
from ._transfer import (
    OPTIMIZERS,
    ExportFileError,
    ImportResult,
    consistency_of,
    definition_of,
    optimizer_of,
)

if TYPE_CHECKING:
    from ._ops import Op
    from ._records import GroupInfo
    from ._transfer import TransferHost as CoreHost

__all__ = [
    "WEIGHTS_FORMAT",
    "WeightsExport",
    "export_weights_op",
    "import_weights_op",
]

Array = np.ndarray[Any, Any]
WEIGHTS_FORMAT = "onnxps-weights"  # the __metadata__ "format" of an export
WEIGHTS_FORMAT_VERSION = "1"


@dataclass(frozen=True)
class WeightsExport:
    """What an export to .safetensors or .onnx wrote: the groups, their tensors,
    and (.onnx) the float initializers of the base model left as they were."""

    groups: list[str]
    tensors: list[str]
    kept: list[str]


class _Stages:
    """One progress count over two passes of the same bytes (pull then write; read
    then send): ``first(done, total)``, then ``second(done)``."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.total = 0

    def first(self, done: int, total: int) -> None:
        self.total = total
        if self.progress is not None:
            self.progress(done, 2 * total)

    def second(self, done: int, _total: int = 0) -> None:
        if self.progress is not None:
            self.progress(self.total + done, 2 * self.total)


def _refuse(message: str) -> ExportFileError:
    return ExportFileError(message)


def _selected(client: CoreHost, group: str | None, prefix: str) -> Op[list[GroupInfo]]:
    infos = yield from client._list_groups(prefix)
    if group is not None:
        infos = [i for i in infos if i.name == group]
        if not infos:
            raise _refuse(
                f"the server has no group {group!r}{_under(prefix)} (onnxps status "
                "lists them)"
            )
    if not infos:
        raise _refuse(f"the server has no group{_under(prefix)} to export")
    tabled = [i.name for i in infos if i.tables]
    if tabled:
        raise _refuse(
            f"group {', '.join(tabled)} has ids tables, whose rows are keyed by ids a "
            "model file does not hold: export it to an .npz file"
        )
    seen: dict[str, str] = {}
    for info in infos:
        for name, _ in info.tensors:
            if name in seen:
                raise _refuse(
                    f"tensor {name!r} is in groups {seen[name]!r} and {info.name!r}; "
                    "a model file holds each name once: export one group (--group, "
                    "group=)"
                )
            seen[name] = info.name
    return infos


def _under(prefix: str) -> str:
    return f" whose name starts with {prefix!r}" if prefix else ""


def export_weights_op(
    client: CoreHost,
    path: str | os.PathLike[str],
    *,
    group: str | None = None,
    prefix: str = "",
    model: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> Op[WeightsExport]:
    """Write the tensors of ``group`` (None: of every group whose name starts
    with ``prefix``) to a .safetensors file, or into a copy of the ONNX ``model``
    (.onnx)."""
    fmt = file_format(path)
    if fmt == "onnx" and model is None:
        raise _refuse(
            f"an export to {os.fspath(path)} writes the trained values into a copy of "
            "an ONNX model: name that model (model=..., onnxps export --model "
            "BASE.onnx)"
        )
    if fmt != "onnx" and model is not None:
        raise ValueError("model= names the ONNX model of an .onnx export")
    infos = yield from _selected(client, group, prefix)
    target = None
    if model is not None:  # checked before anything is pulled
        layout = {n: (i.dtype, s) for i in infos for n, s in i.tensors}
        try:
            target = onnx_target(model, layout)
        except WeightsFileError as exc:
            raise _refuse(str(exc)) from None
    stages = _Stages(progress)
    total = sum(i.nbytes for i in infos)
    tensors: list[tuple[str, Array]] = []
    definitions = []
    for info in infos:
        t, values = yield from client._pull_versioned(info.name)
        lr = (yield from client._describe_group(info.name)).learning_rate
        definitions.append(definition_of(info, t, lr))
        tensors += [(n, v) for (n, _), v in zip(info.tensors, values, strict=True)]
        stages.first(sum(a.nbytes for _, a in tensors), total)
    names = [i.name for i in infos]
    try:
        if target is not None:
            done = write_onnx_into(target, path, dict(tensors), stages.second)
            return WeightsExport(names, done.written, done.kept)
        metadata = {
            "format": WEIGHTS_FORMAT,
            "format_version": WEIGHTS_FORMAT_VERSION,
            "groups": json.dumps([d.to_json() for d in definitions]),
        }
        write_safetensors(path, tensors, metadata, stages.second)
    except WeightsFileError as exc:
        raise _refuse(str(exc)) from None
    return WeightsExport(names, [n for n, _ in tensors], [])


@dataclass(frozen=True)
class _Plan:
    """A group to create or write from a file: its tensors in group order, and what
    the file says of its training: an onnxps export's definition, or an ONNX
    model's optimizer node (None: nothing). ``left_out``: float tensors of the file
    that are not the group's (name, why)."""

    name: str
    tensors: list[tuple[str, Array]]
    definition: GroupDefinition | None = None
    training: OnnxTraining | None = None
    left_out: tuple[tuple[str, str], ...] = ()


def _read(path: str, progress: Progress) -> Weights:
    try:
        if file_format(path) == "onnx":
            return read_onnx(path, progress)
        return read_safetensors(path, progress)
    except WeightsFileError as exc:
        raise _refuse(str(exc)) from None


def _definitions(path: str, weights: Weights) -> list[GroupDefinition] | None:
    """The groups an onnxps export says its file holds (None: another file)."""
    meta = weights.metadata
    if meta.get("format") != WEIGHTS_FORMAT:
        return None
    if meta.get("format_version") != WEIGHTS_FORMAT_VERSION:
        raise _refuse(
            f"{path} has onnxps weights format_version "
            f"{meta.get('format_version')!r}; this onnxps reads version "
            f"{WEIGHTS_FORMAT_VERSION}"
        )
    try:
        return [GroupDefinition.from_json(d, path) for d in json.loads(meta["groups"])]
    except (KeyError, TypeError, ValueError, ImageFormatError) as exc:
        raise _refuse(f"{path}: malformed onnxps metadata ({exc})") from None


def _plans(path: str, weights: Weights, group: str | None, asked: bool) -> list[_Plan]:
    """The groups of the file; ``asked``: the import was given an optimizer."""
    definitions = _definitions(path, weights)
    if definitions is None:
        if not weights.tensors:
            raise _refuse(f"{path} holds no float32 or float64 tensor to import")
        name = group or os.path.splitext(os.path.basename(path))[0]
        training = _training(path, weights.training, asked)
        if training is None:
            return [_Plan(name, weights.tensors)]
        return [_trained(path, name, weights, training)]
    if group is not None:
        chosen = [d for d in definitions if d.name == group]
        if not chosen:
            raise _refuse(
                f"{path} holds group {', '.join(d.name for d in definitions)}, not "
                f"{group!r} (an onnxps export: --group, group=, picks one of its "
                "groups)"
            )
        definitions = chosen
    by_name = dict(weights.tensors)
    plans = []
    for d in definitions:
        missing = [n for n in d.names if n not in by_name]
        if missing:
            raise _refuse(f"{path}: group {d.name!r} lacks tensor {missing[0]!r}")
        plans.append(_Plan(d.name, [(n, by_name[n]) for n in d.names], d))
    return plans


def _training(
    path: str, nodes: Sequence[OnnxTraining], asked: bool
) -> OnnxTraining | None:
    """The ONNX model's one optimizer node; None for none, or for several when
    the import was given an optimizer (then every float initializer is taken)."""
    if len(nodes) > 1 and not asked:
        raise _refuse(
            f"{path} trains with {len(nodes)} optimizer nodes ("
            + ", ".join(n.optimizer for n in nodes)
            + "); a group has one: give the optimizer and learning rate to import "
            "every float initializer as one group (optimizer=, learning_rate=; "
            "--optimizer, --learning-rate)"
        )
    return nodes[0] if len(nodes) == 1 else None


def _trained(path: str, name: str, weights: Weights, node: OnnxTraining) -> _Plan:
    """The group of the tensors the model's optimizer node updates, in its order."""
    by_name = dict(weights.tensors)
    stray = [n for n in node.tensors if n not in by_name]
    if not node.tensors:
        raise _refuse(f"{path}: its {node.optimizer} node updates no tensor")
    if stray:
        raise _refuse(
            f"{path}: its {node.optimizer} node updates {stray[0]!r}, which is not a "
            "float32 or float64 initializer of the model's graph"
        )
    why = f"not updated by the model's {node.optimizer}"
    rest = tuple(
        (n, f"{a.dtype}, {why}") for n, a in weights.tensors if n not in node.tensors
    )
    tensors = [(n, by_name[n]) for n in node.tensors]
    return _Plan(name, tensors, training=node, left_out=rest)


def _layout(tensors: Sequence[tuple[str, Any]], dtype: Any) -> str:
    return f"{np.dtype(dtype)} " + ", ".join(
        f"{n} {tuple(getattr(a, 'shape', a))}" for n, a in tensors
    )


def _fits(path: str, plan: _Plan, info: GroupInfo) -> list[tuple[str, Array]]:
    """The plan's tensors in the group's order, if they are the group's (names,
    shapes, dtype); ``ExportFileError`` otherwise."""
    mine = dict(plan.tensors)
    dtype = plan.tensors[0][1].dtype
    same = set(mine) == {n for n, _ in info.tensors} and dtype == info.dtype
    if same and all(mine[n].shape == s for n, s in info.tensors) and not info.tables:
        return [(n, mine[n]) for n, _ in info.tensors]
    raise _refuse(
        f"group {info.name!r} on the server holds {_layout(info.tensors, info.dtype)}"
        f"{' and ids tables' if info.tables else ''}; {path} holds "
        f"{_layout(plan.tensors, dtype)}: nothing was imported (import into a new "
        "group: --group NAME, group=NAME)"
    )


def _from_node(path: str, node: OnnxTraining) -> OptimizerSpec:
    try:
        return OPTIMIZERS[node.optimizer](**node.attributes)
    except (TypeError, ValueError) as exc:
        raise _refuse(
            f"{path}: its {node.optimizer} node's attributes do not make an onnxps "
            f"optimizer ({exc}): give the optimizer (optimizer=, --optimizer)"
        ) from None


def _how(
    path: str,
    plan: _Plan,
    optimizer: OptimizerSpec | None,
    learning_rate: float | None,
) -> tuple[OptimizerSpec, float]:
    d, node = plan.definition, plan.training
    spec = optimizer
    if spec is None and node is not None:
        spec = _from_node(path, node)
    if spec is None and d is not None:
        spec = optimizer_of(d)
    lr = learning_rate
    if lr is None:
        lr = node.learning_rate if node else (d.learning_rate if d else None)
    if spec is None or lr is None:
        raise _refuse(
            f"{path} does not say how to train group {plan.name!r}, which the server "
            "does not have: give the optimizer and learning rate to create it with "
            "(optimizer=Adam(), learning_rate=0.01; onnxps import --optimizer adam "
            "--learning-rate 0.01)"
        )
    return spec, lr


def import_weights_op(
    client: CoreHost,
    path: str | os.PathLike[str],
    *,
    group: str | None = None,
    optimizer: OptimizerSpec | None = None,
    learning_rate: float | None = None,
    progress: Progress | None = None,
) -> Op[ImportResult]:
    """Create or write the groups of a .safetensors or .onnx file (see the module
    docstring); every group is checked before any is changed."""
    path = os.fspath(path)
    stages = _Stages(progress)
    weights = _read(path, stages.first)
    stages.first(weights.nbytes, weights.nbytes)
    plans = _plans(path, weights, group, optimizer is not None)
    on_server = {i.name: i for i in (yield from client._list_groups())}
    steps: list[Callable[[], Op[Any]]] = []
    created: list[str] = []
    updated: list[str] = []
    for plan in plans:
        info = on_server.get(plan.name)
        if info is not None:
            steps.append(_updater(client, info, _fits(path, plan, info)))
            updated.append(plan.name)
        else:
            how = _how(path, plan, optimizer, learning_rate)
            steps.append(_creator(client, plan, *how))
            created.append(plan.name)
    sent = 0
    for plan, step in zip(plans, steps, strict=True):
        yield from step()
        sent += sum(a.nbytes for _, a in plan.tensors)
        stages.second(sent)
    return ImportResult(
        [p.name for p in plans],
        created,
        [],
        [],
        updated=updated,
        left_out=list(weights.left_out) + [x for p in plans for x in p.left_out],
    )


def _creator(
    client: CoreHost, plan: _Plan, spec: OptimizerSpec, lr: float
) -> Callable[[], Op[Any]]:
    d = plan.definition

    def create() -> Op[Any]:
        return client._create_group(
            plan.name,
            spec,
            learning_rate=lr,
            tensors=plan.tensors,
            consistency=consistency_of(d.consistency) if d else Async(),
            allow_non_finite=d.allow_non_finite if d else False,
            lease_seconds=d.lease_seconds if d else None,
        )

    return create


def _updater(
    client: CoreHost, info: GroupInfo, tensors: list[tuple[str, Array]]
) -> Callable[[], Op[Any]]:
    """The group created again with these X and everything else it had: optimizer,
    learning rate, state V/H, T, consistency and lease settings."""

    def update() -> Op[Any]:
        t, arrays = yield from client._pull_versioned(info.name, state=True)
        state = arrays[len(tensors) :]
        del arrays  # X: the file's from now on
        lr = (yield from client._describe_group(info.name)).learning_rate
        yield from client._delete_group(info.name)
        return (
            yield from client._create_group(
                info.name,
                info.optimizer,
                learning_rate=lr,
                tensors=tensors,
                consistency=info.consistency,
                allow_non_finite=info.allow_non_finite,
                state=state,
                update_count=t,
                lease_seconds=info.lease_seconds,
            )
        )

    return update
