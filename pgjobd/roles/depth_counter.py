"""Depth recount: every INTERVAL_S, the depth estimate of each queue with a max_depth is
counted afresh (queue_depth_recount, migration 0007). Between recounts an enqueue adds
to it and nothing takes away, so the estimate errs high by at most the jobs finished
since the last recount."""

from __future__ import annotations

from typing import ClassVar

from pgjobd import db
from pgjobd.config import Config
from pgjobd.roles import RoleContext, fenced

INTERVAL_S = 5.0


class DepthCounter:
    name: ClassVar[str] = "depth_counter"

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        async with db.acquire(ctx.pool) as conn, fenced(conn, ctx):
            await ctx.queries.queue_depth_recount(conn, None)
