"""A group's state set back to an earlier step (a rewind), under its lock.

The state itself (X, V, H, ids tables' rows and T as of the step) is computed by
``durability`` from a snapshot and the group's log records; here it is installed in
the live group, in place: callers holding the group keep holding it. What a rewind
drops, it drops for good: a sync round in progress (its waiting workers are told),
and the pushes applied after the step (a resend of one is refused, ``REWOUND``, not
applied into the new line of history).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnxps.wire.image import GroupImage

from ..errors import FailedPrecondition, InvalidArgument
from ._group import Group
from ._ids import IdsTable

__all__ = ["DROPPED", "check_image", "install_state", "rewound_error"]

Array = np.ndarray[Any, Any]

# The second field of an exactly-once result dropped by a rewind: (T, DROPPED).
# 0 and 1 are a buffered and an applied push (False and True).
DROPPED = 2


def check_image(g: Group, image: GroupImage) -> None:
    """The image is of this group's layout (dtype, tensors, tables)."""
    d = image.definition
    ours = g.definition()
    same = (
        np.dtype(d.dtype) == g.dtype
        and tuple(d.names) == ours.names
        and tuple(tuple(s) for s in d.shapes) == ours.shapes
        and tuple(t.name for t in d.tables) == tuple(g.tables)
        and d.optimizer == ours.optimizer
    )
    if not same:
        raise InvalidArgument(
            f"the state computed for group {g.name!r} has another layout than the "
            "group (it was deleted and created again meanwhile); retry the rewind",
            metadata={"group": g.name},
        )


def install_state(g: Group, image: GroupImage, incarnation: int) -> int:
    """Under the group's lock, no push in flight: X, V, H, the ids tables and T
    become the image's; returns T before. The learning rate, consistency settings,
    leases and the exactly-once windows stay (results dropped are marked)."""
    check_image(g, image)
    d = image.definition
    before = g.update_count
    n = len(g.names)
    dense = image.arrays[: d.dense_array_count]
    for k, a in enumerate(dense[:n]):
        np.copyto(g.xs[k], np.asarray(a).reshape(-1))
    for j, sname in enumerate(g.attrs.state_names):
        for k, a in enumerate(dense[n * (j + 1) : n * (j + 2)]):
            np.copyto(g.states[sname][k], np.asarray(a).reshape(-1))
    tables: dict[str, IdsTable] = {}
    for t, arrays in zip(d.tables, image.table_arrays(), strict=True):
        table = tables[t.name] = IdsTable(t, g.dtype, g.attrs.state_names)
        if arrays:
            ids, *rows = arrays
            table.load(ids, rows)
    g.tables = tables
    to_step = int(d.update_count)
    g.update_count = to_step
    g.pending.clear()  # a sync round in progress is dropped
    g.replay_step = None
    _drop_results(g, to_step)
    # a new line of history: shared copies of the old line's versions are not it
    g.incarnation = incarnation
    g.rewinds += 1
    g.rewound_from = max(g.rewound_from, before)
    g.rewound_to = to_step
    g.cond.notify_all()  # waiting calls learn of it (``_waits``)
    return before


def _drop_results(g: Group, to_step: int) -> None:
    """Mark the exactly-once results of pushes the rewind dropped: applied after
    ``to_step``, or buffered for a step at or after it."""
    for w in g.dedup.values():
        for seq, (t, state) in w.results.items():
            if state == DROPPED:
                continue
            if (state and t > to_step) or (not state and t >= to_step):
                w.results[seq] = (t, DROPPED)


def rewound_error(g: Group, what: str) -> FailedPrecondition:
    """The refusal of a call computed on the line of history a rewind dropped."""
    return FailedPrecondition(
        f"{what}, but group {g.name!r} was rewound to T={g.rewound_to} (from "
        f"T={g.rewound_from}) and is now at T={g.update_count}: the call belongs "
        "to the line of history the rewind dropped, so nothing was applied; pull "
        "the group and compute it again",
        reason="REWOUND",
        metadata={
            "group": g.name,
            "update_count": g.update_count,
            "rewound_to": g.rewound_to,
        },
    )
