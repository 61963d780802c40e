"""A member whose clock is hours off (libfaketime) behaves like the others beside it,
because every time decision is the database's now() (issue 18): its leases, its
retries' run times, the cron slots and the partitions it handles as leader. Its own
timers (heartbeats, lease renewals, role intervals) run on the monotonic clock, which
libfaketime shifts too, by a constant: they keep their pace.

The skew is chosen to put the member's clock on another UTC date than the database's,
so a date taken from the wrong clock shows in the partitions."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from pgjobd.migrate import ensure_past_partitions

from .conftest import DEFAULT_QUEUES, MemberProcess, wait_all_final, wait_until
from .events import JSON_LOG, wait_for_event

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
StartMember = Callable[..., Awaitable[MemberProcess]]
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
LEASE = "2s"
HANDLERS = """
import asyncio
from pgjobd import JobContext, Retry, job

@job(queue="skewed")
async def holds_past_its_lease(args: dict, ctx: JobContext) -> int:
    await asyncio.sleep(args["hold_s"])
    return ctx.attempt

@job(queue="skewed")
async def retries_after_2s(args: dict, ctx: JobContext) -> int:
    if ctx.attempt == 1:
        raise Retry(after="2s")
    return ctx.attempt

@job(queue="skewed")
async def cron_slot(args: dict, ctx: JobContext) -> str:
    return ctx.scheduled_at.isoformat()
"""
SKEWED_QUEUES = DEFAULT_QUEUES + "\n[queues.skewed]\nconcurrency = 4\nprocesses = 1\n"
CRON = """
[[cron]]
name = "every-minute"
schedule = "* * * * *"
kind = "cron_slot"
catch_up = "latest"
"""
RETENTION = '\n[retention]\nhistory = "1d"\n'


def faketime_env(offset: str) -> dict[str, str]:
    if not LIBFAKETIME.exists() or shutil.which("faketime") is None:
        pytest.skip("libfaketime is not installed (Debian: apt-get install faketime; .ci/run does)")
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": offset}


async def offset_to_another_day(conn: asyncpg.Connection, direction: str) -> str:
    """A whole number of hours that moves the database's UTC time past a midnight."""
    hours_into_day = await conn.fetchval(
        "SELECT extract(epoch FROM now() - date_trunc('day', now() AT TIME ZONE 'UTC') "
        "AT TIME ZONE 'UTC') / 3600"
    )
    if direction == "ahead":
        return f"+{math.ceil(24 - hours_into_day) + 1}h"
    return f"-{math.floor(hours_into_day) + 2}h"


async def partitions(conn: asyncpg.Connection, schema: str) -> set[str]:
    rows = await conn.fetch(
        "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = $1::regclass",
        f"{schema}.job_history",
    )
    return {r["relname"] for r in rows}


@pytest.mark.parametrize("direction", ["ahead", "behind"])
async def test_a_member_hours_off_leases_retries_fires_cron_and_rotates_by_the_databases_clock(
    schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path,
    direction: str,
) -> None:  # fmt: skip
    handlers = tmp_path / "handlers"
    handlers.mkdir()
    (handlers / "skew.py").write_text(HANDLERS)
    offset = await offset_to_another_day(conn, direction)
    today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    # A partition two days old: retention "1d" drops it by the database's date, and
    # keeps yesterday's. A leader on tomorrow's date would drop yesterday's too; one on
    # yesterday's would keep the old one.
    await ensure_past_partitions(conn, schema, today=today - timedelta(days=1))
    old = f"job_history_p{today - timedelta(days=2):%Y%m%d}"
    kept = f"job_history_p{today - timedelta(days=1):%Y%m%d}"
    assert {old, kept} <= await partitions(conn, schema)

    skewed = await start_member(
        SKEWED_QUEUES + CRON + RETENTION, daemon=f'lease = "{LEASE}"\n' + JSON_LOG,
        handlers=handlers, env=faketime_env(offset),
    )  # fmt: skip
    member_id = await conn.fetchval(
        f"SELECT id FROM {schema}.member WHERE pid = $1", skewed.process.pid
    )
    # It leads (it started first): its roles decide the cron slots and the partitions.
    await wait_until(
        lambda: conn.fetchval(
            f"SELECT member = $1 FROM {schema}.leader WHERE resigned_at IS NULL "
            "ORDER BY term DESC LIMIT 1",
            member_id,
        ),
        what="the skewed member leads",
    )
    await start_member(
        DEFAULT_QUEUES + CRON + RETENTION, daemon=f'lease = "{LEASE}"\n', handlers=handlers
    )

    # Partitions: by the database's date.
    dropped = await wait_for_event(skewed, "partitions.dropped", partition=old, timeout_s=30)
    # ... while the member's own clock (its log's time stamps) is off by the offset.
    skew = datetime.fromisoformat(dropped["ts"]) - await conn.fetchval("SELECT now()")
    assert abs(skew - timedelta(hours=int(offset[:-1]))) < timedelta(minutes=5), skew
    assert kept in await partitions(conn, schema)
    assert old not in await partitions(conn, schema)

    # Leases: stamped and renewed on the database's clock; a job held for more than
    # twice its lease completes on its first attempt, never reaped.
    held = [
        await conn.fetchval(
            f"SELECT {schema}.enqueue('holds_past_its_lease', $1::jsonb)", json.dumps({"hold_s": 5})
        )
        for _ in range(2)
    ]
    running = await wait_until(
        lambda: conn.fetch(
            f"SELECT owner, lease_expires_at - now() AS left FROM {schema}.job "
            "WHERE state = 'running'"
        ),
        what="the held jobs running",
    )
    # (A renewal whose transaction began just after this statement's now() and committed
    # before its snapshot leaves a little more than the lease: half a second of slack,
    # against hours of skew.)
    for row in running:
        assert row["owner"] == member_id
        assert timedelta(0) < row["left"] <= timedelta(seconds=2.5), row["left"]

    # Backoff: Retry(after="2s") is two seconds of the database's clock.
    retried = await conn.fetchval(f"SELECT {schema}.enqueue('retries_after_2s')")

    records = await wait_all_final(conn, schema, 3, timeout_s=60)
    for job_id in held:
        assert (records[job_id]["state"], records[job_id]["attempt"]) == ("completed", 1)
        assert records[job_id]["owner"] == member_id
    assert not await conn.fetchval(
        f"SELECT count(*) FROM {schema}.job_attempt WHERE outcome = 'lease_expired'"
    )
    first_failed = await conn.fetchval(
        f"SELECT failed_at FROM {schema}.job_attempt WHERE job_id = $1 AND attempt = 1", retried
    )
    assert records[retried]["attempt"] == 2
    assert records[retried]["finished_at"] - first_failed >= timedelta(seconds=2)

    # Cron: the next minute's slot, fired once, as the database tells the minute.
    async def fired() -> asyncpg.Record | None:
        row: asyncpg.Record | None = await conn.fetchrow(
            f"SELECT result, finished_at, now() AS now FROM {schema}.job_history "
            "WHERE kind = 'cron_slot'"
        )
        return row

    slot_row = await wait_until(fired, timeout_s=90, what="a cron slot fired")
    slot = await conn.fetchval("SELECT ($1::jsonb #>> '{}')::timestamptz", slot_row["result"])
    assert slot == slot.replace(second=0, microsecond=0)
    assert timedelta(0) <= slot_row["finished_at"] - slot < timedelta(minutes=1)

    # Presence: its heartbeats keep coming at their pace.
    heartbeat_age = await conn.fetchval(
        f"SELECT now() - heartbeat_at FROM {schema}.member WHERE id = $1", member_id
    )
    assert heartbeat_age < timedelta(seconds=10)
    assert await skewed.stop() == 0
