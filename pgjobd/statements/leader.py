"""The statements of sql/leader.sql: the election, the term, and the reaper's and the
rotator's and the queue stats' reads and writes."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from pgjobd import fingerprint
from pgjobd.statements import Conn, Rendered, columns, one_row, rows_of, statement


class QueueCrashes(NamedTuple):
    queue: str
    max_crashes: int


class Reaped(NamedTuple):
    rescued: int
    died: int
    queues_woken: int


class Partition(NamedTuple):
    name: str
    detach_pending: bool


class QueueStatRow(NamedTuple):
    queue: str
    available: int
    scheduled: int
    running: int
    retryable: int
    oldest_available_age_s: float | None
    paused: bool
    blocked: int = 0
    by_tenant: bool = False  # fair or tenant_concurrency: see queue_tenant_stats


class QueueTenantStatRow(NamedTuple):
    queue: str
    tenant: str | None  # None: the tenants past the ones shown, summed
    available: int
    scheduled: int
    running: int
    retryable: int
    blocked: int


class ExpiredRow(NamedTuple):
    queue: str
    kind: str
    expired: int


class BreakerRow(NamedTuple):
    """A kind's circuit breaker after one step of the breaker role."""

    kind: str
    state: str  # closed, open, half_open
    change: str | None  # opened, half_open, closed: what this step did (None: nothing)
    failures: int | None  # counted while closed (at most the breaker's threshold)
    probe: int | None  # the probe job's id, while one is out or was judged now


class LeaderStatements(Rendered):
    @statement("leader_try_lock")
    async def leader_try_lock(self, conn: Conn, key_hi: int, key_lo: int) -> bool:
        got: bool = await conn.fetchval(self.sql("leader_try_lock"), key_hi, key_lo)
        return got

    @statement("leader_still_holds")
    async def leader_still_holds(
        self, conn: Conn, key_hi: int, key_lo: int, term: int
    ) -> bool | None:
        holds: bool | None = await conn.fetchval(
            self.sql("leader_still_holds"), key_hi, key_lo, term
        )
        return holds

    @statement("leader_term_begin")
    async def leader_term_begin(self, conn: Conn, member_id: str) -> int:
        term: int = await conn.fetchval(self.sql("leader_term_begin"), member_id)
        return term

    @statement("leader_term_holds")
    async def leader_term_holds(self, conn: Conn, term: int) -> int | None:
        """The term, locked FOR SHARE, while it is open; None once it has ended."""
        held: int | None = await conn.fetchval(self.sql("leader_term_holds"), term)
        return held

    @statement("leader_term_open")
    async def leader_term_open(self, conn: Conn, term: int) -> bool:
        is_open: bool = await conn.fetchval(self.sql("leader_term_open"), term)
        return is_open

    @statement("leader_resign")
    async def leader_resign(self, conn: Conn, term: int, key_hi: int, key_lo: int) -> int:
        """How many terms were ended (0: it had ended already)."""
        ended: int = await conn.fetchval(self.sql("leader_resign"), term, key_hi, key_lo)
        return ended

    @statement("job_reap_expired")
    async def job_reap_expired(
        self, conn: Conn, term: int, lease: timedelta, limit: int,
        queues: Sequence[QueueCrashes], other_max_crashes: int,
        lost_lease_fingerprint: str = fingerprint.LEASE_EXPIRED,
    ) -> Reaped:  # fmt: skip
        record = await conn.fetchrow(
            self.sql("job_reap_expired"), term, lease, limit, *columns(queues, 2),
            other_max_crashes, lost_lease_fingerprint,
        )  # fmt: skip
        return one_row("job_reap_expired", Reaped, record)

    @statement("job_expire")
    async def job_expire(self, conn: Conn, term: int, limit: int) -> list[ExpiredRow]:
        return rows_of(ExpiredRow, await conn.fetch(self.sql("job_expire"), term, limit))

    @statement("member_forget_gone")
    async def member_forget_gone(self, conn: Conn, term: int, silence: timedelta) -> list[str]:
        """The ids of the members forgotten."""
        return [row[0] for row in await conn.fetch(self.sql("member_forget_gone"), term, silence)]

    @statement("partition_list")
    async def partition_list(self, conn: Conn, parent: str) -> list[Partition]:
        return rows_of(Partition, await conn.fetch(self.sql("partition_list"), parent))

    @statement("maintainer_role_to_set")
    async def maintainer_role_to_set(self, conn: Conn, maintainer: str) -> str | None:
        """The role to SET ROLE to for the owner's DDL, or None when none is needed."""
        role: str | None = await conn.fetchval(self.sql("maintainer_role_to_set"), maintainer)
        return role

    @statement("partition_drop")
    async def partition_drop(self, conn: Conn, parent: str, partition: str) -> bool:
        """False when the partition was gone already."""
        dropped: bool = await conn.fetchval(self.sql("partition_drop"), parent, partition)
        return dropped

    @statement("job_next_lease_expiry")
    async def job_next_lease_expiry(self, conn: Conn, term: int, lease: timedelta) -> float | None:
        """Seconds until the next lease runs out (None: no job is running)."""
        seconds: float | None = await conn.fetchval(self.sql("job_next_lease_expiry"), term, lease)
        return seconds

    @statement("queue_stats_publish")
    async def queue_stats_publish(self, conn: Conn, queues: Sequence[str]) -> list[QueueStatRow]:
        return rows_of(QueueStatRow, await conn.fetch(self.sql("queue_stats_publish"), queues))

    @statement("queue_tenant_stats")
    async def queue_tenant_stats(self, conn: Conn, shown: int) -> list[QueueTenantStatRow]:
        return rows_of(QueueTenantStatRow, await conn.fetch(self.sql("queue_tenant_stats"), shown))

    @statement("queue_sample_record")
    async def queue_sample_record(
        self, conn: Conn, queues: Sequence[str], longest_window: timedelta
    ) -> None:
        await conn.execute(self.sql("queue_sample_record"), queues, longest_window)

    @statement("queue_sample_trim")
    async def queue_sample_trim(self, conn: Conn, retention: timedelta) -> None:
        await conn.execute(self.sql("queue_sample_trim"), retention)

    @statement("job_priorities_age")
    async def job_priorities_age(
        self, conn: Conn, queue: str, aging: timedelta, per_priority: int
    ) -> int:
        """How many jobs moved up one priority step."""
        return len(await conn.fetch(self.sql("job_priorities_age"), queue, aging, per_priority))

    @statement("kind_breakers_step")
    async def kind_breakers_step(self, conn: Conn, now: datetime | None) -> list[BreakerRow]:
        """Every declared breaker's state after opening, half-opening or closing those
        due (now: the clock's, None for the database's)."""
        return rows_of(BreakerRow, await conn.fetch(self.sql("kind_breakers_step"), now))
