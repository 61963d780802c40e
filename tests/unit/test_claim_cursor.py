"""The producer's claim cursor (pgjobd/producer.py, ClaimCursor): where a claim of a
queue without flow control starts and when to look behind it, against a model of it
under any sequence of full and short claims, clock steps and looks that found a job."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

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
CLAIM = st.tuples(
    st.just("claim"),
    st.lists(KEYS, max_size=5),  # the claim's rows
    st.integers(1, 5),  # its limit
    st.sampled_from([0.0, 0.01, CURSOR_HEAD_S]),  # time passing before it
    st.none() | st.integers(0, 3),  # a look's find arriving while it is in flight
)
# A look behind the cursor that found a job: begun at the cursor of `back` steps ago.
BEHIND = st.tuples(st.just("behind"), st.integers(0, 3))
STEPS = st.lists(st.one_of(CLAIM, BEHIND), max_size=40)


@given(steps=STEPS)
def test_the_cursor_follows_the_furthest_claim_until_a_job_is_found_behind_it(
    steps: list[tuple[Any, ...]],
) -> None:
    now = [1000.0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(producer.time, "monotonic", lambda: now[0])
        _run(steps, now)


def _run(steps: list[tuple[Any, ...]], now: list[float]) -> None:
    cursor = ClaimCursor()
    model: ClaimKey | None = None
    looked_at = -1e9
    history: list[ClaimKey | None] = [None]  # the cursor after each step

    def found_behind(back: int) -> bool:
        """A look begun `back` steps ago found a job; whether it sent the cursor home."""
        nonlocal model
        looked_after = history[max(0, len(history) - 1 - back)]
        if looked_after is None:
            return False  # (no look begins without a cursor)
        cursor.behind(looked_after)
        if model is not None and model >= looked_after:
            model = None
            return True
        return False

    for step in steps:
        if step[0] == "behind":
            found_behind(step[1])
        else:
            _, keys, limit, elapsed, behind_during = step
            now[0] += elapsed
            start = cursor.start()
            assert start.after == model
            sent_home = behind_during is not None and found_behind(behind_during)
            rows = [_row(k) for k in keys[:limit]]
            look = cursor.took(start, rows, limit)
            expected = False
            if not sent_home:  # (a claim begun before the cursor went home moves nothing)
                if rows:
                    model = max([*(k for k in keys[:limit]), *([model] if model else [])])
                expected = model is not None and (
                    len(rows) < limit or now[0] - looked_at >= CURSOR_HEAD_S
                )
            if expected:
                looked_at = now[0]
            assert look == expected
        assert cursor.after == model
        history.append(model)


def test_a_short_claim_keeps_the_cursor_and_asks_for_a_look_behind_it() -> None:
    cursor = ClaimCursor()
    assert cursor.start().after is None
    assert not cursor.took(cursor.start(), [], 2)  # no cursor yet: nothing to look behind
    rows = [_row(ClaimKey(0, T0, 5)), _row(ClaimKey(0, T0, 9))]
    assert cursor.took(cursor.start(), rows, 2)  # the first look
    assert cursor.start().after == ClaimKey(0, T0, 9)
    rows = [_row(ClaimKey(0, T0, 11)), _row(ClaimKey(0, T0, 12))]
    assert not cursor.took(cursor.start(), rows, 2)  # full, within CURSOR_HEAD_S
    assert cursor.took(cursor.start(), [_row(ClaimKey(0, T0, 13))], 2)  # short: look now
    assert cursor.start().after == ClaimKey(0, T0, 13)
    assert cursor.took(cursor.start(), [], 2)
    cursor.behind(ClaimKey(0, T0, 13))  # a job was found before it
    assert cursor.start().after is None


def test_a_claim_in_flight_as_the_cursor_goes_home_does_not_move_it() -> None:
    """Regression: the other claim loop's claim, begun after the cursor, ended after a
    look had sent the cursor to the head and moved it past the job found behind again,
    before any claim from the head; at every look the same (a busy queue's urgent job
    waited for the backlog to run out)."""
    cursor = ClaimCursor()
    cursor.took(cursor.start(), [_row(ClaimKey(5, T0, 9))], 1)
    in_flight = cursor.start()
    cursor.behind(ClaimKey(5, T0, 9))
    cursor.took(in_flight, [_row(ClaimKey(5, T0, 10))], 1)
    assert cursor.start().after is None


def test_a_look_begun_before_a_claim_from_the_head_does_not_send_the_next_there_again() -> None:
    cursor = ClaimCursor()
    cursor.took(cursor.start(), [_row(ClaimKey(0, T0, 9))], 1)
    cursor.behind(ClaimKey(0, T0, 9))
    cursor.took(cursor.start(), [_row(ClaimKey(-1, T0, 20))], 1)  # the job found, taken
    cursor.behind(ClaimKey(0, T0, 9))  # a second look's find, begun before that claim
    assert cursor.start().after == ClaimKey(-1, T0, 20)
