"""Queue statistics: the fleet-wide gauges (pgjobd_queue_jobs, per tenant too in queues
with fair or tenant_concurrency; ..._oldest_available_age) that only the leader exports,
counted every INTERVAL_S. The same count is published in <schema>.queue_count (fenced: a
deposed leader's count is rolled back), which the web console's overview reads instead
of counting the live jobs itself.

The count reads the whole hot table (queue_depth): ~0.5 s with a million scheduled jobs
on the 2-core test machine (issue 17), a tenth of a core every 5 s, taken from the
queue's own throughput. So the next count waits at least COST_FACTOR times as long as
the last one took, up to MAX_INTERVAL_S: up to a count of 0.6 s it costs at most
1/COST_FACTOR of a core, and its figures are as fresh as that allows."""

from __future__ import annotations

import time
from typing import ClassVar

from pgjobd import db, metrics
from pgjobd.config import Config
from pgjobd.roles import RoleContext, fenced
from pgjobd.statements.leader import QueueStatRow, QueueTenantStatRow

INTERVAL_S = 5.0
COST_FACTOR = 20.0
# The web console shows the published counts while they are at most 3 * INTERVAL_S old
# (web/app.py, PUBLISHED_COUNTS), and counts every live job itself on each refresh when
# they are older: the counts must come sooner than that, jitter (10 %) included.
MAX_INTERVAL_S = 12.0


def next_interval_s(last_count_s: float) -> float:
    """Seconds until the next count, after one that took last_count_s."""
    return min(MAX_INTERVAL_S, max(INTERVAL_S, COST_FACTOR * last_count_s))


class QueueStats:
    name: ClassVar[str] = "queue_stats"

    def __init__(self) -> None:
        self.last_count_s = 0.0

    def interval_s(self, config: Config) -> float:
        return next_interval_s(self.last_count_s)

    async def tick(self, ctx: RoleContext) -> None:
        started = time.monotonic()
        try:
            await self._count(ctx)
        finally:
            self.last_count_s = time.monotonic() - started

    async def _count(self, ctx: RoleContext) -> None:
        async with db.acquire(ctx.pool) as conn, fenced(conn, ctx):
            rows = await ctx.queries.queue_stats_publish(conn, list(ctx.config.queues))
            tenant_rows = (
                await ctx.queries.queue_tenant_stats(conn, metrics.TENANTS_SHOWN)
                if any(row.by_tenant for row in rows)
                else []
            )
        # Queues with fair or tenant_concurrency, broken down by tenant (docs/metrics.md).
        by_tenant: dict[str, dict[str | None, dict[str, int]]] = {}
        for t in tenant_rows:
            by_tenant.setdefault(t.queue, {})[t.tenant] = _counts(t)
        metrics.set_queue_stats(
            metrics.QueueStat(
                queue=row.queue,
                counts=_counts(row),
                oldest_available_age_s=row.oldest_available_age_s,
                paused=row.paused,
                by_tenant=by_tenant.get(row.queue),
            )
            for row in rows
        )


def _counts(row: QueueStatRow | QueueTenantStatRow) -> dict[str, int]:
    return {state: getattr(row, state) for state in metrics.QUEUE_STATES}
