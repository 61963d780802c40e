"""The statements of sql/cron.sql: the cron role's sync, reads and compare-and-set."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple

from pgjobd.statements import Conn, Rendered, columns, one_row, rows_of, statement


class CronEntryRow(NamedTuple):
    """A config file's [[cron]] entry, as cron_sync writes it."""

    name: str
    schedule: str
    timezone: str
    kind: str
    args: str  # JSON text
    queue: str | None  # None: the kind's
    catch_up: str


class CronSynced(NamedTuple):
    fence_holds: bool
    added: list[str]
    changed: list[str]
    removed: list[str]
    taken_over: list[str]


class CronDue(NamedTuple):
    """One schedule and what its next firing is measured from; the first row carries
    the database's now, and has no schedule when there is none (name None)."""

    now: datetime
    name: str | None
    schedule: str
    timezone: str
    catch_up: str
    source: str
    last_slot: datetime | None
    updated_at: datetime
    anchor: datetime


class CronFired(NamedTuple):
    advanced: bool
    job_ids: list[int]


class CronStatements(Rendered):
    @statement("cron_sync")
    async def cron_sync(
        self, conn: Conn, term: int, entries: Sequence[CronEntryRow], now: datetime | None
    ) -> CronSynced:
        record = await conn.fetchrow(
            self.sql("cron_sync"), term, *columns(entries, len(CronEntryRow._fields)), now
        )
        return one_row("cron_sync", CronSynced, record)

    @statement("cron_due")
    async def cron_due(self, conn: Conn, now: datetime | None) -> list[CronDue]:
        return rows_of(CronDue, await conn.fetch(self.sql("cron_due"), now))

    @statement("cron_fire")
    async def cron_fire(
        self, conn: Conn, term: int, name: str, last_slot_read: datetime | None,
        updated_at_read: datetime, schedule_read: str, timezone_read: str,
        new_last_slot: datetime, slots: Sequence[datetime], unique_keys: Sequence[str],
    ) -> CronFired:  # fmt: skip
        record = await conn.fetchrow(
            self.sql("cron_fire"), term, name, last_slot_read, updated_at_read, schedule_read,
            timezone_read, new_last_slot, slots, unique_keys,
        )  # fmt: skip
        return one_row("cron_fire", CronFired, record)

    @statement("cron_trigger")
    async def cron_trigger(self, conn: Conn, name: str, now: datetime | None) -> int | None:
        """The id of the job enqueued, or None when there is no such schedule."""
        job_id: int | None = await conn.fetchval(self.sql("cron_trigger"), name, now)
        return job_id
