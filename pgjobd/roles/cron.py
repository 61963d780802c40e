"""The cron ticker: enqueues one job per (schedule, slot), for the config file's
[[cron]] entries and the `cron` table's other rows, with all state in the database.

Each tick: sync the config entries into the table (when the config or the term
changed), read the enabled schedules with the database's now, work out each one's due
slots (pgjobd.cron_schedule) and, per schedule, enqueue them and advance last_slot in one
fenced compare-and-set statement (cron_fire), so two overlapping leaders, or a slot whose
job already completed, never enqueue a slot twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar, cast

import asyncpg
import msgspec

from pgjobd import cron_schedule, db
from pgjobd.clock import SYSTEM, Clock
from pgjobd.config import Config
from pgjobd.cron_schedule import CatchUp, Due, ScheduleError
from pgjobd.queries import Queries
from pgjobd.roles import RoleContext, fenced
from pgjobd.statements.cron import CronDue, CronEntryRow

log = logging.getLogger(__name__)

INTERVAL_S = 1.0  # the longest sleep between ticks
MIN_INTERVAL_S = 0.05


@dataclass(frozen=True)
class Firing:
    """One schedule's due slots, and its row as read (the compare-and-set's old value)."""

    row: CronDue
    due: Due


class CronTicker:
    name: ClassVar[str] = "cron"

    def __init__(self, *, clock: Clock = SYSTEM) -> None:
        """`clock`: whose "now" the ticks use (the database's, unless a test's)."""
        self.clock = clock
        self._synced: tuple[object, ...] | None = None
        self._next_in_s = INTERVAL_S
        self._reported: set[tuple[str, datetime, str]] = set()

    def interval_s(self, config: Config) -> float:
        """Until the next due slot, at most a second."""
        return min(INTERVAL_S, max(MIN_INTERVAL_S, self._next_in_s))

    async def tick(self, ctx: RoleContext) -> None:
        async with db.acquire(ctx.pool) as conn:
            firings = await self.plan(conn, ctx)
            for firing in firings:
                await self.fire(conn, ctx, firing)

    async def plan(self, conn: asyncpg.Connection, ctx: RoleContext) -> list[Firing]:
        """The first half of a tick: sync the config entries (when the config or the
        term changed), read the schedules with the database's now, and work out what
        each one owes. Tests call it and `fire` apart to interleave two leaders."""
        now_param = self.clock.now()
        synced = (ctx.term, ctx.config.cron)
        if synced != self._synced and await self._sync(conn, ctx, now_param):
            self._synced = synced
        rows = await ctx.queries.cron_due(conn, now_param)
        now = rows[0].now
        limits = {entry.name: entry.catch_up_limit for entry in ctx.config.cron}
        firings: list[Firing] = []
        next_due: datetime | None = None
        for row in rows:
            if row.name is None:
                continue
            limit = cron_schedule.DEFAULT_CATCH_UP_LIMIT
            if row.source == "config":
                limit = limits.get(row.name, limit)
            try:
                zone = cron_schedule.check(row.schedule, row.timezone)
                catch_up = cast(CatchUp, row.catch_up)
                due = cron_schedule.plan(row.schedule, zone, row.anchor, now, catch_up, limit=limit)
                upcoming = cron_schedule.next_slot(row.schedule, zone, now)
            except ScheduleError as error:
                self._report_once(row, "schedule", f"cron schedule {row.name} skipped: {error}")
                continue
            if upcoming is not None and (next_due is None or upcoming < next_due):
                next_due = upcoming
            if due.last_slot is not None:
                firings.append(Firing(row, due))
        self._next_in_s = (next_due - now).total_seconds() if next_due else INTERVAL_S
        return firings

    async def fire(self, conn: asyncpg.Connection, ctx: RoleContext, firing: Firing) -> bool:
        """The second half: enqueue one schedule's due slots and advance its last_slot,
        if nobody did since it was read (compare-and-set). Whether it did."""
        row, due = firing.row, firing.due
        name = row.name
        assert name is not None and due.last_slot is not None
        try:
            async with fenced(conn, ctx):
                fired = await ctx.queries.cron_fire(
                    conn, ctx.term, name, row.last_slot, row.updated_at, row.schedule,
                    row.timezone, due.last_slot, due.slots,
                    [cron_schedule.slot_key(name, slot) for slot in due.slots],
                )  # fmt: skip
        except asyncpg.PostgresError as error:
            if not _is_rejected_job(error):
                raise
            self._report_once(row, "enqueue", f"cron schedule {name} skipped: {error}")
            return False
        if not fired.advanced:
            log.info(
                "cron schedule %s: another tick or leader got there first, or not leader",
                name, extra={"event": "cron.fire_skipped", "cron": name},
            )  # fmt: skip
            return False
        skipped = "" if due.slots else f" (slot {due.last_slot.isoformat()} missed: skipped)"
        log.info(
            "cron schedule %s: enqueued %d job(s)%s", name, len(due.slots), skipped,
            extra={"event": "cron.fired", "cron": name, "slots": len(due.slots),
                   "job_ids": fired.job_ids, "last_slot": due.last_slot.isoformat(),
                   "term": ctx.term},
        )  # fmt: skip
        return True

    async def _sync(self, conn: asyncpg.Connection, ctx: RoleContext, now: datetime | None) -> bool:
        entries = ctx.config.cron
        async with fenced(conn, ctx):
            synced = await ctx.queries.cron_sync(
                conn, ctx.term,
                [
                    CronEntryRow(e.name, e.schedule, e.timezone, e.kind,
                                 msgspec.json.encode(e.args).decode(), e.queue, e.catch_up)
                    for e in entries
                ],
                now,
            )  # fmt: skip
        if not synced.fence_holds:
            log.warning(
                "not leader: cron schedules not synced", extra={"event": "cron.sync_fenced"}
            )
            return False
        for change, names in (
            ("added", synced.added), ("changed", synced.changed), ("removed", synced.removed)
        ):  # fmt: skip
            for name in names:
                log.info(
                    "cron schedule %s %s from the config file", name, change,
                    extra={"event": f"cron.{change}", "cron": name},
                )  # fmt: skip
        for name in synced.taken_over:
            log.warning(
                "cron schedule %s was created through the API; the config file's entry of "
                "that name replaces it", name,
                extra={"event": "cron.taken_over", "cron": name},
            )  # fmt: skip
        return True

    def _report_once(self, row: CronDue, what: str, message: str) -> None:
        """Log a bad row once per version of it (not every second)."""
        key = (row.name or "", row.updated_at, what)
        if key in self._reported:
            return
        self._reported.add(key)
        log.error(message, extra={"event": "cron.bad_schedule", "cron": row.name})


def _is_rejected_job(error: asyncpg.PostgresError) -> bool:
    """enqueue() refused the row's job (bad kind, queue, args): a data problem of this
    schedule, not of the database."""
    state: str = getattr(error, "sqlstate", "") or ""
    return state.startswith(("PJ", "22", "23"))


async def trigger(
    conn: asyncpg.Connection | asyncpg.Pool,
    queries: Queries,
    name: str,
    *,
    now: datetime | None = None,
) -> int | None:
    """Enqueue one job of schedule `name` now, outside its slots (`pgjobd cron trigger`);
    its id, or None when there is no such schedule. Works whether or not the schedule
    is enabled, and does not change when its slots fire."""
    return await queries.cron_trigger(conn, name, now)
