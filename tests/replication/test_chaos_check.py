"""The chaos test's checker (tests/chaos_check.py) on made-up histories: it passes
a history the server could have produced and catches each kind of violation."""

from __future__ import annotations

from typing import Any

import pytest
from chaos_check import (
    ACK,
    REFUSED,
    SHARED,
    UNKNOWN,
    check_group,
    gradient,
    one_primary_per_term,
    outage,
    redundancy_back,
    replay,
)

SEED, GI, M = 5, 3, 16


def _records(outcomes: dict[int, tuple[str, int | None]]) -> list[dict[str, Any]]:
    out = []
    for k, (outcome, t) in sorted(outcomes.items()):
        rec: dict[str, Any] = {"seq": k, "outcome": outcome, "shard": 0}
        if outcome == ACK:
            rec["t"] = t
        if outcome == REFUSED:
            rec["code"] = "UNAVAILABLE"
        out.append(rec)
    return out


def _check(applied: list[int], outcomes: dict[int, tuple[str, int | None]]) -> Any:
    x, h = replay((gradient(SEED, GI, k, M) for k in applied), SHARED + M)
    return check_group(
        "g", _records(outcomes), len(applied), x, h, seed=SEED, gi=GI, m=M
    )


def _history(n: int, lost: set[int], applied_lost: set[int]) -> tuple[list[int], Any]:
    """Pushes 0..n-1; those in ``lost`` timed out, of which ``applied_lost`` were
    applied anyway; the others acknowledged at their place."""
    applied = [k for k in range(n) if k not in lost or k in applied_lost]
    outcomes: dict[int, tuple[str, int | None]] = {}
    for k in range(n):
        outcomes[k] = (UNKNOWN, None) if k in lost else (ACK, applied.index(k) + 1)
    return applied, outcomes


def test_a_history_with_lost_outcomes_applied_or_not_passes() -> None:
    # 40 pushes over 16 dedicated elements: three pushes share some elements
    applied, outcomes = _history(40, {3, 4, 19, 20, 35}, {4, 20})
    v = _check(applied, outcomes)
    assert v.errors == []
    assert (v.acked, v.applied, v.unknown_applied) == (35, 37, 2)


def test_a_refused_push_found_applied_is_counted() -> None:
    applied, outcomes = _history(20, {7}, {7})
    outcomes[7] = (REFUSED, None)
    v = _check(applied, outcomes)
    assert v.errors == [] and v.refused_applied == {"UNAVAILABLE/None": 1}


def test_a_lost_outcome_applied_after_a_later_push_passes_as_late() -> None:
    # push 5 timed out, then applied after push 6 (T 6 and 7 swapped)
    order = [0, 1, 2, 3, 4, 6, 5, 7]
    outcomes: dict[int, tuple[str, int | None]] = {
        k: (ACK, order.index(k) + 1) for k in order
    }
    outcomes[5] = (UNKNOWN, None)
    v = _check(order, outcomes)
    assert v.errors == [] and v.late == 2


def test_an_acknowledged_push_missing_is_caught() -> None:
    applied, outcomes = _history(20, set(), set())
    applied.remove(11)
    v = _check(applied, outcomes)
    assert v.errors and "acknowledged push 11 is missing" in v.errors[0]


def test_an_acknowledged_push_applied_twice_is_caught() -> None:
    applied, outcomes = _history(20, set(), set())
    v = _check([*applied[:10], 9, *applied[10:]], outcomes)
    assert v.errors


def test_a_wrong_t_in_an_answer_is_caught() -> None:
    applied, outcomes = _history(20, set(), set())
    outcomes[12] = (ACK, 12)  # should be 13
    outcomes[11] = (ACK, 13)  # two answers swapped
    v = _check(applied, outcomes)
    assert v.errors


def test_a_repeated_t_is_caught() -> None:
    applied, outcomes = _history(10, set(), set())
    outcomes[4] = (ACK, 4)
    v = _check(applied, outcomes)
    assert any("repeated" in e for e in v.errors)


def test_pushes_applied_in_another_order_are_caught() -> None:
    applied, outcomes = _history(12, set(), set())
    swapped = [*applied[:5], applied[6], applied[5], *applied[7:]]
    x, h = replay((gradient(SEED, GI, k, M) for k in swapped), SHARED + M)
    v = check_group("g", _records(outcomes), 12, x, h, seed=SEED, gi=GI, m=M)
    assert v.errors


def test_two_primaries_in_one_term_are_caught() -> None:
    one = {"shard": 0, "primary": {"member": "a", "term": 3}, "members": {}}
    other = {"shard": 0, "primary": None,
             "members": {"b": {"role": "primary", "term": 3}}}  # fmt: skip
    assert one_primary_per_term([one]) == []
    both = one_primary_per_term([one, other])
    assert both == ["shard 0 term 3: primaries ['a', 'b']"]


def test_outage_is_the_longest_time_without_an_ack_after_the_fault() -> None:
    recs = [
        {"shard": 0, "outcome": ACK, "start": 9.9, "end": 10.1},
        {"shard": 0, "outcome": UNKNOWN, "start": 10.2, "end": 14.2},
        {"shard": 0, "outcome": ACK, "start": 10.3, "end": 13.0},
        {"shard": 0, "outcome": REFUSED, "start": 14.3, "end": 14.4},
        {"shard": 0, "outcome": ACK, "start": 14.5, "end": 15.0},
        {"shard": 1, "outcome": ACK, "start": 11.0, "end": 11.1},
    ]
    assert outage(recs, 0, 10.0, 20.0) == pytest.approx(2.9)
    assert outage(recs, 1, 10.0, 20.0) == pytest.approx(1.1)
    assert outage(recs, 1, 12.0, 20.0) is None


def _sample(
    t: float, primary: str, members: dict[str, tuple[str, int, int]]
) -> dict[str, Any]:
    """A monitor sample of shard 0: members as (role, lsn, revision), term 1."""
    return {
        "t": t,
        "shard": 0,
        "primary": {"member": primary, "term": 1},
        "sync": {"primary": primary, "term": 1, "standbys": ["b"]},
        "members": {
            m: {"role": role, "lsn": lsn, "term": 1, "_rev": rev}
            for m, (role, lsn, rev) in members.items()
        },
    }


def test_redundancy_needs_every_member_registered_again_and_caught_up() -> None:
    old = {"a": ("primary", 100, 1), "b": ("standby", 100, 2), "c": ("standby", 90, 3)}
    samples = [
        _sample(9.0, "a", old),  # 2 s before the sample at 11.0
        _sample(10.0, "a", old),  # the heal at 10.0
        # a registration sent before the heal, seen just after it: not counted
        _sample(10.3, "a", {**old, "c": ("standby", 100, 4)}),
        # c registered again but behind what a had 2 s before
        _sample(
            11.0,
            "a",
            {
                "a": ("primary", 120, 5),
                "b": ("standby", 120, 6),
                "c": ("standby", 99, 7),
            },
        ),  # fmt: skip
        _sample(
            11.5,
            "a",
            {
                "a": ("primary", 130, 8),
                "b": ("standby", 130, 9),
                "c": ("standby", 130, 10),
            },
        ),  # fmt: skip
    ]
    assert redundancy_back(samples, 0, 3, 10.0, 20.0) == pytest.approx(1.5)
    assert redundancy_back(samples, 0, 3, 10.0, 11.2) is None


def test_a_dead_primary_restarted_as_a_standby_is_no_redundancy() -> None:
    # etcd still names "a" primary (its lease) while "a" came back as a standby
    before = {"a": ("primary", 100, 1), "b": ("standby", 100, 2),
              "c": ("standby", 100, 3)}  # fmt: skip
    back = {"a": ("standby", 100, 4), "b": ("standby", 100, 5),
            "c": ("standby", 100, 6)}  # fmt: skip
    samples = [_sample(t, "a", before) for t in (7.0, 8.0, 9.0, 10.0)]
    samples += [_sample(t, "a", back) for t in (11.0, 12.0, 13.0)]
    assert redundancy_back(samples, 0, 3, 10.0, 20.0) is None
