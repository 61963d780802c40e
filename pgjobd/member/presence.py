"""Presence: the member's row in the `member` table. Joined once the member serves,
heartbeated every HEARTBEAT_S (a row the fleet removed is written again), removed as
the member leaves. Every good round trip is recorded in the vitals."""

from __future__ import annotations

import logging
import os
import socket
from typing import ClassVar

import anyio

from pgjobd import __version__, backoff, db, migrate
from pgjobd.errors import TRANSIENT, retry_later
from pgjobd.member import MemberContext

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0


class Presence:
    name: ClassVar[str] = "heartbeat"

    async def join(self, ctx: MemberContext) -> None:
        async with db.acquire(ctx.pool) as conn:
            await ctx.queries.partitions_ensure(conn, migrate.PARTITION_DAYS_AHEAD)
            await ctx.queries.member_join(
                conn, ctx.member_id, socket.gethostname(), os.getpid(), __version__,
                list(ctx.config.current.queues),
            )  # fmt: skip
        ctx.vitals.db_ok_at = anyio.current_time()

    async def leave(self, ctx: MemberContext) -> None:
        with anyio.move_on_after(5, shield=True):
            try:
                async with db.acquire(ctx.pool) as conn:
                    await ctx.queries.member_leave(conn, ctx.member_id)
            except TRANSIENT as e:
                log.warning("could not remove the member row: %s", e)

    async def run(self, ctx: MemberContext) -> None:
        while True:
            await anyio.sleep(backoff.jittered(HEARTBEAT_S, 0.1))
            try:
                async with db.acquire(ctx.pool) as conn:
                    alive = await ctx.queries.member_heartbeat(
                        conn, ctx.member_id, list(ctx.config.current.queues)
                    )
                if not alive:
                    await self.join(ctx)
            except Exception as e:
                if not retry_later(e):
                    raise
                ctx.vitals.db_error = f"heartbeat failed: {e}"
                log.warning("heartbeat failed: %s", e, extra={"event": "member.heartbeat_failed"})
            else:
                ctx.vitals.db_ok_at, ctx.vitals.db_error = anyio.current_time(), None
