"""The statements of sql/admin.sql: what sits behind the admin commands."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from pgjobd.statements import Conn, Rendered, one_row, row_of, rows_of, statement


class MemberRow(NamedTuple):
    id: str
    host: str
    pid: int
    version: str
    started_at: datetime
    heartbeat_at: datetime
    queues: list[str]
    uptime_s: float


class LeaderRow(NamedTuple):
    term: int
    member: str


class QueueStatusRow(NamedTuple):
    queue: str
    available: int
    scheduled: int
    running: int
    retryable: int
    oldest_available_age_s: float | None
    paused: bool
    dead_last_hour: int
    throughput_per_s: float
    global_concurrency: int | None
    rate_limit: int | None  # starts per rate_window
    rate_window: timedelta | None
    max_depth: int | None
    blocked: int = 0
    tenant_concurrency: int | None = None
    fair: bool = False
    counted_at: datetime | None = None  # the leader's published counts' time (None: now)


class JobListRow(NamedTuple):
    id: int
    state: str
    queue: str
    kind: str
    attempt: int
    max_attempts: int
    priority: int
    run_at: datetime
    enqueued_at: datetime
    finished_at: datetime | None
    reason: str | None
    last_error: str | None
    cancel_requested: bool
    tenant: str | None


class JobState(NamedTuple):
    id: int
    state: str


class FinalState(NamedTuple):
    id: int
    state: str
    unique_key: str | None


class Cancelled(NamedTuple):
    cancelled: list[int]
    flagged: list[int]
    announced: int


class MadeAvailable(NamedTuple):
    ids: list[int]
    queues_woken: int


class Revived(NamedTuple):
    ids: list[int]
    blocked: list[int]
    queues_woken: int


class DeadRow(NamedTuple):
    id: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    reason: str | None
    finished_at: datetime
    enqueued_at: datetime
    last_error: str | None
    args: str  # JSON text
    redact: list[str] | None  # the args fields its kind redacts
    fingerprint: str | None


class MissingRoleRow(NamedTuple):
    role: str
    login: str


class KindRedactRow(NamedTuple):
    redact: list[str] | None


class ScrubbedRow(NamedTuple):
    ids: list[int]
    attempts: int


class DeadGroupRow(NamedTuple):
    fingerprint: str | None
    reason: str | None
    jobs: int  # how many (not `count`: a tuple has a method of that name)
    kinds: list[str]
    last_dead_at: datetime
    last_error: str | None
    key: str  # dead_group_key: "<fingerprint>.<reason>"
    queues: list[str]
    first_at: datetime
    newest_id: int


class PausedRow(NamedTuple):
    was_paused: bool
    paused: bool
    announced: bool
    woken: bool


class CronListRow(NamedTuple):
    now: datetime
    name: str | None  # None: the one row when there is no schedule
    schedule: str
    timezone: str
    kind: str
    queue: str | None
    catch_up: str
    enabled: bool
    source: str
    last_slot: datetime | None
    args: str  # JSON text
    updated_at: datetime


class BreakerStatusRow(NamedTuple):
    """A kind's circuit breaker, as status shows it."""

    kind: str
    state: str  # closed, open, half_open
    since: datetime | None  # when its state last changed (None: never)
    failures: int  # failed attempts within window_s open it
    window_s: float
    cooldown_s: float
    probe: int | None  # the probe job while one runs


class AdminStatements(Rendered):
    @statement("admin_audit_insert")
    async def admin_audit_insert(
        self, conn: Conn, user: str | None, action: str, target: str | None,
        job_ids: Sequence[int], detail: str, arguments: str,
    ) -> int:  # fmt: skip
        """The audit row's id; `detail` and `arguments` are JSON objects' text."""
        audit_id: int = await conn.fetchval(
            self.sql("admin_audit_insert"), user, action, target, job_ids, detail, arguments
        )
        return audit_id

    @statement("admin_role_missing")
    async def admin_role_missing(self, conn: Conn, role: str, schema: str) -> MissingRoleRow | None:
        """The role an admin action needs and the session's user, when it lacks it."""
        record = await conn.fetchrow(self.sql("admin_role_missing"), role, schema)
        return row_of(MissingRoleRow, record)

    @statement("admin_scrub_live")
    async def admin_scrub_live(
        self, conn: Conn, tenant: str | None, kind: str | None, before: datetime | None
    ) -> list[int]:
        records = await conn.fetch(self.sql("admin_scrub_live"), tenant, kind, before)
        return [row[0] for row in records]

    @statement("admin_scrub")
    async def admin_scrub(
        self, conn: Conn, tenant: str | None, kind: str | None, before: datetime | None
    ) -> ScrubbedRow:
        record = await conn.fetchrow(self.sql("admin_scrub"), tenant, kind, before)
        return one_row("admin_scrub", ScrubbedRow, record)

    @statement("admin_kind_redact")
    async def admin_kind_redact(self, conn: Conn, kind: str) -> KindRedactRow | None:
        return row_of(KindRedactRow, await conn.fetchrow(self.sql("admin_kind_redact"), kind))

    @statement("admin_status_breakers")
    async def admin_status_breakers(self, conn: Conn) -> list[BreakerStatusRow]:
        return rows_of(BreakerStatusRow, await conn.fetch(self.sql("admin_status_breakers")))

    @statement("admin_status_members")
    async def admin_status_members(self, conn: Conn, liveness: timedelta) -> list[MemberRow]:
        return rows_of(MemberRow, await conn.fetch(self.sql("admin_status_members"), liveness))

    @statement("admin_status_leader")
    async def admin_status_leader(self, conn: Conn, key_hi: int, key_lo: int) -> LeaderRow | None:
        record = await conn.fetchrow(self.sql("admin_status_leader"), key_hi, key_lo)
        return row_of(LeaderRow, record)

    @statement("admin_status_queues")
    async def admin_status_queues(
        self, conn: Conn, liveness: timedelta, published_within: timedelta | None = None
    ) -> list[QueueStatusRow]:
        records = await conn.fetch(self.sql("admin_status_queues"), liveness, published_within)
        return rows_of(QueueStatusRow, records)

    @statement("admin_jobs_list")
    async def admin_jobs_list(
        self, conn: Conn, states: Sequence[str] | None, queue: str | None, kind: str | None,
        limit: int, include_live: bool, include_final: bool, tenant: str | None,
        before: int | None,
    ) -> list[JobListRow]:  # fmt: skip
        records = await conn.fetch(
            self.sql("admin_jobs_list"), states, queue, kind, limit, include_live,
            include_final, tenant, before,
        )  # fmt: skip
        return rows_of(JobListRow, records)

    @statement("admin_jobs_lock_live")
    async def admin_jobs_lock_live(self, conn: Conn, ids: Sequence[int]) -> list[JobState]:
        return rows_of(JobState, await conn.fetch(self.sql("admin_jobs_lock_live"), ids))

    @statement("admin_jobs_final_states")
    async def admin_jobs_final_states(self, conn: Conn, ids: Sequence[int]) -> list[FinalState]:
        return rows_of(FinalState, await conn.fetch(self.sql("admin_jobs_final_states"), ids))

    @statement("admin_jobs_cancel")
    async def admin_jobs_cancel(
        self, conn: Conn, pending: Sequence[int], running: Sequence[int]
    ) -> Cancelled:
        record = await conn.fetchrow(self.sql("admin_jobs_cancel"), pending, running)
        return one_row("admin_jobs_cancel", Cancelled, record)

    @statement("admin_jobs_make_available")
    async def admin_jobs_make_available(self, conn: Conn, ids: Sequence[int]) -> MadeAvailable:
        record = await conn.fetchrow(self.sql("admin_jobs_make_available"), ids)
        return one_row("admin_jobs_make_available", MadeAvailable, record)

    @statement("admin_jobs_revive")
    async def admin_jobs_revive(self, conn: Conn, ids: Sequence[int]) -> Revived:
        record = await conn.fetchrow(self.sql("admin_jobs_revive"), ids)
        return one_row("admin_jobs_revive", Revived, record)

    @statement("admin_dlq_list")
    async def admin_dlq_list(
        self, conn: Conn, kind: str | None, queue: str | None, since: datetime | None,
        limit: int, fingerprint: str | None = None,
    ) -> list[DeadRow]:  # fmt: skip
        records = await conn.fetch(
            self.sql("admin_dlq_list"), kind, queue, since, limit, fingerprint
        )
        return rows_of(DeadRow, records)

    @statement("admin_dlq_groups")
    async def admin_dlq_groups(
        self, conn: Conn, kind: str | None, queue: str | None, since: datetime | None,
        limit: int | None = None,
    ) -> list[DeadGroupRow]:  # fmt: skip
        records = await conn.fetch(self.sql("admin_dlq_groups"), kind, queue, since, limit)
        return rows_of(DeadGroupRow, records)

    @statement("admin_dlq_ids")
    async def admin_dlq_ids(
        self, conn: Conn, kind: str | None, queue: str | None, since: datetime | None,
        fingerprint: str | None = None,
    ) -> list[int]:  # fmt: skip
        records = await conn.fetch(self.sql("admin_dlq_ids"), kind, queue, since, fingerprint)
        return [row[0] for row in records]

    @statement("admin_dlq_group_ids")
    async def admin_dlq_group_ids(self, conn: Conn, key: str, within: timedelta) -> list[int]:
        records = await conn.fetch(self.sql("admin_dlq_group_ids"), key, within)
        return [row[0] for row in records]

    @statement("admin_queue_set_paused")
    async def admin_queue_set_paused(
        self, conn: Conn, queue: str, paused: bool, updated_by: str | None
    ) -> PausedRow:
        record = await conn.fetchrow(self.sql("admin_queue_set_paused"), queue, paused, updated_by)
        return one_row("admin_queue_set_paused", PausedRow, record)

    @statement("admin_cron_list")
    async def admin_cron_list(self, conn: Conn) -> list[CronListRow]:
        return rows_of(CronListRow, await conn.fetch(self.sql("admin_cron_list")))
