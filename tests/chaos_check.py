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

import contextlib
import itertools
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SHARED = 8  # elements every push steps
LEARNING_RATE = 0.1
EPSILON = 1e-6
RTOL, ATOL = 1e-9, 1e-12
MAX_UNKNOWN_PER_ELEMENT = 12  # 2**12 subsets at most per element
ACK, REFUSED, UNKNOWN = "ack", "refused", "unknown"
SHARDS, REPLICAS = 2, 3
RESTART_DELAY = 1.0  # the supervisor's, after a replica's process exits
SLACK = 1.0  # a call may end this long after its deadline (a loaded host)
CONVERGE_WITHIN = 30.0  # seconds from the heal
TAIL = 10.0  # seconds of pushes after the last heal
CONVERGE_WATCH = 60.0  # how long the convergence is watched, to report its time


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
            + _explain(col, touching, acked, grads, h)
        )
    return None, f"element {col}: {len(found)} sets of its pushes fit"


def _explain(
    col: int,
    touching: Sequence[int],
    acked: set[int],
    grads: Mapping[int, np.ndarray],
    h: float,
) -> str:
    """Which acknowledged push is missing, or which push is in twice, when H says
    so (H is the sum of the squares of the gradients applied)."""
    full = sum(float(grads[k][col]) ** 2 for k in touching if k in acked)
    for k in touching:
        sq = float(grads[k][col]) ** 2
        if k in acked and _close(full - sq, h):
            return f": acknowledged push {k} is missing from the state"
        if _close(full + sq, h):
            return f": push {k} is in the state twice"
    return ""


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
            v.refused_applied[f"{got.get('code')}/{got.get('reason')}"] += 1
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


def outage(
    records: Sequence[Mapping[str, Any]], shard: int, start: float, until: float
) -> float | None:
    """The longest time without an acknowledgement on ``shard`` from a fault at
    ``start`` to ``until`` (the next fault): for a failover, from the fault to the
    first push acknowledged by the new primary. None: no acknowledgement then."""
    ends = sorted(
        float(r["end"])
        for r in records
        if r["shard"] == shard and r.get("outcome") == ACK
        and start < float(r["end"]) <= until
    )  # fmt: skip
    if not ends:
        return None
    return max(b - a for a, b in zip([start, *ends], ends, strict=False))


def redundant(
    sample: Mapping[str, Any],
    replicas: int,
    at_heal: Mapping[str, Any],
    ref: int | None,
) -> bool:
    """Whether ``sample`` (of one shard) shows a full replica set: a primary with a
    synchronous standby named in its term, every member registered again since
    the heal (``at_heal``: the members as the heal found them; a dead member's
    key outlives it by its lease), each standby's lsn at least ``ref``."""
    p, sync, members = sample.get("primary"), sample.get("sync"), sample["members"]
    if ref is None or not isinstance(p, dict) or len(members) < replicas:
        return False
    if not isinstance(sync, dict) or sync.get("term") != p["term"]:
        return False
    if not sync.get("standbys"):
        return False
    for member, info in members.items():
        if member in at_heal and info.get("_rev", 0) <= at_heal[member].get("_rev", 0):
            return False
        if member == p["member"]:  # the primary itself (not a restart of it)
            if info.get("role") != "primary" or info.get("term") != p["term"]:
                return False
            continue
        if info.get("role") != "standby" or int(info.get("lsn", -1)) < ref:
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
    """Seconds from ``since`` (a heal) to the first monitor sample of ``shard``
    before ``until`` showing every replica caught up: each standby's registered
    lsn at least the one its primary registered ``lag`` seconds before (members
    register about once a second: a resolution of 1 to 2 s; a registration counts
    only from 0.5 s after ``since``). None: not seen."""
    mine = [s for s in samples if s["shard"] == shard]
    at_heal: Mapping[str, Any] = {}
    for i, s in enumerate(mine):
        t = float(s["t"])
        if t <= since + 0.5:  # a registration sent before a kill may land after
            at_heal = s.get("members") or {}
            continue
        if t > until:
            break
        p = s.get("primary")
        ref = None
        for old in reversed(mine[:i]):
            if float(old["t"]) > t - lag:
                continue
            op = old.get("primary")
            if isinstance(p, dict) and isinstance(op, dict):
                info = (old.get("members") or {}).get(p["member"])
                if info and op["member"] == p["member"]:
                    ref = int(info.get("lsn", 0))
            break
        if redundant({**s, "members": s.get("members") or {}}, replicas, at_heal, ref):
            return t - since
    return None


# -- a run's records ----------------------------------------------------------------
@dataclass
class Run:
    seed: int
    duration: float
    workers: int
    out: Path
    m: int = 256
    gap: tuple[float, float] = (4.0, 7.0)
    interval: float = 0.1
    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    faults: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    sampling: bool = False
    behind: dict[str, str] = field(default_factory=dict)  # replicas' last states


def load_records(out: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(out.glob("worker*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    # one record per (group, seq): the outcome line wins over the intent line
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for rec in records:
        key = (rec["group"], rec["seq"])
        if key not in latest or rec.get("outcome") is not None:
            latest[key] = rec
    return list(latest.values())


# -- the report --------------------------------------------------------------------
def save(
    r: Run, converged: dict[str, float | None], final: dict[str, Any], healed: float
) -> None:
    """What the checker needs beside the workers' and the monitor's files:
    ``run.json`` and the primaries' final states in ``final.npz``."""
    meta = {
        "seed": r.seed, "duration": r.duration, "workers": r.workers, "m": r.m,
        "gap": r.gap, "groups": r.groups, "faults": r.faults, "events": r.events,
        "behind": r.behind, "converged": converged, "healed": healed,
    }  # fmt: skip
    (r.out / "run.json").write_text(json.dumps(meta, indent=1))
    arrays = {}
    for g, (t, x, h) in final.items():
        arrays[f"{g}/t"], arrays[f"{g}/x"], arrays[f"{g}/h"] = np.array(t), x, h
    np.savez(r.out / "final.npz", **arrays)  # type: ignore[arg-type]


def load(out: Path) -> dict[str, Any]:
    """A saved run's report again (``python tests/chaos.py check DIR``)."""
    meta = json.loads((out / "run.json").read_text())
    lo, hi = meta["gap"]
    r = Run(meta["seed"], meta["duration"], meta["workers"], out, meta["m"], (lo, hi),
            groups=meta["groups"], faults=meta["faults"], events=meta["events"],
            behind=meta["behind"])  # fmt: skip
    with open(out / "monitor.jsonl") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                r.samples.append(json.loads(line))
    final: dict[str, Any] = {}
    with np.load(out / "final.npz") as npz:
        for g in r.groups:
            if f"{g}/t" in npz:
                final[g] = (int(npz[f"{g}/t"]), npz[f"{g}/x"], npz[f"{g}/h"])
    return report(r, meta["converged"], final, meta["healed"])


def report(
    r: Run,
    converged: dict[str, float | None],
    final: dict[str, Any],
    healed: float,
) -> dict[str, Any]:
    records = load_records(r.out)
    lines: list[str] = []
    outcomes = Counter(str(x.get("outcome")) for x in records)
    refused = Counter(str(x.get("code")) for x in records if x["outcome"] == REFUSED)
    unknown = Counter(str(x.get("code")) for x in records if x["outcome"] == UNKNOWN)
    lines.append(
        f"pushes: {len(records)} issued, {outcomes[ACK]} acknowledged, "
        f"{outcomes[REFUSED]} refused {dict(refused)}, {outcomes[UNKNOWN]} unknown "
        f"{dict(unknown)}, {outcomes['None']} without outcome (worker stopped)"
    )
    # every acknowledged push exactly once at its T; the state a serial replay
    history: list[str] = []
    replay: list[str] = []
    refused_applied: Counter[str] = Counter()
    unknown_applied = late = 0
    by_group: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        by_group[rec["group"]].append(rec)
    for g, meta in r.groups.items():
        if g not in final:
            history.append(f"{g}: no final state read from its primary")
            continue
        t, x, h = final[g]
        v = check_group(g, by_group[g], t, x, h, seed=r.seed, gi=meta["gi"], m=r.m)
        for e in v.errors:
            (replay if e.startswith("a serial replay") else history).append(f"{g}: {e}")
        refused_applied += v.refused_applied
        unknown_applied += v.unknown_applied
        late += v.late
        lines.append(
            f"  {g} (shard {meta['shard']}): T={t}, {v.acked} acknowledged, "
            f"{v.applied} applied ({v.unknown_applied} of them without an ack)"
        )
    lines.append(
        f"applied without an ack: {unknown_applied} (of them refused: "
        f"{dict(refused_applied)}); applied after a later push: {late}"
    )
    # deadlines
    over = [
        float(x["end"]) - float(x["start"]) - float(x["deadline"])
        for x in records
        if x.get("outcome") is not None
    ]
    worst = max(over, default=0.0)
    lines.append(f"calls: the longest ended {worst:+.2f} s past its deadline")
    # one primary per term
    split = one_primary_per_term(r.samples)
    terms = {(s["shard"], s["primary"]["term"]) for s in r.samples
             if isinstance(s.get("primary"), dict)}  # fmt: skip
    lines.append(f"terms seen: {len(terms)} over {len(r.samples)} samples of etcd")
    # faults, failover and redundancy
    kinds = Counter(f["kind"] for f in r.faults)
    lines.append(f"faults: {len(r.faults)} {dict(sorted(kinds.items()))}")
    exits = Counter(e["exit"] for e in r.events if "exit" in e)
    lines.append(f"replica exits by status: {dict(exits)} (each restarted after "
                 f"{RESTART_DELAY:.0f} s)")  # fmt: skip
    failover: dict[str, list[float]] = defaultdict(list)
    back: dict[str, list[float]] = defaultdict(list)
    never: dict[str, list[str]] = defaultdict(list)
    for i, f in enumerate(r.faults):
        until = r.faults[i + 1]["start"] if i + 1 < len(r.faults) else healed
        shards = [f["shard"]] if f["shard"] is not None else list(range(SHARDS))
        for s in shards:
            took = outage(records, s, f["start"], until)
            if took is not None:
                failover[f["kind"]].append(took)
            got = redundancy_back(r.samples, s, REPLICAS, f["end"], until)
            if got is None:
                never[f["kind"]].append(f"shard {s} ({until - f['end']:.0f} s)")
            else:
                back[f["kind"]].append(got)
    lines.append("longest time without an ack on the fault's shard, fault to next:")
    lines += [f"  {k}: {spread(v)}" for k, v in sorted(failover.items())]
    lines.append("heal -> every replica of the shard caught up (etcd's lsn, 2 s):")
    for k in sorted(kinds):
        miss = f"; not before the next fault: {never[k]}" if never[k] else ""
        lines.append(f"  {k}: {spread(back[k])}{miss}")
    late_replicas = {m: v for m, v in converged.items()
                     if v is None or v > CONVERGE_WITHIN}  # fmt: skip
    lines.append(
        f"each replica equal to its primary (T, X, H of every group; read once the "
        f"workers stopped, {TAIL:.0f} s after the heal) this long after the heal: "
        + ", ".join(
            f"{m} {'never' if v is None else f'{v:.1f} s'}"
            for m, v in sorted(converged.items())
        )
        + f" (watched {CONVERGE_WATCH:.0f} s after the workers' stop)"
    )
    verdicts = {
        "acked_applied_once_at_their_T": (not history, history[:10]),
        "state_is_a_serial_replay": (not replay, replay[:10]),
        "one_primary_per_term": (not split, split[:10]),
        "no_call_past_its_deadline": (
            worst <= SLACK,
            [f"a call ended {worst:.2f} s past its deadline (slack {SLACK} s)"],
        ),
        "replicas_converge_within_30s": (
            not late_replicas,
            [f"{m}: " + ("not seen" if v is None
                         else f"{v:.1f} s") + f"; last seen: {r.behind.get(m)}"
             for m, v in late_replicas.items()],
        ),
    }  # fmt: skip
    for name, (ok, why) in verdicts.items():
        lines.append(f"verdict {name}: {'HOLDS' if ok else 'FAILED'}")
        lines += [f"    {w}" for w in ([] if ok else why)]
    return {
        "seed": r.seed,
        "duration": r.duration,
        "text": "\n".join(lines),
        "verdicts": {k: {"ok": ok, "why": why} for k, (ok, why) in verdicts.items()},
        "pushes": dict(outcomes),
        "faults": dict(kinds),
        "failover": {k: sorted(v) for k, v in failover.items()},
        "redundancy": {k: sorted(v) for k, v in back.items()},
        "redundancy_missed": dict(never),
        "converged": converged,
    }
