"""Priority aging: in each queue with a `priority_aging` (in the leader's config), every
that long the PER_PRIORITY oldest jobs of each priority below the queue's top one that
have waited that long move up one step (job_priorities_age in sql/leader.sql). A job
p steps below the top reaches it within p steps' time once it is among the oldest of
each priority it passes through, and then runs before the newer top-priority jobs
(claims order by priority, then run_at): a steady stream of urgent jobs delays the rest,
never starves them. A tick writes at most PER_PRIORITY rows per priority in use."""

from __future__ import annotations

import math
import time
from typing import ClassVar

from pgjobd import db, metrics
from pgjobd.config import Config
from pgjobd.roles import RoleContext, fenced

PER_PRIORITY = 100
SHORTEST_INTERVAL_S = 1.0


class PriorityAger:
    name: ClassVar[str] = "priority_ager"

    def __init__(self) -> None:
        self._aged_at: dict[str, float] = {}  # queue -> monotonic time of its last step

    def interval_s(self, config: Config) -> float:
        agings = [q.priority_aging.total_seconds() for q in config.queues.values()
                  if q.priority_aging is not None]  # fmt: skip
        return max(SHORTEST_INTERVAL_S, min(agings, default=60.0))

    async def tick(self, ctx: RoleContext) -> None:
        now = time.monotonic()
        for name, queue in sorted(ctx.config.queues.items()):
            aging = queue.priority_aging
            last = self._aged_at.get(name, -math.inf)
            if aging is None or now - last < aging.total_seconds():
                continue
            async with db.acquire(ctx.pool) as conn, fenced(conn, ctx):
                moved = await ctx.queries.job_priorities_age(conn, name, aging, PER_PRIORITY)
            self._aged_at[name] = now
            metrics.JOBS_AGED.labels(name).inc(moved)
