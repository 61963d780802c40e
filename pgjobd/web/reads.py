"""The console's reads beyond admin.py's (sql/web.sql): a job's attempts in full, dead
jobs grouped by error, the queue samples behind the charts."""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg
import msgspec

from pgjobd import db
from pgjobd.queries import for_schema

# Dead jobs are grouped over the last DEAD_HOURS (default: the first); a longer window
# reads every final record of it (dead ones lie among the others), so it costs more.
DEAD_HOURS = (1, 6, 24)
DEAD_WINDOW = timedelta(hours=DEAD_HOURS[0])
DEAD_GROUPS = 50


class Attempt(msgspec.Struct, frozen=True):
    attempt: int
    failed_at: datetime
    duration_s: float | None
    member: str | None
    outcome: str
    error_class: str | None
    error_message: str | None
    traceback: str | None
    fingerprint: str | None


class DeadGroup(msgspec.Struct, frozen=True):
    key: str
    jobs: int
    kinds: list[str]
    queues: list[str]
    first_at: datetime
    last_at: datetime
    error: str | None
    newest_id: int


class Sample(msgspec.Struct, frozen=True):
    at: datetime
    available: int
    scheduled: int
    running: int
    retryable: int
    completed: int
    dead: int
    cancelled: int


async def job_attempts(pool: asyncpg.Pool, schema: str, job_id: int) -> list[Attempt]:
    async with db.acquire(pool) as conn:
        rows = await for_schema(schema).web_job_attempts(conn, job_id)
    return [msgspec.convert(r._asdict(), Attempt) for r in rows]


async def dead_groups(
    pool: asyncpg.Pool, schema: str, *, within: timedelta = DEAD_WINDOW, limit: int = DEAD_GROUPS
) -> list[DeadGroup]:
    async with db.acquire(pool) as conn:
        rows = await for_schema(schema).web_dead_groups(conn, within, limit)
    return [msgspec.convert(r._asdict(), DeadGroup) for r in rows]


async def samples(
    pool: asyncpg.Pool, schema: str, *, within: timedelta, queues: list[str] | None = None
) -> list[Sample]:
    async with db.acquire(pool) as conn:
        rows = await for_schema(schema).web_samples(conn, within, queues)
    return [msgspec.convert(r._asdict(), Sample) for r in rows]


async def now(pool: asyncpg.Pool, schema: str) -> datetime:
    async with db.acquire(pool) as conn:
        return await for_schema(schema).web_now(conn)
