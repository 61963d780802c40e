"""The `limits` chaos scenario's invariants catch what they are meant to: fed a ledger
that breaks each limit, each reports it; fed one that keeps them, none does."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from chaos.invariants import Verdict, check_limits

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(ms: float) -> datetime:
    return T0 + timedelta(milliseconds=ms)


def tables(
    runs: list[tuple[int, str, float, float]],
    history: list[tuple[int, str, str, float, str | None]],
    lost: tuple[tuple[int, int], ...] = (),
) -> dict[str, list[dict[str, Any]]]:
    return {
        "chaos_ledger": [
            {"job_id": j, "attempt": 1, "kind": kind, "started_at": at(s), "ended_at": at(e)}
            for j, kind, s, e in runs
        ],
        "job_history": [
            {
                "id": j,
                "kind": kind,
                "queue": queue,
                "attempted_at": at(start),
                "priority": 0,
                "args": {"group": group} if group else {},
            }
            for j, kind, queue, start, group in history
        ],
        "job_attempt": [{"job_id": j, "attempt": a, "outcome": "lease_expired"} for j, a in lost],
    }


def verdict(t: dict[str, list[dict[str, Any]]]) -> Verdict:
    v = Verdict()
    check_limits(t, v, concurrency={"limited": 2}, rate={"q": (2, 1.0)}, grouped_kinds={"grouped"})
    return v


def test_a_ledger_within_the_limits_passes() -> None:
    t = tables(
        [(1, "limited", 0, 100), (2, "limited", 0, 100), (3, "limited", 100, 200),
         (4, "grouped", 0, 50), (5, "grouped", 60, 90)],
        [(1, "limited", "q", 0, None), (2, "limited", "q", 10, None),
         (3, "limited", "q", 1000, None), (4, "grouped", "g", 0, "a"),
         (5, "grouped", "g", 60, "a")],
    )  # fmt: skip
    assert verdict(t).violations == []


def test_each_broken_limit_is_reported() -> None:
    t = tables(
        [(1, "limited", 0, 100), (2, "limited", 10, 100), (3, "limited", 50, 200),
         (4, "grouped", 0, 50), (5, "grouped", 40, 90)],
        [(1, "limited", "q", 0, None), (2, "limited", "q", 10, None),
         (3, "limited", "q", 999, None), (4, "grouped", "g", 0, "a"),
         (5, "grouped", "g", 40, "a")],
    )  # fmt: skip
    found = " | ".join(verdict(t).violations)
    assert "more than 2 limited jobs running at once" in found
    assert "more than 2 starts of queue q in a 1s window" in found
    assert "group a: job 5 started" in found


def test_an_execution_that_lost_its_lease_no_longer_counts() -> None:
    t = tables(
        [(1, "limited", 0, 5000), (2, "limited", 10, 100), (3, "limited", 50, 200)],
        [(2, "limited", "q", 10, None), (3, "limited", "q", 1500, None)],
        lost=((1, 1),),
    )
    assert verdict(t).violations == []
