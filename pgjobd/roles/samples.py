"""Queue samples: the history the web console's charts draw.

Every INTERVAL_S the leader records, per queue, the live depth by state and the jobs
finished completed, dead and cancelled since the previous sample (sql/leader.sql
`queue_sample_record`), and deletes samples older than RETENTION (`queue_sample_trim`),
in one fenced transaction. The table thus holds at most queues x RETENTION / INTERVAL_S
rows (1,440 per queue). A deposed leader's write is rolled back by the fence, and the
window starts at the newest sample, so a repeated tick counts nothing twice.
"""

from __future__ import annotations

from datetime import timedelta
from typing import ClassVar

from pgjobd import db
from pgjobd.config import Config
from pgjobd.roles import RoleContext, fenced

INTERVAL_S = 60.0
RETENTION = timedelta(hours=24)
# A sample counts at most this far back: after a leader change the first sample does
# not pile the whole gap into one minute.
LONGEST_WINDOW = timedelta(seconds=2 * INTERVAL_S)


class QueueSampler:
    name: ClassVar[str] = "samples"

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        async with db.acquire(ctx.pool) as conn, fenced(conn, ctx):
            await ctx.queries.queue_sample_record(conn, list(ctx.config.queues), LONGEST_WINDOW)
            await ctx.queries.queue_sample_trim(conn, RETENTION)
