"""The statements of sql/member.sql: a member's row, its kinds, the partitions."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple

from pgjobd.statements import Conn, Rendered, columns, rows_of, statement


class KindDeclared(NamedTuple):
    """A kind's effective defaults, as a member declares them."""

    kind: str
    queue: str
    priority: int
    max_attempts: int
    timeout_s: float
    global_concurrency: int | None
    rate_limit: int | None  # starts per rate_window
    rate_window: timedelta | None
    redact: str  # the args fields its handler redacts, as a JSON array's text
    # Its circuit breaker (None: none): failures in breaker_window open it for
    # breaker_cooldown.
    breaker_failures: int | None = None
    breaker_window: timedelta | None = None
    breaker_cooldown: timedelta | None = None


class QueueLimits(NamedTuple):
    """A queue's fleet-wide limits, as a member's config says them (NULL: none)."""

    name: str
    global_concurrency: int | None
    rate_limit: int | None
    rate_window: timedelta | None
    max_depth: int | None
    tenant_concurrency: int | None
    fair: bool


class LimitsOverridden(NamedTuple):
    """The limits another member had written for a queue whose limits a write changed."""

    name: str
    global_concurrency: int | None
    rate_limit: int | None
    rate_window: timedelta | None
    max_depth: int | None
    tenant_concurrency: int | None
    fair: bool
    limits_by: str


class WeightOverridden(NamedTuple):
    """A tenant's weight that another member had written, changed or removed by a write."""

    tenant: str
    weight: int
    weights_by: str


class MemberStatements(Rendered):
    @statement("member_join")
    async def member_join(
        self, conn: Conn, member_id: str, host: str, pid: int, version: str,
        queues: Sequence[str],
    ) -> None:  # fmt: skip
        await conn.execute(self.sql("member_join"), member_id, host, pid, version, queues)

    @statement("member_heartbeat")
    async def member_heartbeat(
        self, conn: Conn, member_id: str, queues: Sequence[str]
    ) -> bool | None:
        """True while the member's row exists (None or False: it is gone)."""
        alive: bool | None = await conn.fetchval(self.sql("member_heartbeat"), member_id, queues)
        return alive

    @statement("member_leave")
    async def member_leave(self, conn: Conn, member_id: str) -> None:
        await conn.execute(self.sql("member_leave"), member_id)

    @statement("kind_declare_many")
    async def kind_declare_many(
        self, conn: Conn, kinds: Sequence[KindDeclared], member_id: str
    ) -> None:
        sql = self.sql("kind_declare_many")
        await conn.execute(sql, *columns(kinds, len(KindDeclared._fields)), member_id)

    @statement("queue_limits_write")
    async def queue_limits_write(
        self, conn: Conn, queues: Sequence[QueueLimits], member_id: str
    ) -> list[LimitsOverridden]:
        records = await conn.fetch(
            self.sql("queue_limits_write"), *columns(queues, len(QueueLimits._fields)), member_id
        )
        return rows_of(LimitsOverridden, records)

    @statement("tenant_weights_write")
    async def tenant_weights_write(
        self, conn: Conn, tenants: Sequence[str], weights: Sequence[int], member_id: str
    ) -> list[WeightOverridden]:
        records = await conn.fetch(self.sql("tenant_weights_write"), tenants, weights, member_id)
        return rows_of(WeightOverridden, records)

    @statement("queue_depth_recount")
    async def queue_depth_recount(self, conn: Conn, queues: Sequence[str] | None) -> int:
        """Recounts the depth estimate of these queues with a max_depth (None: all)."""
        recounted: int = await conn.fetchval(self.sql("queue_depth_recount"), queues)
        return recounted

    @statement("partitions_ensure")
    async def partitions_ensure(self, conn: Conn, days_ahead: int) -> int:
        made: int = await conn.fetchval(self.sql("partitions_ensure"), days_ahead)
        return made
