"""The partition rotator: retention by dropping whole day partitions, across month and
year boundaries, fenced on the leader's lock, finishing an interrupted detach."""

from __future__ import annotations

import dataclasses
from datetime import date, timedelta

import asyncpg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgjobd.queries import for_schema
from pgjobd.roles import Deposed, RoleContext
from pgjobd.roles.partitions import PartitionRotator, expired_days, partition_day

pytestmark = pytest.mark.anyio


@given(
    today=st.dates(min_value=date(2000, 1, 1), max_value=date(2100, 1, 1)),
    keep_days=st.integers(min_value=1, max_value=120),
    span=st.integers(min_value=1, max_value=400),
)
def test_expired_days_are_exactly_those_past_retention(
    today: date, keep_days: int, span: int
) -> None:
    days = [today - timedelta(days=n) for n in range(span)]
    expired = set(expired_days(days, today, timedelta(days=keep_days)))
    for day in days:
        assert (day in expired) == ((today - day).days > keep_days)


@pytest.mark.parametrize(
    ("name", "day"),
    [
        ("job_history_p20261231", date(2026, 12, 31)),
        ("job_history_p20270101", date(2027, 1, 1)),
        ("job_history_p20240229", date(2024, 2, 29)),
        ("job_history_p20230229", None),  # not a day
        ("job_history_default", None),
        ("job_attempt_p20261231", None),  # another parent's
    ],
)
def test_partition_names_are_read_strictly(name: str, day: date | None) -> None:
    assert partition_day(name, "job_history") == day


async def _partitions(conn: asyncpg.Connection, schema: str, parent: str) -> set[str]:
    rows = await for_schema(schema).partition_list(conn, f"{schema}.{parent}")
    return {r.name for r in rows}


async def _add_day(conn: asyncpg.Connection, schema: str, parent: str, day: date) -> str:
    name = f"{parent}_p{day:%Y%m%d}"
    await conn.execute(
        f"CREATE TABLE {schema}.{name} PARTITION OF {schema}.{parent} "
        f"FOR VALUES FROM ('{day} 00:00+00') TO ('{day + timedelta(days=1)} 00:00+00')"
    )
    return name


async def test_old_partitions_are_dropped_across_month_and_year_ends(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    today: date = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    old_days = [date(2025, 12, 31), date(2026, 1, 1), date(2026, 2, 28), today - timedelta(8)]
    kept_day = today - timedelta(days=6)
    old = [await _add_day(conn, schema, "job_history", d) for d in old_days]
    kept = await _add_day(conn, schema, "job_history", kept_day)
    await conn.execute(
        f"INSERT INTO {schema}.job_history (id, finished_at, run_at, enqueued_at, attempt, "
        "max_attempts, priority, state, queue, kind, args) VALUES "
        "(1, '2026-01-01 12:00+00', now(), now(), 1, 1, 0, 'completed', 'q', 'k', '{}')"
    )

    await PartitionRotator().tick(leading)

    names = await _partitions(conn, schema, "job_history")
    assert not set(old) & names
    assert kept in names
    assert f"job_history_p{today:%Y%m%d}" in names
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history WHERE id = 1") == 0
    for name in old:  # dropped, not left detached
        assert await conn.fetchval("SELECT to_regclass($1)", f"{schema}.{name}") is None


async def test_an_interrupted_concurrent_detach_is_finished(
    dsn: str, conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    today: date = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    name = await _add_day(conn, schema, "job_attempt", today - timedelta(days=30))
    reader = await asyncpg.connect(dsn)
    try:
        # A transaction that still sees the partition makes the detach wait; cancel it.
        reader_tx = reader.transaction(isolation="repeatable_read")
        await reader_tx.start()
        await reader.fetchval(f"SELECT count(*) FROM {schema}.job_attempt")
        await conn.execute("SET statement_timeout = '300ms'")
        with pytest.raises(asyncpg.QueryCanceledError):
            await conn.execute(
                f"ALTER TABLE {schema}.job_attempt DETACH PARTITION {schema}.{name} CONCURRENTLY"
            )
        await conn.execute("RESET statement_timeout")
        await reader_tx.rollback()
    finally:
        await reader.close()
    pending = await conn.fetchval(
        "SELECT inhdetachpending FROM pg_inherits WHERE inhrelid = $1::regclass",
        f"{schema}.{name}",
    )
    assert pending

    await PartitionRotator().tick(leading)

    assert await conn.fetchval("SELECT to_regclass($1)", f"{schema}.{name}") is None


async def test_a_member_that_is_not_leader_detaches_nothing(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    today: date = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    name = await _add_day(conn, schema, "job_history", today - timedelta(days=40))
    deposed = dataclasses.replace(leading, term=leading.term + 1)  # a term not begun

    with pytest.raises(Deposed, match="no longer leader"):
        await PartitionRotator().tick(deposed)

    assert name in await _partitions(conn, schema, "job_history")
