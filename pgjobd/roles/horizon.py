"""The horizon watchdog: names what holds back vacuum on the hot table.

A queue slows down because of something that is not the queue: any transaction that
keeps an old snapshot (a report, an export, a session idle in a transaction) stops
vacuum from removing the hot table's dead rows, and the claim scan wades through them.
Each tick reads, without writing anything:

- the oldest holder of the database's xmin horizon: a backend (pid, application,
  state, how long its transaction has been open, how many transactions old its xmin
  is), a prepared transaction, or a replication slot;
- how long the horizon has been held, from an xid clock kept across ticks (each tick
  samples the next xid): overlapping transactions, none of them long, can pin the
  horizon for far longer than any one of them has been open, and this sees that;
- the hot table's live and dead rows and its last (auto)vacuum;
- the database's wraparound age (age(datfrozenxid)) and multixact age.

The latest reading is kept in `last` (for metrics). It warns only on what an operator
must act on, naming the culprit; a warning repeats every REPEAT_S while the condition
lasts, at once when the culprit changes, and an info line says when it cleared:

- the horizon held back longer than HELD_WARN_S: the oldest holder, and the hot table's
  dead rows that vacuum cannot remove meanwhile;
- dead rows piling up with no vacuum of the table for DEAD_ROWS_FOR_S (autovacuum off
  for it, or its workers busy elsewhere);
- wraparound age.

A hot table that is mostly dead rows is not in itself a problem: under load a small
table that churns is 90+ % dead rows between two autovacuums, and vacuum clears them.

The database role needs pg_read_all_stats (or pg_monitor) to see other roles' sessions:
without it their xmin is hidden and they cannot be named. The watchdog terminates
nothing: for that, set idle_in_transaction_session_timeout (and statement_timeout) on
the roles that run reports (ALTER ROLE ... SET), which PostgreSQL enforces itself.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import asyncpg

from pgjobd import db, metrics
from pgjobd.clock import SYSTEM, Clock
from pgjobd.config import Config
from pgjobd.queries import Queries
from pgjobd.roles import RoleContext

log = logging.getLogger(__name__)

INTERVAL_S = 30.0
HELD_WARN_S = 300.0
DEAD_RATIO_WARN = 0.5
DEAD_ROWS_WARN = 10_000
WRAPAROUND_WARN = 1_500_000_000  # of 2^31; autovacuum_freeze_max_age is 200 million
DEAD_ROWS_FOR_S = 600.0
REPEAT_S = 300.0
XID_CLOCK_SAMPLES = 480  # 4 h of ticks: longer holds are reported as at least that


@dataclass(frozen=True)
class HorizonHolder:
    source: str  # backend | prepared_xact | replication_slot
    pid: int | None
    name: str | None  # application_name, prepared gid or slot name
    owner: str | None
    state: str | None
    backend_type: str | None
    xmin_age: int  # transactions since the xid it pins
    xact_age_s: float | None  # how long its transaction has been open
    xact_start: datetime | None
    query_start: datetime | None
    state_change: datetime | None
    query: str | None

    def describe(self) -> str:
        if self.source == "backend":
            return (
                f"pid {self.pid} ({self.name or 'no application_name'}, user {self.owner}, "
                f"{self.state}), transaction open {_age(self.xact_age_s)}, xmin "
                f"{self.xmin_age} transactions old, query started {self.query_start}: "
                f"{self.query!r}"
            )
        if self.source == "prepared_xact":
            return (
                f"prepared transaction {self.name!r} (owner {self.owner}), prepared "
                f"{_age(self.xact_age_s)} ago, {self.xmin_age} transactions old"
            )
        return (
            f"replication slot {self.name!r} ({self.state}, pid {self.pid}), xmin "
            f"{self.xmin_age} transactions old"
        )


@dataclass(frozen=True)
class HorizonReading:
    at: datetime
    holder: HorizonHolder | None
    held_s: float  # how long the horizon has been held back, as far as can be told
    next_xid: int
    live_rows: int
    dead_rows: int
    dead_ratio: float
    last_vacuum: datetime | None
    last_autovacuum: datetime | None
    autovacuum_count: int
    wraparound_age: int
    multixact_age: int
    vacuum_count: int = 0  # manual and automatic


def held_since_s(samples: deque[tuple[float, int]], horizon_xid: int, now_s: float) -> float:
    """How long ago (at least) `horizon_xid` was the next xid, from (time, next xid)
    samples oldest first: it was issued before the first sample whose next xid is past
    it. Zero when no sample is past it (nothing newer has been issued since)."""
    for at_s, next_xid in samples:
        if next_xid > horizon_xid:
            return max(0.0, now_s - at_s)
    return 0.0


class HorizonWatchdog:
    name: ClassVar[str] = "horizon"

    def __init__(
        self,
        *,
        held_warn_s: float = HELD_WARN_S,
        dead_ratio_warn: float = DEAD_RATIO_WARN,
        dead_rows_warn: int = DEAD_ROWS_WARN,
        dead_rows_for_s: float = DEAD_ROWS_FOR_S,
        wraparound_warn: int = WRAPAROUND_WARN,
        clock: Clock = SYSTEM,
    ) -> None:
        self.clock = clock
        self.held_warn_s = held_warn_s
        self.dead_ratio_warn = dead_ratio_warn
        self.dead_rows_warn = dead_rows_warn
        self.dead_rows_for_s = dead_rows_for_s
        # Since when (monotonic) dead rows have piled up with no vacuum, and the
        # table's vacuum count then.
        self._unvacuumed: tuple[float, int] | None = None
        self.wraparound_warn = wraparound_warn
        self.last: HorizonReading | None = None
        self._xid_clock: deque[tuple[float, int]] = deque(maxlen=XID_CLOCK_SAMPLES)
        self._warned: dict[str, tuple[float, Any]] = {}  # alarm -> (monotonic, culprit)

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        self.last = reading = await self.read(ctx.pool, ctx.queries, ctx.config)
        metrics.set_horizon(reading)
        self._judge(reading, f"{ctx.config.database.schema}.job")

    async def read(self, pool: asyncpg.Pool, queries: Queries, config: Config) -> HorizonReading:
        table = f"{config.database.schema}.job"
        async with db.acquire(pool) as conn:
            stats = await queries.horizon_table_stats(conn, table, self.clock.now())
            rows = await queries.horizon_holders(conn, 1, self.clock.now())
        holder = HorizonHolder(*rows[0]) if rows else None
        at = stats.at
        now_s = at.timestamp()
        self._xid_clock.append((now_s, stats.next_xid))
        held_s = 0.0
        if holder is not None:
            lag_s = held_since_s(self._xid_clock, stats.next_xid - holder.xmin_age, now_s)
            held_s = max(holder.xact_age_s or 0.0, lag_s)
        live, dead = stats.live_rows or 0, stats.dead_rows or 0
        return HorizonReading(
            at=at, holder=holder, held_s=held_s, next_xid=stats.next_xid,
            live_rows=live, dead_rows=dead,
            dead_ratio=dead / (live + dead) if live + dead else 0.0,
            last_vacuum=stats.last_vacuum, last_autovacuum=stats.last_autovacuum,
            autovacuum_count=stats.autovacuum_count or 0,
            vacuum_count=stats.vacuum_count or 0,
            wraparound_age=stats.wraparound_age, multixact_age=stats.multixact_age,
        )  # fmt: skip

    def _judge(self, r: HorizonReading, table: str) -> None:
        culprit = r.holder.describe() if r.holder else "no transaction holds it now"
        culprit_key = (r.holder.source, r.holder.pid, r.holder.name) if r.holder else None
        held = r.holder is not None and r.held_s > self.held_warn_s
        self._alarm(
            "horizon", held, culprit_key,
            "vacuum horizon held back for %s, so vacuum cannot remove %s's %d dead rows "
            "(%.0f %%); oldest holder: %s",
            _age(r.held_s), table, r.dead_rows, r.dead_ratio * 100, culprit,
        )  # fmt: skip
        piling = r.dead_ratio > self.dead_ratio_warn and r.dead_rows > self.dead_rows_warn
        now = self.clock.monotonic()
        if not piling or (self._unvacuumed and self._unvacuumed[1] != r.vacuum_count):
            self._unvacuumed = None  # cleared, or vacuum ran: it is doing its job
        if piling and self._unvacuumed is None:
            self._unvacuumed = (now, r.vacuum_count)
        unvacuumed_s = now - self._unvacuumed[0] if self._unvacuumed else 0.0
        self._alarm(
            "dead_rows", piling and unvacuumed_s >= self.dead_rows_for_s, None,
            "%s is %.0f %% dead rows (%d dead, %d live) and has not been vacuumed for "
            "%s (last autovacuum %s): is autovacuum disabled for it, or are all its "
            "workers busy elsewhere (autovacuum_max_workers)?",
            table, r.dead_ratio * 100, r.dead_rows, r.live_rows, _age(unvacuumed_s),
            r.last_autovacuum or "never",
        )  # fmt: skip
        self._alarm(
            "wraparound", r.wraparound_age > self.wraparound_warn, None,
            "database transaction ID wraparound age is %d (of about 2.1 billion); "
            "oldest horizon holder: %s",
            r.wraparound_age, culprit,
        )  # fmt: skip

    def _alarm(self, alarm: str, on: bool, culprit: Any, message: str, *args: Any) -> None:
        now = self.clock.monotonic()
        previous = self._warned.get(alarm)
        if not on:
            if previous is not None:
                del self._warned[alarm]
                log.info("%s: cleared", alarm, extra={"event": f"horizon.{alarm}_cleared"})
            return
        if previous is None or previous[1] != culprit or now - previous[0] >= REPEAT_S:
            self._warned[alarm] = (now, culprit)
            log.warning(message, *args, extra={"event": f"horizon.{alarm}"})


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "unknown time"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
