"""The console's reads beyond admin.py's (sql/web.sql, pgjobd/statements/web.py): a
job's attempts in full, dead jobs grouped by error, the queue samples behind the
charts."""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg

from pgjobd import db
from pgjobd.queries import for_schema
from pgjobd.statements.web import AttemptRow, DeadGroupRow, SampleRow

# Dead jobs are grouped over the last DEAD_HOURS (default: the first); a longer window
# reads every final record of it (dead ones lie among the others), so it costs more.
DEAD_HOURS = (1, 6, 24)
DEAD_WINDOW = timedelta(hours=DEAD_HOURS[0])
DEAD_GROUPS = 50


async def job_attempts(pool: asyncpg.Pool, schema: str, job_id: int) -> list[AttemptRow]:
    async with db.acquire(pool) as conn:
        return await for_schema(schema).web_job_attempts(conn, job_id)


async def dead_groups(
    pool: asyncpg.Pool, schema: str, *, within: timedelta = DEAD_WINDOW, limit: int = DEAD_GROUPS
) -> list[DeadGroupRow]:
    async with db.acquire(pool) as conn:
        return await for_schema(schema).web_dead_groups(conn, within, limit)


async def samples(
    pool: asyncpg.Pool, schema: str, *, within: timedelta, queues: list[str] | None = None
) -> list[SampleRow]:
    async with db.acquire(pool) as conn:
        return await for_schema(schema).web_samples(conn, within, queues)


async def now(pool: asyncpg.Pool, schema: str) -> datetime:
    async with db.acquire(pool) as conn:
        return await for_schema(schema).web_now(conn)
