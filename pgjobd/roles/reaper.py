"""The reaper: takes back jobs whose lease expired, and forgets long-gone members."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import ClassVar

from pgjobd.config import DEFAULT_QUEUE, Config
from pgjobd.roles import RoleContext

log = logging.getLogger(__name__)

BATCH = 1000
INTERVAL_S = 5.0
MEMBER_SILENCE = timedelta(minutes=10)


class Reaper:
    name: ClassVar[str] = "reaper"

    def interval_s(self, config: Config) -> float:
        return INTERVAL_S

    async def tick(self, ctx: RoleContext) -> None:
        queues = ctx.config.queues
        async with ctx.pool.acquire() as conn:
            while True:
                row = await conn.fetchrow(
                    ctx.queries["job_reap_expired"], *ctx.fence, BATCH, list(queues),
                    [q.max_crashes for q in queues.values()],
                    queues[DEFAULT_QUEUE].max_crashes,
                )  # fmt: skip
                if row["rescued"] or row["died"]:
                    log.warning(
                        "took back %d jobs whose lease expired (%d dead)",
                        row["rescued"] + row["died"], row["died"],
                        extra={"event": "reaper.rescued", "rescued": row["rescued"],
                               "died": row["died"], "term": ctx.term},
                    )  # fmt: skip
                if row["rescued"] + row["died"] < BATCH:
                    break
            gone = await conn.fetch(ctx.queries["member_forget_gone"], *ctx.fence, MEMBER_SILENCE)
        if gone:
            log.info(
                "forgot %d members silent for %s", len(gone), MEMBER_SILENCE,
                extra={"event": "reaper.members_forgotten"},
            )  # fmt: skip
