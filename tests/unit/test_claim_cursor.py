"""The producer's claim cursor (pgjobd/producer.py, ClaimCursor): where a claim of a
queue without flow control starts, against a model of it under any sequence of full
and short claims and clock steps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd import producer
from pgjobd.producer import CURSOR_HEAD_S, ClaimCursor
from pgjobd.statements.job import ClaimKey, ClaimRow

T0 = datetime(2026, 12, 4, tzinfo=UTC)


def _row(key: ClaimKey) -> ClaimRow:
    return ClaimRow(
        id=key.id, fence=1, kind="k", queue="q", attempt=1, max_attempts=20, crashes=0,
        priority=key.priority, tenant=None, enqueued_at=T0, scheduled_at=key.run_at,
        args="{}", waited_s=0.0,
    )  # fmt: skip


KEYS = st.builds(
    ClaimKey,
    priority=st.integers(-(2**15), 2**15 - 1),
    run_at=st.integers(0, 10**6).map(lambda s: T0 + timedelta(seconds=s)),
    id=st.integers(1, 2**63 - 1),
)
STEPS = st.lists(
    st.tuples(
        st.lists(KEYS, max_size=5),  # the claim's rows
        st.integers(1, 5),  # its limit
        st.sampled_from([0.0, 0.01, CURSOR_HEAD_S]),  # time passing before it
    ),
    max_size=30,
)


@given(steps=STEPS)
def test_the_cursor_starts_after_the_furthest_full_claim_until_the_head_is_due(
    steps: list[tuple[list[ClaimKey], int, float]],
) -> None:
    now = [1000.0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(producer.time, "monotonic", lambda: now[0])
        _run(steps, now)


def _run(steps: list[tuple[list[ClaimKey], int, float]], now: list[float]) -> None:
    cursor = ClaimCursor()
    model: ClaimKey | None = None
    head_at = -1e9
    for keys, limit, elapsed in steps:
        now[0] += elapsed
        if now[0] - head_at >= CURSOR_HEAD_S:
            model = None
        if model is None:
            head_at = now[0]
        assert cursor.start() == model
        rows = [_row(k) for k in keys[:limit]]
        cursor.took(rows, limit)
        if len(rows) < limit:
            model = None
        else:
            model = max([*(k for k in keys[:limit]), *([model] if model else [])])
        assert cursor.after == model


def test_a_short_claim_sends_the_next_one_to_the_head() -> None:
    cursor = ClaimCursor()
    assert cursor.start() is None
    cursor.took([_row(ClaimKey(0, T0, 5)), _row(ClaimKey(0, T0, 9))], 2)
    assert cursor.start() == ClaimKey(0, T0, 9)
    cursor.took([_row(ClaimKey(0, T0, 10))], 2)  # short: nothing more ahead
    assert cursor.start() is None
