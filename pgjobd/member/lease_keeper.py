"""The lease keeper: renews the lease of every job held on this member in one statement
every third of a lease, and cancels the jobs whose lease was lost (another member may
run them now) or that an admin cancelled (in case the NOTIFY was missed)."""

from __future__ import annotations

import logging
from typing import ClassVar

import anyio

from pgjobd import db
from pgjobd.errors import retry_later
from pgjobd.member import MemberContext
from pgjobd.statements.job import AttemptKey
from pgjobd.supervisor import JobKey

log = logging.getLogger(__name__)


class LeaseKeeper:
    name: ClassVar[str] = "lease keeper"

    async def run(self, ctx: MemberContext) -> None:
        while True:
            lease = ctx.config.current.daemon.lease
            await anyio.sleep(lease.total_seconds() / 3)
            await self.renew(ctx)

    async def renew(self, ctx: MemberContext) -> None:
        held = ctx.held()
        if not held:
            return
        try:
            async with db.acquire(ctx.pool) as conn:
                rows = await ctx.queries.job_lease_renew(
                    conn, ctx.member_id, [AttemptKey(*key) for key in held],
                    ctx.config.current.daemon.lease,
                )  # fmt: skip
        except Exception as e:
            if not retry_later(e):
                raise
            log.warning("lease renewal failed: %s", e, extra={"event": "lease.renew_failed"})
            return
        # Rows another transaction had locked were skipped, neither renewed nor lost:
        # one locked row must not hold up the renewal of every other.
        found: set[JobKey] = set()
        for row in rows:
            key = (row.id, row.fence)
            found.add(key)
            if row.cancel_requested and key in held:  # in case NOTIFY was missed
                held[key][0].cancel(key)
        for key in held.keys() - found:
            queue_workers, job = held[key]
            if key in queue_workers.held():  # not finished meanwhile
                log.warning(
                    "lease of job %d lost; cancelling it", key[0],
                    extra={"event": "lease.lost", **ctx.job_fields(job)},
                )  # fmt: skip
                queue_workers.cancel(key)
