"""The reaper: takes back jobs whose lease expired, ends jobs not started by their
expires_at (ttl), and forgets long-gone members.

It reaps nothing until its term has lasted one lease (see job_reap_expired): after an
outage, every member first gets a lease's worth of database time to record what it
finished meanwhile and to renew its leases. The same after an outage its own session
lived through (the database refused writes: its disk full, read-only): after a tick
that failed, it reaps nothing for one lease."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import ClassVar

import anyio
import asyncpg

from pgjobd import db, metrics
from pgjobd.config import DEFAULT_QUEUE, Config
from pgjobd.roles import RoleContext, fenced
from pgjobd.statements.leader import QueueCrashes

log = logging.getLogger(__name__)

BATCH = 1000
INTERVAL_S = 5.0
# How soon a tick that failed is tried again: the grace after a refusal is counted from
# the last one, so it must not start long before the database takes writes again.
RETRY_S = 1.0
MEMBER_SILENCE = timedelta(minutes=10)


class Reaper:
    name: ClassVar[str] = "reaper"

    def __init__(self) -> None:
        self._next_expiry_s: float | None = None
        self._failing = False
        self._hold_until: float | None = None  # anyio time: reap nothing before

    def interval_s(self, config: Config) -> float:
        """Until the earliest lease runs out, but at least every INTERVAL_S: a dead
        member's jobs come back just after their lease, not up to a tick later."""
        if self._failing:
            return RETRY_S
        wait_s = INTERVAL_S
        if self._next_expiry_s is not None:
            wait_s = min(wait_s, max(0.05, self._next_expiry_s + 0.05))
        if self._hold_until is not None:
            wait_s = min(wait_s, max(0.05, self._hold_until - anyio.current_time() + 0.05))
        return wait_s

    async def tick(self, ctx: RoleContext) -> None:
        try:
            await self._tick(ctx)
        except Exception:
            # The members' writes were likely refused too: the outcomes they hold must
            # be recorded before their leases are judged lost.
            self._failing = True
            self._hold_until = anyio.current_time() + ctx.config.daemon.lease.total_seconds()
            raise
        self._failing = False

    async def _tick(self, ctx: RoleContext) -> None:
        queues = ctx.config.queues
        lease = ctx.config.daemon.lease
        async with db.acquire(ctx.pool) as conn:
            if self._hold_until is not None and anyio.current_time() >= self._hold_until:
                self._hold_until = None
            while self._hold_until is None:
                async with fenced(conn, ctx):
                    reaped = await ctx.queries.job_reap_expired(
                        conn, ctx.term, lease, BATCH,
                        [QueueCrashes(name, q.max_crashes) for name, q in queues.items()],
                        queues[DEFAULT_QUEUE].max_crashes,
                    )  # fmt: skip
                metrics.LEASES_EXPIRED.labels("rescued").inc(reaped.rescued)
                metrics.LEASES_EXPIRED.labels("dead").inc(reaped.died)
                if reaped.rescued or reaped.died:
                    log.warning(
                        "took back %d jobs whose lease expired (%d dead)",
                        reaped.rescued + reaped.died, reaped.died,
                        extra={"event": "reaper.rescued", "rescued": reaped.rescued,
                               "died": reaped.died, "term": ctx.term},
                    )  # fmt: skip
                if reaped.rescued + reaped.died < BATCH:
                    break
            await _expire(conn, ctx)
            async with fenced(conn, ctx):
                gone = await ctx.queries.member_forget_gone(conn, ctx.term, MEMBER_SILENCE)
            self._next_expiry_s = await ctx.queries.job_next_lease_expiry(conn, ctx.term, lease)
        if gone:
            log.info(
                "forgot %d members silent for %s", len(gone), MEMBER_SILENCE,
                extra={"event": "reaper.members_forgotten"},
            )  # fmt: skip


async def _expire(conn: asyncpg.Connection, ctx: RoleContext) -> None:
    """End the jobs not started by their expires_at, in batches (the claim already
    refuses them; this takes them out of the hot table and records them dead)."""
    while True:
        async with fenced(conn, ctx):
            rows = await ctx.queries.job_expire(conn, ctx.term, BATCH)
        ended = 0
        for row in rows:
            metrics.JOBS_EXPIRED.labels(row.queue, row.kind).inc(row.expired)
            ended += row.expired
        if ended:
            log.warning(
                "%d jobs expired before they started", ended,
                extra={"event": "reaper.expired", "expired": ended, "term": ctx.term},
            )  # fmt: skip
        if ended < BATCH:
            return
