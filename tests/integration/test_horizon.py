"""The horizon watchdog: names the transaction that holds back vacuum, and sees dead rows
pile up on the hot table."""

from __future__ import annotations

import logging
from collections import deque

import anyio
import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.clock import FakeClock
from pgjobd.roles import RoleContext
from pgjobd.roles.horizon import HorizonWatchdog, held_since_s
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.anyio


@given(
    steps=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=30),
    horizon=st.integers(min_value=0, max_value=2000),
)
def test_the_xid_clock_dates_a_horizon_no_later_than_it_was_issued(
    steps: list[int], horizon: int
) -> None:
    samples: deque[tuple[float, int]] = deque()
    next_xid = 0
    for second, step in enumerate(steps):
        next_xid += step
        samples.append((float(second), next_xid))
    now = float(len(steps))
    held = held_since_s(samples, horizon, now)
    assert 0.0 <= held <= now
    # never more than since the first sample past the horizon
    past = [at for at, xid in samples if xid > horizon]
    assert held == (now - past[0] if past else 0.0)


async def test_an_open_transaction_is_named_as_the_culprit(
    dsn: str, leading: RoleContext, caplog: pytest.LogCaptureFixture
) -> None:
    culprit = await asyncpg.connect(dsn, server_settings={"application_name": "nightly-report"})
    try:
        tx = culprit.transaction(isolation="repeatable_read")
        await tx.start()
        await culprit.fetchval("SELECT pg_current_xact_id()")  # an xid, and a snapshot

        # Sessions of other tests (the database is shared) may pin an older xmin for a
        # moment: wait until theirs have ended and the culprit is the oldest holder.
        async def culprit_oldest() -> bool:
            oldest = await leading.queries.horizon_holders(leading.pool, 1, None)
            return oldest[0].pid == culprit.get_server_pid()

        await wait_until(culprit_oldest, 30, "the culprit to hold the oldest xmin")
        # The watchdog's time starts when the culprit's transaction has started, and
        # moves on 1.5 s without anyone waiting for it.
        clock = FakeClock(await culprit.fetchval("SELECT statement_timestamp()"))
        watchdog = HorizonWatchdog(held_warn_s=1.0, clock=clock)
        await watchdog.tick(leading)  # starts the xid clock
        clock.advance(seconds=1.5)
        with caplog.at_level(logging.WARNING, logger="pgjobd.roles.horizon"):
            await watchdog.tick(leading)
        await tx.rollback()
    finally:
        await culprit.close()

    reading = watchdog.last
    assert reading is not None and reading.holder is not None
    assert reading.holder.pid == culprit.get_server_pid()
    assert reading.holder.name == "nightly-report"
    assert reading.holder.state == "idle in transaction"
    assert reading.holder.xact_age_s is not None and reading.holder.xact_age_s >= 1.5
    assert reading.held_s >= 1.5
    assert reading.wraparound_age > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"pid {culprit.get_server_pid()} (nightly-report" in m and "query started" in m
        for m in warnings
    ), warnings

    # It let go: no longer named, and the alarm clears.
    with caplog.at_level(logging.INFO, logger="pgjobd.roles.horizon"):
        await watchdog.tick(leading)
    assert watchdog.last is not None
    held_by = watchdog.last.holder
    assert held_by is None or held_by.pid != culprit.get_server_pid()


async def test_churn_without_a_held_horizon_is_not_warned_about(
    conn: asyncpg.Connection, schema: str, leading: RoleContext, caplog: pytest.LogCaptureFixture
) -> None:
    # A loaded queue: jobs come and go, the small hot table is nearly all dead rows
    # between two autovacuums, and nothing holds the horizon. Nothing to act on.
    watchdog = HorizonWatchdog()
    with caplog.at_level(logging.INFO, logger="pgjobd.roles.horizon"):
        for _ in range(6):
            await conn.execute(
                f"INSERT INTO {schema}.job (state, queue, kind, args) "
                "SELECT 'available', 'default', 'noop', '{}' FROM generate_series(1, 5000)"
            )
            await conn.execute(f"DELETE FROM {schema}.job")
            await conn.execute("SELECT pg_stat_force_next_flush()")
            await watchdog.tick(leading)
    reading = watchdog.last
    assert reading is not None
    assert (reading.dead_rows > 10_000 and reading.dead_ratio > 0.5) or reading.vacuum_count
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_dead_rows_on_the_hot_table_are_reported(
    conn: asyncpg.Connection, schema: str, leading: RoleContext, caplog: pytest.LogCaptureFixture
) -> None:
    await conn.execute(f"ALTER TABLE {schema}.job SET (autovacuum_enabled = false)")
    await conn.execute(
        f"INSERT INTO {schema}.job (state, queue, kind, args) "
        "SELECT 'available', 'default', 'noop', '{}' FROM generate_series(1, 3000)"
    )
    await conn.execute(f"DELETE FROM {schema}.job WHERE id % 10 <> 0")
    await conn.execute("SELECT pg_stat_force_next_flush()")
    clock = FakeClock(await conn.fetchval("SELECT now()"))
    watchdog = HorizonWatchdog(dead_rows_warn=1000, dead_rows_for_s=0.5, clock=clock)

    def warned() -> bool:
        return any("dead rows" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="pgjobd.roles.horizon"):
        for _ in range(100):  # the statistics reach the view within a second or so
            await watchdog.tick(leading)
            if warned():
                break
            clock.advance(seconds=1)  # the watchdog's time: past dead_rows_for_s at once
            await anyio.sleep(0.2)  # the server's time, for the statistics to arrive

    reading = watchdog.last
    assert reading is not None
    assert reading.live_rows == 300
    assert reading.dead_ratio == pytest.approx(0.9)
    assert any(
        f"{schema}.job is 90 % dead rows" in r.getMessage()
        and "has not been vacuumed for" in r.getMessage()
        and "last autovacuum never" in r.getMessage()
        for r in caplog.records
    )
