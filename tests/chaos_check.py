"""The checker of the standing chaos test (tests/chaos.py): pure functions over what
a run recorded.

Every group is pushed by one worker thread only, serially, push ``k`` with the
gradient ``gradient(seed, gi, k, m)``: elements 0..7 ("shared") get a value from
every push, element ``8 + k % m`` ("dedicated") only from the pushes with that
``k % m``. The optimizer is Adagrad in float64 with no decay or regularization, so
an element changes only with the pushes that touch it: the final H (sum of the
squares of its gradients) and X of a dedicated element say which of the few pushes
touching it were applied, acknowledged or not. The applied set is then known
exactly; it must hold every acknowledged push, its size must be the final T, each
acknowledged push must sit at the T it was answered with (the applied pushes in
``k`` order, a push whose outcome was lost possibly later), and a serial replay in
T order must give the final X and H of every element.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SHARED = 8  # elements every push steps
LEARNING_RATE = 0.1
EPSILON = 1e-6
RTOL, ATOL = 1e-9, 1e-12
MAX_UNKNOWN_PER_ELEMENT = 12  # 2**12 subsets at most per element
ACK, REFUSED, UNKNOWN = "ack", "refused", "unknown"


def gradient(seed: int, gi: int, k: int, m: int) -> np.ndarray:
    """Push ``k`` of group ``gi``: nonzero on the shared elements and on one
    dedicated element; values of magnitude 0.5..1.5 with random signs."""
    rng = np.random.default_rng([seed, gi, k])
    g = np.zeros(SHARED + m, np.float64)
    values = rng.uniform(0.5, 1.5, SHARED + 1) * rng.choice([-1.0, 1.0], SHARED + 1)
    g[:SHARED] = values[:SHARED]
    g[SHARED + k % m] = values[SHARED]
    return g


def adagrad(x: np.ndarray, h: np.ndarray, g: np.ndarray) -> None:
    """ONNX Adagrad (decay_factor 0, norm_coefficient 0), in place."""
    h += g * g
    x -= LEARNING_RATE * g / (np.sqrt(h) + EPSILON)


def replay(pushes: Iterable[np.ndarray], size: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.zeros(size, np.float64)
    h = np.zeros(size, np.float64)
    for g in pushes:
        adagrad(x, h, g)
    return x, h


@dataclass
class GroupVerdict:
    group: str
    final_t: int
    acked: int
    applied: int
    unknown_applied: int
    refused_applied: Counter[str] = field(default_factory=Counter)
    late: int = 0  # lost-outcome pushes applied after a later push
    errors: list[str] = field(default_factory=list)


def _close(a: float, b: float) -> bool:
    return bool(abs(a - b) <= ATOL + RTOL * abs(b))


def _identify(
    e: int,
    touching: Sequence[int],
    acked: set[int],
    grads: Mapping[int, np.ndarray],
    x: float,
    h: float,
) -> tuple[set[int] | None, str]:
    """The pushes (of ``touching``, in k order) that make dedicated element ``e``
    end at ``x``, ``h``: every acknowledged one plus a subset of the others."""
    col = SHARED + e
    maybe = [k for k in touching if k not in acked]
    if len(maybe) > MAX_UNKNOWN_PER_ELEMENT:
        return None, f"element {col}: {len(maybe)} pushes of unknown outcome"
    found: list[set[int]] = []
    for n in range(len(maybe) + 1):
        for subset in itertools.combinations(maybe, n):
            chosen = set(subset) | (acked & set(touching))
            xe = he = 0.0
            for k in touching:
                if k in chosen:
                    g = float(grads[k][col])
                    he += g * g
                    xe -= LEARNING_RATE * g / (np.sqrt(he) + EPSILON)
            if _close(xe, x) and _close(he, h):
                found.append(chosen)
    if len(found) == 1:
        return found[0], ""
    if not found:
        return None, (
            f"element {col}: no set of its pushes {list(touching)} (acknowledged "
            f"{sorted(acked & set(touching))}) gives X={x!r} H={h!r}"
        )
    return None, f"element {col}: {len(found)} sets of its pushes fit"


def check_group(
    group: str,
    records: Sequence[Mapping[str, Any]],
    final_t: int,
    x: np.ndarray,
    h: np.ndarray,
    *,
    seed: int,
    gi: int,
    m: int,
) -> GroupVerdict:
    """Check one group's history (its records) against its final state."""
    outcomes: dict[int, Mapping[str, Any]] = {}
    issued: set[int] = set()
    for r in records:
        issued.add(int(r["seq"]))
        if r.get("outcome") is not None:
            outcomes[int(r["seq"])] = r
    acked = {k: int(r["t"]) for k, r in outcomes.items() if r["outcome"] == ACK}
    v = GroupVerdict(group, final_t, len(acked), 0, 0)
    ts = Counter(acked.values())
    if dupes := sorted(t for t, n in ts.items() if n > 1):
        v.errors.append(f"acknowledged Ts repeated: {dupes[:10]}")
    grads = {k: gradient(seed, gi, k, m) for k in issued}
    by_element: dict[int, list[int]] = defaultdict(list)
    for k in sorted(issued):
        by_element[k % m].append(k)
    applied: set[int] = set()
    for e in range(m):
        col = SHARED + e
        if e not in by_element:
            if x[col] != 0.0 or h[col] != 0.0:
                v.errors.append(f"element {col} changed with no push touching it")
            continue
        chosen, why = _identify(
            e, by_element[e], set(acked), grads, float(x[col]), float(h[col])
        )
        if chosen is None:
            v.errors.append(why)
            continue
        applied |= chosen
    if v.errors:
        return v
    v.applied = len(applied)
    unknown = applied - set(acked)
    v.unknown_applied = len(unknown)
    for k in unknown:
        got = outcomes.get(k)
        if got is not None and got["outcome"] == REFUSED:
            v.refused_applied[str(got.get("code"))] += 1
    if len(applied) != final_t:
        v.errors.append(
            f"final T is {final_t} but {len(applied)} pushes are in the state "
            f"({len(acked)} acknowledged, {len(unknown)} of unknown outcome)"
        )
        return v
    order = sorted(applied)  # the pushes in k order: T order for a serial writer
    slot = {k: i + 1 for i, k in enumerate(order)}
    if any(slot[k] != t for k, t in acked.items()):
        # a push whose outcome was lost may have been applied after later ones:
        # the acknowledged at their T, the others in k order in the free slots
        free = sorted(set(range(1, final_t + 1)) - set(acked.values()))
        if len(free) != len(unknown) or any(t > final_t for t in acked.values()):
            wrong = sorted((k, slot[k], t) for k, t in acked.items() if slot[k] != t)
            v.errors.append(f"acknowledged at another T than k order (k, T, acked T) "
                            f"{wrong[:5]}")  # fmt: skip
            return v
        order = [0] * final_t
        for k, t in acked.items():
            order[t - 1] = k
        for t, k in zip(free, sorted(unknown), strict=True):
            order[t - 1] = k
        v.late = sum(1 for i, k in enumerate(order) if i + 1 != slot[k])
    rx, rh = replay((grads[k] for k in order), SHARED + m)
    if not (np.allclose(rx, x, RTOL, ATOL) and np.allclose(rh, h, RTOL, ATOL)):
        bad = int(np.argmax(np.abs(rx - x)))
        v.errors.append(
            f"a serial replay of the {final_t} applied pushes in T order does not give "
            f"the final state: element {bad} X {x[bad]!r} against {rx[bad]!r}"
        )
    return v


# -- figures -----------------------------------------------------------------------
def spread(values: Sequence[float]) -> str:
    """``median m, p90 p, max M (n)`` in seconds."""
    if not values:
        return "none"
    s = sorted(values)
    p90 = s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]
    return (
        f"median {statistics.median(s):.2f} s, p90 {p90:.2f} s, max {s[-1]:.2f} s "
        f"(n={len(s)})"
    )


def one_primary_per_term(samples: Sequence[Mapping[str, Any]]) -> list[str]:
    """Members seen as primary of one shard in one term (from etcd's primary key
    and from the members' own registrations): more than one is a violation."""
    seen: dict[tuple[int, int], set[str]] = defaultdict(set)
    for s in samples:
        p = s.get("primary")
        if isinstance(p, dict):
            seen[(int(s["shard"]), int(p["term"]))].add(str(p["member"]))
        for member, info in (s.get("members") or {}).items():
            if info.get("role") == "primary" and "term" in info:
                seen[(int(s["shard"]), int(info["term"]))].add(str(member))
    return [
        f"shard {shard} term {term}: primaries {sorted(ms)}"
        for (shard, term), ms in sorted(seen.items())
        if len(ms) > 1
    ]


def first_ack_after(
    records: Sequence[Mapping[str, Any]], shard: int, when: float
) -> float | None:
    """Seconds from ``when`` to the end of the first acknowledged push on ``shard``
    that started at or after ``when``."""
    ends = [
        float(r["end"])
        for r in records
        if r.get("outcome") == ACK and r["shard"] == shard and r["start"] >= when
    ]
    return min(ends) - when if ends else None


def redundant(
    samples: Sequence[Mapping[str, Any]], shard: int, replicas: int, at: int, lag: float
) -> bool:
    """Whether the monitor's sample ``at`` of ``shard`` shows a full replica set:
    a primary, every member registered in its term, a synchronous standby named,
    and every standby's lsn at least the primary's ``lag`` seconds earlier."""
    s = samples[at]
    p, sync, members = s.get("primary"), s.get("sync"), s.get("members") or {}
    if not isinstance(p, dict) or len(members) < replicas:
        return False
    if not isinstance(sync, dict) or sync.get("term") != p["term"]:
        return False
    if not sync.get("standbys"):
        return False
    ref, before = None, dict[str, Any]()
    for old in reversed(samples[:at]):
        if old["shard"] != shard or float(old["t"]) > float(s["t"]) - lag:
            continue
        op = old.get("primary")
        before = old.get("members") or {}
        info = before.get(p["member"])
        if isinstance(op, dict) and op["member"] == p["member"] and info:
            ref = int(info.get("lsn", 0))
        break
    if ref is None:
        return False
    for member, info in members.items():
        if member == p["member"]:
            continue
        if info.get("role") != "standby" or int(info.get("lsn", -1)) < ref:
            return False
        # registered again since (a dead member's key outlives it by its lease)
        if member in before and info.get("_rev", 0) <= before[member].get("_rev", 0):
            return False
    return True


def redundancy_back(
    samples: Sequence[Mapping[str, Any]],
    shard: int,
    replicas: int,
    since: float,
    until: float,
    lag: float = 2.0,
) -> float | None:
    """Seconds from ``since`` to the first monitor sample of ``shard`` before
    ``until`` that shows a full, caught-up replica set (None: not seen)."""
    mine = [s for s in samples if s["shard"] == shard]
    for i, s in enumerate(mine):
        t = float(s["t"])
        if since <= t <= until and redundant(mine, shard, replicas, i, lag):
            return t - since
    return None
