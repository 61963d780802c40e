"""Queue statistics: the fleet-wide gauges (pgjobd_queue_jobs, ..._oldest_available_age)
that only the leader exports, counted every INTERVAL_S. The same count is published in
<schema>.queue_count (fenced: a deposed leader's count is rolled back), which the web
console's overview reads instead of counting the live jobs itself."""

from __future__ import annotations

from typing import ClassVar

from pgjobd import db, metrics
from pgjobd.config import Config
from pgjobd.roles import RoleContext, fenced

INTERVAL_S = 5.0


class QueueStats:
    name: ClassVar[str] = "queue_stats"

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        async with db.acquire(ctx.pool) as conn, fenced(conn, ctx):
            rows = await ctx.queries.queue_stats_publish(conn, list(ctx.config.queues))
        metrics.set_queue_stats(
            metrics.QueueStat(
                queue=row.queue,
                counts={state: getattr(row, state) for state in metrics.QUEUE_STATES},
                oldest_available_age_s=row.oldest_available_age_s,
                paused=row.paused,
            )
            for row in rows
        )
