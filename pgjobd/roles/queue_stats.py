"""Queue statistics: the fleet-wide gauges (pgjobd_queue_jobs, ..._oldest_available_age)
that only the leader exports, read every INTERVAL_S. Writes nothing."""

from __future__ import annotations

from typing import ClassVar

from pgjobd import db, metrics
from pgjobd.config import Config
from pgjobd.roles import RoleContext

INTERVAL_S = 5.0


class QueueStats:
    name: ClassVar[str] = "queue_stats"

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        async with db.acquire(ctx.pool) as conn:
            rows = await ctx.queries.queue_stats(conn, list(ctx.config.queues))
        metrics.set_queue_stats(
            metrics.QueueStat(
                queue=row.queue,
                counts={state: getattr(row, state) for state in metrics.QUEUE_STATES},
                oldest_available_age_s=row.oldest_available_age_s,
                paused=row.paused,
            )
            for row in rows
        )
