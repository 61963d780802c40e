"""The partition rotator: keeps days of job_history / job_attempt partitions ahead, and
drops whole partitions past retention (never DELETE). Detaches CONCURRENTLY, so the
statements that finish jobs are never locked out, and finishes a detach that an earlier
run left half done (DETACH ... FINALIZE)."""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, timedelta
from typing import ClassVar

import asyncpg

from pgjobd.config import Config
from pgjobd.migrate import PARTITION_DAYS_AHEAD
from pgjobd.roles import (
    RoleContext,
    as_table_owner,
    fenced,
    owner_ddl_session,
    owner_ddl_timeout_s,
    term_open,
)

log = logging.getLogger(__name__)

INTERVAL_S = 3600.0
PARENTS = ("job_history", "job_attempt")
# A concurrent detach waits for every transaction that might still see the partition
# attached: longer than any statement's default limit, but not for ever. One that
# times out is left pending and finished (FINALIZE) by the next tick.
DETACH_TIMEOUT_MS = 10 * 60 * 1000


def partition_day(name: str, parent: str) -> date | None:
    """The day a partition named <parent>_pYYYYMMDD holds, or None for other names."""
    prefix = f"{parent}_p"
    if not name.startswith(prefix):
        return None
    try:
        return datetime.strptime(name.removeprefix(prefix), "%Y%m%d").replace(tzinfo=UTC).date()
    except ValueError:
        return None


def expired_days(days: list[date], today: date, keep: timedelta) -> list[date]:
    """Partitions whose whole day ended more than `keep` ago."""
    return [day for day in days if day + timedelta(days=1) <= today - keep]


class PartitionRotator:
    name: ClassVar[str] = "partitions"

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        schema = ctx.config.database.schema
        keep = ctx.config.retention.history
        async with owner_ddl_session(ctx, "pgjobd partitions") as conn:
            await ctx.queries.partitions_ensure(conn, PARTITION_DAYS_AHEAD)
            today: date = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
            for parent in PARENTS:
                rows = await ctx.queries.partition_list(conn, f"{schema}.{parent}")
                for row in rows:
                    if row.detach_pending:  # an earlier detach was interrupted
                        await self._detach(conn, ctx, parent, row.name, "FINALIZE")
                days = {
                    day: row.name
                    for row in rows
                    if (day := partition_day(row.name, parent)) is not None
                }
                for day in expired_days(sorted(days), today, keep):
                    await self._detach(conn, ctx, parent, days[day], "CONCURRENTLY")
                    async with fenced(conn, ctx):
                        await ctx.queries.partition_drop(conn, parent, days[day])
                    log.info(
                        "dropped partition %s.%s (older than %s)", schema, days[day], keep,
                        extra={"event": "partitions.dropped", "partition": days[day]},
                    )  # fmt: skip

    async def _detach(
        self, conn: asyncpg.Connection, ctx: RoleContext, parent: str, partition: str, how: str
    ) -> None:
        schema = ctx.config.database.schema
        # DETACH ... CONCURRENTLY cannot run in a transaction: the term is checked just
        # before. A deposed leader's detach that overlaps the next leader's is harmless:
        # both detach the same expired partition, and one of them finds it gone.
        await term_open(conn, ctx)
        try:
            async with as_table_owner(conn, ctx, timeout_ms=DETACH_TIMEOUT_MS):
                await conn.execute(
                    f"ALTER TABLE {schema}.{parent} DETACH PARTITION {schema}.{partition} {how}",
                    timeout=owner_ddl_timeout_s(DETACH_TIMEOUT_MS),
                )
        except (asyncpg.UndefinedTableError, asyncpg.InvalidObjectDefinitionError) as e:
            log.info("partition %s already detached: %s", partition, e)
