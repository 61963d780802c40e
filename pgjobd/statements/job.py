"""The statements of sql/job.sql: enqueue, read, claim, promote, finish, renew."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Literal, NamedTuple

import msgspec

from pgjobd.model import ClaimedJob
from pgjobd.statements import Conn, Rendered, columns, one_row, row_of, rows_of, statement


class EnqueueRow(NamedTuple):
    """One job for job_enqueue_many (NULL: the defaults)."""

    kind: str
    args: str  # JSON text
    queue: str | None
    priority: int | None
    run_at: datetime | None
    delay: timedelta | None
    tenant: str | None
    unique_key: str | None
    max_attempts: int | None
    group_key: str | None
    dependencies: str | None = None  # its depends_on ids as array text, '{1,2}'
    expires_at: datetime | None = None
    ttl: timedelta | None = None
    unique_for: timedelta | None = None
    after: str | None = None  # its after ids as array text
    trace_context: str | None = None  # JSON text (pgjobd.tracing)


class CopySet(NamedTuple):
    """One distinct set of given options in a batch for job_copy_prepare (None: not
    given), with how many of the batch's jobs have it."""

    kind: str
    queue: str | None
    priority: int | None
    run_at: datetime | None
    delay: timedelta | None
    max_attempts: int | None
    ttl: timedelta | None
    expires_at: datetime | None
    jobs: int
    grouped: bool  # whether any of those jobs has a group


class CopyPrepared(NamedTuple):
    """job_copy_prepare's answer: each set's resolved options (by position), the ids."""

    states: list[str]
    queues: list[str]
    priorities: list[int]
    run_ats: list[datetime]
    max_attempts: list[int]
    expires_ats: list[datetime | None]
    ids: list[int]
    row_security: bool  # COPY FROM is refused: insert with job_copy_insert


class CopyRow(NamedTuple):
    """One row of the COPY path, as COPYed into the job table (its column names)."""

    id: int
    kind: str
    args: str  # JSON text
    tenant: str | None
    group_key: str | None
    trace_context: str | None  # JSON text
    state: str
    queue: str
    priority: int
    run_at: datetime
    max_attempts: int
    expires_at: datetime | None


class JobRow(NamedTuple):
    """A job as job_get reads it, live or final."""

    id: int
    kind: str
    queue: str
    state: str
    attempt: int
    max_attempts: int
    priority: int
    args: str  # JSON text
    result: str | None  # JSON text
    reason: str | None
    tenant: str | None
    unique_key: str | None
    run_at: datetime
    enqueued_at: datetime
    finished_at: datetime | None
    last_error: str | None
    depends_on: list[int]
    after: list[int]
    expires_at: datetime | None


class Dependant(NamedTuple):
    id: int
    edge: str  # 'depends_on' or 'after'


class LiveId(NamedTuple):
    id: int


class AttemptError(NamedTuple):
    attempt: int
    error: str
    at: datetime


class ClaimRow(NamedTuple):
    id: int
    fence: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    crashes: int
    priority: int
    tenant: str | None
    enqueued_at: datetime
    scheduled_at: datetime
    args: str  # JSON text
    waited_s: float
    depends_on: list[int] | None = None  # what it waited for (issue 13)
    after_jobs: list[int] | None = None
    blockers_failed: int = 0  # `after` jobs that ended dead or cancelled
    trace_context: str | None = None  # JSON text (pgjobd.tracing)

    def claimed_job(self) -> ClaimedJob:
        """The job as the member holds it (the args stay JSON text, as bytes). Its fields
        by position, in ClaimedJob's order: a claim makes one per job."""
        return ClaimedJob(
            self.id, self.fence, self.kind, self.queue, self.attempt, self.max_attempts,
            self.crashes, self.priority, self.tenant, self.enqueued_at, self.scheduled_at,
            self.args.encode(),
            () if self.depends_on is None else tuple(self.depends_on),
            () if self.after_jobs is None else tuple(self.after_jobs),
            self.blockers_failed,
            None if self.trace_context is None else _trace_context(self.trace_context),
        )  # fmt: skip


def _trace_context(text: str) -> dict[str, str] | None:
    try:
        return msgspec.json.decode(text, type=dict[str, str])
    except msgspec.DecodeError:  # not propagation fields (a direct INSERT): not carried
        return None


class FlowClaimRow(NamedTuple):
    """job_claim_flow's rows: claimed jobs, and (id NULL) the limits that held any back."""

    id: int | None
    fence: int | None
    kind: str | None
    queue: str | None
    attempt: int | None
    max_attempts: int | None
    crashes: int | None
    priority: int | None
    tenant: str | None
    enqueued_at: datetime | None
    scheduled_at: datetime | None
    args: str | None
    waited_s: float | None
    depends_on: list[int] | None
    after_jobs: list[int] | None
    blockers_failed: int | None
    trace_context: str | None
    held_by: str | None

    @classmethod
    def held_back(cls, by: str) -> FlowClaimRow:
        """The row of a claim that `by` held back and that took nothing."""
        return cls(*[None] * (len(cls._fields) - 1), by)  # type: ignore[call-arg]

    def claim_row(self) -> ClaimRow:
        """A claimed job's row as job_claim returns it (id not NULL)."""
        return ClaimRow(*self[:-1])  # type: ignore[arg-type]  # (id not NULL: all set)


class Allocation(NamedTuple):
    """flow_allocate's answer: what the member's claims may fill, and what every count of
    the queue adds for the member (migration 0025)."""

    ceiling: int
    places: int


ClaimPath = Literal["plain", "allocated", "fair", "limited"]


class ClaimKey(NamedTuple):
    """A job's place in claim order: job_claim starts after it (see the producer)."""

    priority: int
    run_at: datetime
    id: int

    @classmethod
    def of(cls, row: ClaimRow) -> ClaimKey:
        return cls(row.priority, row.scheduled_at, row.id)


class Promoted(NamedTuple):
    promoted: int
    queues: list[str]
    next_due_in_s: float | None


class CompleteRow(NamedTuple):
    id: int
    fence: int
    result: str | None  # JSON text
    keep_history: bool


class AttemptKey(NamedTuple):
    id: int
    fence: int


class FailRow(NamedTuple):
    id: int
    fence: int
    verdict: str
    max_crashes: int
    delay: timedelta
    error_class: str | None
    error_message: str | None
    traceback: str | None
    duration_s: float
    keep_history: bool
    fingerprint: str | None = None  # of the error (pgjobd.fingerprint)


class FailRecorded(NamedTuple):
    id: int
    fence: int
    reason: str | None  # the job ended: why (dead), or 'cancelled'


class LeaseRow(NamedTuple):
    id: int
    fence: int
    cancel_requested: bool
    renewed: bool


class JobStatements(Rendered):
    @statement("job_enqueue")
    async def job_enqueue(
        self, conn: Conn, kind: str, args: str, queue: str | None,
        priority: int | None, run_at: datetime | None, tenant: str | None,
        unique_key: str | None, max_attempts: int | None, delay: timedelta | None,
        on_conflict: str, group_key: str | None = None,
        depends_on: Sequence[int] | None = None, expires_at: datetime | None = None,
        ttl: timedelta | None = None, unique_for: timedelta | None = None,
        after: Sequence[int] | None = None, trace_context: str | None = None,
    ) -> int:  # fmt: skip
        job_id: int = await conn.fetchval(
            self.sql("job_enqueue"), kind, args, queue, priority, run_at, tenant, unique_key,
            max_attempts, delay, on_conflict, group_key, depends_on, expires_at, ttl,
            unique_for, after, trace_context,
        )  # fmt: skip
        return job_id

    @statement("job_enqueue_many")
    async def job_enqueue_many(
        self, conn: Conn, jobs: Sequence[EnqueueRow], on_conflict: str
    ) -> list[int]:
        rows = await conn.fetch(
            self.sql("job_enqueue_many"), *columns(jobs, len(EnqueueRow._fields)), on_conflict
        )
        return [row[0] for row in rows]

    @statement("job_copy_prepare")
    async def job_copy_prepare(
        self, conn: Conn, sets: Sequence[CopySet], job_count: int
    ) -> CopyPrepared:
        record = await conn.fetchrow(
            self.sql("job_copy_prepare"), *columns(sets, len(CopySet._fields)), job_count
        )
        return one_row("job_copy_prepare", CopyPrepared, record)

    @statement("job_copy_insert")
    async def job_copy_insert(self, conn: Conn, rows: Sequence[CopyRow]) -> None:
        await conn.execute(self.sql("job_copy_insert"), *columns(rows, len(CopyRow._fields)))

    @statement("job_get")
    async def job_get(self, conn: Conn, job_id: int) -> JobRow | None:
        return row_of(JobRow, await conn.fetchrow(self.sql("job_get"), job_id))

    @statement("job_dependants")
    async def job_dependants(self, conn: Conn, job_id: int) -> list[Dependant]:
        return rows_of(Dependant, await conn.fetch(self.sql("job_dependants"), job_id))

    @statement("job_live_ids")
    async def job_live_ids(self, conn: Conn, ids: Sequence[int]) -> list[LiveId]:
        return rows_of(LiveId, await conn.fetch(self.sql("job_live_ids"), ids))

    @statement("job_results")
    async def job_results(self, conn: Conn, ids: Sequence[int]) -> str | None:
        text: str | None = await conn.fetchval(self.sql("job_results"), ids)
        return text

    @statement("job_attempt_errors")
    async def job_attempt_errors(self, conn: Conn, job_id: int) -> list[AttemptError]:
        return rows_of(AttemptError, await conn.fetch(self.sql("job_attempt_errors"), job_id))

    @statement("job_claim")
    async def job_claim(
        self, conn: Conn, queue: str, limit: int, member_id: str, lease: timedelta,
        after_priority: int | None = None, after_run_at: datetime | None = None,
        after_id: int | None = None,
    ) -> list[ClaimRow]:  # fmt: skip
        """after_*: claim only jobs after that place in claim order (a ClaimKey; None:
        from the head)."""
        records = await conn.fetch(
            self.sql("job_claim"), queue, limit, member_id, lease,
            after_priority, after_run_at, after_id,
        )  # fmt: skip
        return rows_of(ClaimRow, records)

    @statement("job_available_behind")
    async def job_available_behind(
        self, conn: Conn, queue: str, after_priority: int, after_run_at: datetime, after_id: int
    ) -> bool:
        """Whether a job of the queue is available at or before that place in claim
        order (a ClaimKey: a producer's cursor)."""
        return bool(
            await conn.fetchval(
                self.sql("job_available_behind"), queue, after_priority, after_run_at, after_id
            )
        )

    @statement("job_claim_flow")
    async def job_claim_flow(
        self,
        conn: Conn,
        queue: str,
        limit: int,
        member_id: str,
        lease: timedelta,
        ended: Sequence[int] = (),
    ) -> list[FlowClaimRow]:
        records = await conn.fetch(
            self.sql("job_claim_flow"), queue, limit, member_id, lease, list(ended)
        )
        return rows_of(FlowClaimRow, records)

    @statement("flow_reserve")
    async def flow_reserve(
        self, conn: Conn, queue: str, limit: int, member_id: str, ended: Sequence[int],
        loop: int,
    ) -> int | None:  # fmt: skip
        """Places granted (None: the queue is not reservable)."""
        places: int | None = await conn.fetchval(
            self.sql("flow_reserve"), queue, limit, member_id, list(ended), loop
        )
        return places

    @statement("job_claim_reserved")
    async def job_claim_reserved(
        self, conn: Conn, queue: str, member_id: str, lease: timedelta, loop: int, places: int
    ) -> list[ClaimRow]:
        records = await conn.fetch(
            self.sql("job_claim_reserved"), queue, member_id, lease, loop, places
        )
        return rows_of(ClaimRow, records)

    @statement("job_claim_fair")
    async def job_claim_fair(
        self, conn: Conn, queue: str, limit: int, member_id: str, lease: timedelta
    ) -> list[ClaimRow]:
        records = await conn.fetch(self.sql("job_claim_fair"), queue, limit, member_id, lease)
        return rows_of(ClaimRow, records)

    @statement("flow_allocate")
    async def flow_allocate(
        self, conn: Conn, queue: str, member_id: str, ended: Sequence[int], more: int
    ) -> Allocation | None:
        """The member's allocation made anew (None: the queue is not reservable)."""
        row = await conn.fetchrow(self.sql("flow_allocate"), queue, member_id, list(ended), more)
        allocation = row_of(Allocation, row)
        return None if allocation is None or allocation.ceiling is None else allocation

    @statement("job_claim_allocated")
    async def job_claim_allocated(
        self, conn: Conn, queue: str, limit: int, member_id: str, lease: timedelta,
        ended: Sequence[int], after_priority: int | None = None,
        after_run_at: datetime | None = None, after_id: int | None = None,
    ) -> list[FlowClaimRow]:  # fmt: skip
        records = await conn.fetch(
            self.sql("job_claim_allocated"), queue, limit, member_id, lease, list(ended),
            after_priority, after_run_at, after_id,
        )  # fmt: skip
        return rows_of(FlowClaimRow, records)

    @statement("queue_claim_path_get")
    async def queue_claim_path_get(self, conn: Conn, queue: str) -> str:
        """Which claim statement the queue takes (a ClaimPath)."""
        path: str = await conn.fetchval(self.sql("queue_claim_path_get"), queue)
        return path

    @statement("queue_flow_get")
    async def queue_flow_get(self, conn: Conn, queue: str) -> bool:
        """Whether the queue claims through job_claim_flow."""
        flow: bool = await conn.fetchval(self.sql("queue_flow_get"), queue)
        return flow

    @statement("queue_room_announce")
    async def queue_room_announce(self, conn: Conn, queues: Sequence[str], member_id: str) -> None:
        await conn.execute(self.sql("queue_room_announce"), queues, member_id)

    @statement("job_promote_due")
    async def job_promote_due(self, conn: Conn, limit: int) -> Promoted:
        record = await conn.fetchrow(self.sql("job_promote_due"), limit)
        return one_row("job_promote_due", Promoted, record)

    @statement("job_complete_many")
    async def job_complete_many(self, conn: Conn, rows: Sequence[CompleteRow]) -> list[AttemptKey]:
        ids, fences, results, keep = columns(rows, len(CompleteRow._fields))
        # The common batch, no results and every record kept, as NULL arrays: fewer
        # elements for asyncpg to look at (it asks each whether it is a sub-array).
        records = await conn.fetch(
            self.sql("job_complete_many"), ids, fences,
            None if results.count(None) == len(results) else results,
            None if keep.count(True) == len(keep) else keep,
        )  # fmt: skip
        return rows_of(AttemptKey, records)

    @statement("job_fail_many")
    async def job_fail_many(
        self, conn: Conn, rows: Sequence[FailRow], member_id: str
    ) -> list[FailRecorded]:
        records = await conn.fetch(
            self.sql("job_fail_many"), *columns(rows, len(FailRow._fields)), member_id
        )
        return rows_of(FailRecorded, records)

    @statement("job_lease_renew")
    async def job_lease_renew(
        self, conn: Conn, member_id: str, held: Sequence[AttemptKey],
        lease: timedelta,
    ) -> list[LeaseRow]:  # fmt: skip
        ids, fences = columns(held, 2)
        records = await conn.fetch(self.sql("job_lease_renew"), member_id, ids, fences, lease)
        return rows_of(LeaseRow, records)
