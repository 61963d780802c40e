"""The console's reads beyond admin.py's (sql/web.sql, pgjobd/statements/web.py): a
job's attempts in full, dead jobs grouped as `dlq list` groups them (its statement, over
the page's window, with the queues and the newest job), the queue samples behind the
charts."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import NamedTuple

import asyncpg

from pgjobd import db
from pgjobd.queries import for_schema
from pgjobd.statements.web import AttemptRow, SampleRow

# Dead jobs are grouped over the last DEAD_HOURS (default: the first); a longer window
# reads every final record of it (dead ones lie among the others), so it costs more.
DEAD_HOURS = (1, 6, 24)
DEAD_WINDOW = timedelta(hours=DEAD_HOURS[0])
DEAD_GROUPS = 50


async def job_attempts(pool: asyncpg.Pool, schema: str, job_id: int) -> list[AttemptRow]:
    async with db.acquire(pool) as conn:
        return await for_schema(schema).web_job_attempts(conn, job_id)


class DeadGroupRow(NamedTuple):
    """One group of /dead and /api/dead/groups."""

    key: str
    fingerprint: str | None
    reason: str | None
    jobs: int
    kinds: list[str]
    queues: list[str]
    first_at: datetime
    last_at: datetime
    error: str | None  # the newest job's
    newest_id: int


async def dead_groups(
    pool: asyncpg.Pool, schema: str, *, within: timedelta = DEAD_WINDOW, limit: int = DEAD_GROUPS
) -> list[DeadGroupRow]:
    """The dead jobs of the last `within`, grouped by admin_dlq_groups (`dlq list`'s)."""
    async with db.acquire(pool) as conn:
        now: datetime = await for_schema(schema).web_now(conn)
        rows = await for_schema(schema).admin_dlq_groups(conn, None, None, now - within, limit)
    return [
        DeadGroupRow(key=r.key, fingerprint=r.fingerprint, reason=r.reason, jobs=r.jobs,
                     kinds=r.kinds, queues=r.queues, first_at=r.first_at,
                     last_at=r.last_dead_at, error=r.last_error, newest_id=r.newest_id)
        for r in rows
    ]  # fmt: skip


async def samples(
    pool: asyncpg.Pool, schema: str, *, within: timedelta, queues: list[str] | None = None
) -> list[SampleRow]:
    async with db.acquire(pool) as conn:
        return await for_schema(schema).web_samples(conn, within, queues)


async def now(pool: asyncpg.Pool, schema: str) -> datetime:
    async with db.acquire(pool) as conn:
        return await for_schema(schema).web_now(conn)
