"""The per-kind circuit breakers (@job(circuit_breaker="N/DURATION", breaker_cooldown=)):
each tick, in one fenced statement (kind_breakers_step in sql/leader.sql), a closed
breaker whose kind failed N attempts within DURATION opens (the kind is not claimed, so
its jobs are not charged attempts); an open one half-opens after its cool-down (one
job may start: the claim that takes it marks it as the probe); the probe's success
closes it, its failure opens it again. The role only observes outcomes: the statements
that finish jobs do nothing more. Logs breaker.opened, breaker.half_open and
breaker.closed, and keeps the pgjobd_kind_breaker_state gauge."""

from __future__ import annotations

import logging
from typing import ClassVar

from pgjobd import db, metrics
from pgjobd.clock import SYSTEM, Clock
from pgjobd.config import Config
from pgjobd.roles import RoleContext, fenced
from pgjobd.statements.leader import BreakerRow

log = logging.getLogger(__name__)

INTERVAL_S = 1.0


class BreakerKeeper:
    name: ClassVar[str] = "breaker"

    def __init__(self, *, clock: Clock = SYSTEM) -> None:
        """`clock`: whose "now" the cool-downs and windows use (the database's, unless
        a test's)."""
        self.clock = clock

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        await self.step(ctx)

    async def step(self, ctx: RoleContext) -> list[BreakerRow]:
        """One tick; every declared breaker's state after it."""
        async with db.acquire(ctx.pool) as conn, fenced(conn, ctx):
            rows = await ctx.queries.kind_breakers_step(conn, self.clock.now())
        # Only once the step has committed: a deposed leader's changes were rolled back.
        for row in rows:
            if row.change is not None:
                _log_change(row)
        metrics.set_breakers((row.kind, row.state) for row in rows)
        return rows


def _log_change(row: BreakerRow) -> None:
    fields = {"event": f"breaker.{row.change}", "kind": row.kind}
    if row.change == "opened":
        metrics.KIND_BREAKER_OPENED.labels(row.kind).inc()
        if row.probe is not None:
            log.warning("circuit breaker of kind %s opened again: its probe (job %d) failed",
                        row.kind, row.probe, extra={**fields, "probe": row.probe})  # fmt: skip
        else:
            log.warning(
                "circuit breaker of kind %s opened: %d failed attempts in its window",
                row.kind, row.failures, extra={**fields, "failures": row.failures},
            )  # fmt: skip
    elif row.change == "half_open":
        log.info("circuit breaker of kind %s half-open: the next job of the kind is its probe",
                 row.kind, extra={**fields, "probe": row.probe})  # fmt: skip
    else:
        log.info("circuit breaker of kind %s closed: its probe (job %d) completed",
                 row.kind, row.probe, extra={**fields, "probe": row.probe})  # fmt: skip
