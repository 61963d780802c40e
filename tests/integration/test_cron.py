"""The cron ticker against the database, ticked in-process on a FakeClock (the
statements' `coalesce($now, now())` hook): one job per slot, catch-up after downtime,
DST, two overlapping leaders, config sync, and bad 'api' rows."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec
import pytest

from pgjobd.clock import FakeClock
from pgjobd.config import Config, CronEntry, DatabaseConfig
from pgjobd.queries import for_schema
from pgjobd.roles import Deposed, RoleContext
from pgjobd.roles.cron import CronTicker, trigger
from tests.captured_events import events, records_of

pytestmark = pytest.mark.anyio


def entry(name: str, schedule: str, **fields: Any) -> CronEntry:
    return msgspec.convert(
        {"name": name, "schedule": schedule, "kind": fields.pop("kind", "report"), **fields},
        CronEntry,
    )


Contexts = Callable[..., RoleContext]


@pytest.fixture
async def contexts(dsn: str, schema: str) -> AsyncIterator[Contexts]:
    """Makes role contexts for a config. Terms 1 and 2 are both open, by fiat (two
    overlapping leaders); pass deposed=True for a term that has ended."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    open_terms = await pool.fetch(
        f"INSERT INTO {schema}.leader (member, backend_pid) VALUES ('one', 0), ('two', 0) "
        "RETURNING term"
    )
    assert [r["term"] for r in open_terms] == [1, 2]
    ended = await pool.fetchval(
        f"INSERT INTO {schema}.leader (member, backend_pid, resigned_at) "
        "VALUES ('gone', 0, now()) RETURNING term"
    )

    def make(*cron: CronEntry, term: int = 1, deposed: bool = False) -> RoleContext:
        config = Config(database=DatabaseConfig(schema=schema), cron=cron)
        return RoleContext(pool, for_schema(schema), config, "test", ended if deposed else term)

    try:
        yield make
    finally:
        await pool.close()


async def jobs(conn: asyncpg.Connection, schema: str) -> list[asyncpg.Record]:
    return await conn.fetch(
        f"SELECT id, kind, queue, run_at, unique_key, args FROM {schema}.job ORDER BY run_at, id"
    )


async def cron_row(conn: asyncpg.Connection, schema: str, name: str) -> asyncpg.Record | None:
    return await conn.fetchrow(f"SELECT * FROM {schema}.cron WHERE name = $1", name)


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


async def test_each_slot_fires_once_with_run_at_the_slot(
    conn: asyncpg.Connection, schema: str, contexts: Contexts
) -> None:
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    ticker = CronTicker(clock=clock)
    ctx = contexts(entry("minutely", "* * * * *", args={"to": "ops"}, queue="reports"))

    await ticker.tick(ctx)  # created now: nothing of the past fires
    assert await jobs(conn, schema) == []
    for _ in range(3):
        clock.advance(seconds=20)
        await ticker.tick(ctx)
        await ticker.tick(ctx)

    rows = await jobs(conn, schema)
    assert [r["run_at"] for r in rows] == [utc(2026, 5, 1, 10, 1)]
    assert rows[0]["unique_key"] == "cron:minutely:2026-05-01T10:01:00Z"
    assert rows[0]["queue"] == "reports"
    assert rows[0]["kind"] == "report"
    assert msgspec.json.decode(rows[0]["args"]) == {"to": "ops"}
    row = await cron_row(conn, schema, "minutely")
    assert row is not None
    assert row["last_slot"] == utc(2026, 5, 1, 10, 1)
    assert 0 < ticker.interval_s(ctx.config) <= 1.0


async def test_queue_defaults_to_the_kinds_declared_queue(
    conn: asyncpg.Connection, schema: str, contexts: Contexts
) -> None:
    await conn.execute(f"INSERT INTO {schema}.kind (name, queue) VALUES ('mail', 'outbox')")
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    ticker = CronTicker(clock=clock)
    ctx = contexts(entry("mailer", "* * * * *", kind="mail"), entry("other", "* * * * *"))
    await ticker.tick(ctx)
    clock.advance(minutes=1)
    await ticker.tick(ctx)
    assert {(r["kind"], r["queue"]) for r in await jobs(conn, schema)} == {
        ("mail", "outbox"),
        ("report", "default"),
    }


async def test_catch_up_policies_after_downtime(
    conn: asyncpg.Connection, schema: str, contexts: Contexts
) -> None:
    clock = FakeClock(utc(2026, 5, 1, 9, 59))
    ticker = CronTicker(clock=clock)
    ctx = contexts(
        entry("none", "0 * * * *", catch_up="none", kind="k_none"),
        entry("latest", "0 * * * *", catch_up="latest", kind="k_latest"),
        entry("all", "0 * * * *", catch_up="all", catch_up_limit=3, kind="k_all"),
    )
    await ticker.tick(ctx)
    clock.set(utc(2026, 5, 1, 15, 10))  # down from before 10:00 until 15:10

    await ticker.tick(ctx)

    fired: dict[str, list[int]] = {}
    for r in await jobs(conn, schema):
        fired.setdefault(r["kind"], []).append(r["run_at"].hour)
    assert fired == {"k_latest": [15], "k_all": [13, 14, 15]}  # none: 15:00 is 10 min late
    for name in ("none", "latest", "all"):
        row = await cron_row(conn, schema, name)
        assert row is not None
        assert row["last_slot"] == utc(2026, 5, 1, 15)  # skipped slots stay skipped

    clock.set(utc(2026, 5, 1, 16, 0, 20))  # back to normal: all three on time
    await ticker.tick(ctx)
    assert await conn.fetchval(
        f"SELECT count(*) FROM {schema}.job WHERE run_at = '2026-05-01 16:00+00'"
    ) == 3  # fmt: skip


@pytest.mark.parametrize(
    ("zone", "schedule", "start", "expected"),
    [
        ("America/New_York", "30 2 * * *", utc(2026, 3, 8, 5), [utc(2026, 3, 8, 7)]),
        ("America/New_York", "30 1 * * *", utc(2026, 11, 1, 4), [utc(2026, 11, 1, 5, 30)]),
        ("Europe/London", "30 1 * * *", utc(2026, 3, 29, 0), [utc(2026, 3, 29, 1)]),
        ("Europe/London", "30 1 * * *", utc(2026, 10, 24, 23), [utc(2026, 10, 25, 0, 30)]),
        ("Australia/Lord_Howe", "15 2 * * *", utc(2026, 10, 3, 14), [utc(2026, 10, 3, 15, 30)]),
        ("Australia/Lord_Howe", "45 1 * * *", utc(2026, 4, 4, 13), [utc(2026, 4, 4, 14, 45)]),
    ],
)  # fmt: skip
async def test_a_daily_job_fires_once_across_dst(
    *, conn: asyncpg.Connection, schema: str, contexts: Contexts,
    zone: str, schedule: str, start: datetime, expected: list[datetime],
) -> None:  # fmt: skip
    clock = FakeClock(start)
    ticker = CronTicker(clock=clock)
    ctx = contexts(entry("daily", schedule, timezone=zone, catch_up="none"))
    while clock.now() < start + timedelta(hours=4):  # ticks every 5 minutes through the night
        await ticker.tick(ctx)
        clock.advance(minutes=5)
    assert [r["run_at"] for r in await jobs(conn, schema)] == expected


async def test_two_leaders_ticking_the_same_slots_enqueue_each_once(
    conn: asyncpg.Connection, schema: str, contexts: Contexts
) -> None:
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    cron = (entry("a", "* * * * *", catch_up="all"), entry("b", "*/2 * * * *"))
    # Both "leaders" by fiat: fenced on the one session that holds the lock.
    first, second = CronTicker(clock=clock), CronTicker(clock=clock)
    ctx_1, ctx_2 = contexts(*cron, term=1), contexts(*cron, term=2)
    await asyncio.gather(first.tick(ctx_1), second.tick(ctx_2))
    for _ in range(20):
        clock.advance(seconds=30)
        await asyncio.gather(first.tick(ctx_1), second.tick(ctx_2), first.tick(ctx_1))

    keys = [r["unique_key"] for r in await jobs(conn, schema)]
    assert len(keys) == len(set(keys)) == 10 + 5


async def test_a_slot_read_by_two_leaders_fires_once_even_after_its_job_completed(
    conn: asyncpg.Connection, schema: str, contexts: Contexts
) -> None:
    # Leader 1 and leader 2 both read the schedule; leader 1 fires and its job
    # completes (freeing the unique key) before leader 2 fires: the compare-and-set on
    # last_slot, not the unique key, stops leader 2.
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    cron = entry("a", "* * * * *", catch_up="all")
    first, second = CronTicker(clock=clock), CronTicker(clock=clock)
    ctx_1, ctx_2 = contexts(cron, term=1), contexts(cron, term=2)
    await first.tick(ctx_1)
    clock.advance(minutes=2)
    plan_1, plan_2 = await first.plan(conn, ctx_1), await second.plan(conn, ctx_2)
    assert [len(f.due.slots) for f in plan_1] == [len(f.due.slots) for f in plan_2] == [2]

    assert await first.fire(conn, ctx_1, plan_1[0])
    assert len(await jobs(conn, schema)) == 2
    await conn.execute(f"DELETE FROM {schema}.job")  # both completed
    assert not await second.fire(conn, ctx_2, plan_2[0])

    assert await jobs(conn, schema) == []


async def test_a_deposed_leader_fires_and_syncs_nothing(
    conn: asyncpg.Connection, schema: str, contexts: Contexts
) -> None:
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    leader = contexts(entry("a", "* * * * *"))
    await CronTicker(clock=clock).tick(leader)
    clock.advance(minutes=1)
    deposed = contexts(entry("a", "* * * * *"), entry("new", "* * * * *"), deposed=True)

    with pytest.raises(Deposed):
        await CronTicker(clock=clock).tick(deposed)

    assert await jobs(conn, schema) == []
    assert await cron_row(conn, schema, "new") is None
    row = await cron_row(conn, schema, "a")
    assert row is not None
    assert row["last_slot"] is None


async def test_a_completed_cron_job_does_not_fire_its_slot_again(
    conn: asyncpg.Connection, schema: str, contexts: Contexts
) -> None:
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    ticker = CronTicker(clock=clock)
    ctx = contexts(entry("a", "*/5 * * * *", catch_up="all"))
    await ticker.tick(ctx)
    clock.set(utc(2026, 5, 1, 10, 5, 1))
    await ticker.tick(ctx)
    assert len(await jobs(conn, schema)) == 1
    await conn.execute(f"DELETE FROM {schema}.job")  # completed: its unique key is free

    for _ in range(3):
        await CronTicker(clock=clock).tick(ctx)  # even a fresh ticker (a new leader)
        clock.advance(seconds=10)

    assert await jobs(conn, schema) == []


async def test_config_sync_adds_changes_and_removes(
    conn: asyncpg.Connection, schema: str, contexts: Contexts, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    ticker = CronTicker(clock=clock)
    await conn.execute(
        f"INSERT INTO {schema}.cron (name, schedule, kind, source, updated_at) VALUES "
        "('from_api', '0 * * * *', 'report', 'api', $1), "
        "('taken', '0 * * * *', 'report', 'api', $1)",
        clock.now(),
    )
    await ticker.tick(contexts(entry("keep", "* * * * *"), entry("drop", "* * * * *")))
    clock.advance(minutes=1)
    await ticker.tick(contexts(entry("keep", "* * * * *"), entry("drop", "* * * * *")))
    keep = await cron_row(conn, schema, "keep")
    assert keep is not None
    assert keep["last_slot"] == utc(2026, 5, 1, 10, 1)

    caplog.set_level(logging.INFO, logger="pgjobd.roles.cron")
    clock.advance(seconds=10)
    changed = entry("keep", "0 3 * * *", timezone="Europe/London", args={"v": 2})
    await ticker.tick(contexts(changed, entry("added", "@daily"), entry("taken", "@hourly")))

    names = {r["name"]: r for r in await conn.fetch(f"SELECT * FROM {schema}.cron")}
    assert set(names) == {"keep", "added", "from_api", "taken"}  # "drop" is gone
    keep = names["keep"]
    assert (keep["schedule"], keep["timezone"], keep["last_slot"]) == (
        "0 3 * * *", "Europe/London", None,
    )  # fmt: skip  # a new schedule starts afresh
    assert keep["updated_at"] == clock.now()
    assert msgspec.json.decode(keep["args"]) == {"v": 2}
    assert names["added"]["source"] == "config"
    assert names["from_api"]["source"] == "api"
    assert (names["taken"]["source"], names["taken"]["schedule"]) == ("config", "@hourly")
    logged = set(events(caplog))
    assert {"cron.added", "cron.changed", "cron.removed", "cron.taken_over"} <= logged

    # Unchanged config: nothing is rewritten.
    before = await conn.fetchval(f"SELECT max(updated_at) FROM {schema}.cron")
    clock.advance(minutes=5)
    await ticker.tick(contexts(changed, entry("added", "@daily"), entry("taken", "@hourly")))
    assert await conn.fetchval(f"SELECT max(updated_at) FROM {schema}.cron") == before


async def test_bad_api_rows_are_logged_once_and_skipped(
    conn: asyncpg.Connection, schema: str, contexts: Contexts, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    await conn.execute(
        f"INSERT INTO {schema}.cron (name, schedule, timezone, kind, source, updated_at) "
        "VALUES ('bad_schedule', '61 * * * *', 'UTC', 'report', 'api', $1), "
        "('bad_zone', '* * * * *', 'Mars/Olympus_Mons', 'report', 'api', $1), "
        "('bad_kind', '* * * * *', 'UTC', 'no spaces allowed', 'api', $1), "
        "('good', '* * * * *', 'UTC', 'report', 'api', $1)",
        clock.now(),
    )
    ticker = CronTicker(clock=clock)
    ctx = contexts()
    caplog.set_level(logging.INFO, logger="pgjobd.roles.cron")
    for _ in range(3):
        clock.advance(minutes=1)
        await ticker.tick(ctx)

    assert [r["unique_key"] for r in await jobs(conn, schema)] == [
        "cron:good:2026-05-01T10:01:00Z",
        "cron:good:2026-05-01T10:02:00Z",
        "cron:good:2026-05-01T10:03:00Z",
    ]
    bad = records_of(caplog, "cron.bad_schedule")
    assert sorted(getattr(r, "cron", "") for r in bad) == ["bad_kind", "bad_schedule", "bad_zone"]


async def test_trigger_enqueues_now_without_touching_the_slots(
    conn: asyncpg.Connection, schema: str, contexts: Contexts
) -> None:
    clock = FakeClock(utc(2026, 5, 1, 10, 0, 30))
    ticker = CronTicker(clock=clock)
    ctx = contexts(entry("nightly", "0 3 * * *"))
    await ticker.tick(ctx)
    queries = for_schema(schema)

    first = await trigger(conn, queries, "nightly")
    second = await trigger(ctx.pool, queries, "nightly")

    assert first is not None and second is not None and first != second
    assert await trigger(conn, queries, "no_such_schedule") is None
    keys = [r["unique_key"] for r in await jobs(conn, schema)]
    assert all(k.startswith("cron:nightly:trigger:") for k in keys)
    row = await cron_row(conn, schema, "nightly")
    assert row is not None
    assert row["last_slot"] is None
