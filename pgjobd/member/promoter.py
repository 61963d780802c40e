"""The promoter: makes due scheduled and retryable jobs claimable, PROMOTE_BATCH at a
time, and sleeps until the next one is due (PROMOTE_MAX_SLEEP_S at most)."""

from __future__ import annotations

import logging
from typing import ClassVar

import anyio

from pgjobd import backoff, db
from pgjobd.errors import retry_later
from pgjobd.member import MemberContext

log = logging.getLogger(__name__)

PROMOTE_BATCH = 1000
PROMOTE_MAX_SLEEP_S = 1.0


class Promoter:
    name: ClassVar[str] = "promoter"

    async def run(self, ctx: MemberContext) -> None:
        while True:
            try:
                async with db.acquire(ctx.pool) as conn:
                    promoted = await ctx.queries.job_promote_due(conn, PROMOTE_BATCH)
            except Exception as e:
                if not retry_later(e):
                    raise
                log.warning("promoting due jobs failed: %s", e)
                await anyio.sleep(backoff.jittered(PROMOTE_MAX_SLEEP_S))
                continue
            if promoted.promoted >= PROMOTE_BATCH:
                continue
            next_due_s = promoted.next_due_in_s
            sleep_s = PROMOTE_MAX_SLEEP_S if next_due_s is None else next_due_s
            await anyio.sleep(min(max(sleep_s, 0.005), PROMOTE_MAX_SLEEP_S))
