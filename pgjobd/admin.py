"""The admin operations behind `pgjobd status/jobs/queues/dlq/cron` and
`Client.cancel/retry`: async functions over an asyncpg connection or pool.

Every action (cancel, retry, pause, resume, redrive, cron trigger) runs in one
transaction with its row in ``<schema>.audit`` (the database role, the caller's $USER,
the action, its target and the job ids): the row exists exactly when the action took
effect. Actions on job ids are all-or-nothing: one unknown id (or one retry blocked by a
live job's unique_key) raises and changes nothing.

Reads (status, lists) return msgspec Structs whose fields are the `--json` shapes
documented in docs/cli.md.
"""

from __future__ import annotations

import getpass
import json
import math
import os
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any, Literal, TypeAlias, TypeVar

import asyncpg
import msgspec

from pgjobd import cron_schedule
from pgjobd.errors import PgjobdError
from pgjobd.flow import RateLimit
from pgjobd.leader import unsigned
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.names import MAX_TENANT_BYTES, kind_name_problem, queue_name_problem, text_problem
from pgjobd.queries import Queries, for_schema
from pgjobd.redact import redact_args
from pgjobd.roles import cron as cron_role
from pgjobd.statements.admin import QueueStatusRow

Db: TypeAlias = asyncpg.Connection | asyncpg.Pool

# A member whose heartbeat is older than this is not listed by `status`.
MEMBER_LIVENESS = timedelta(seconds=30)
DEFAULT_LIMIT = 50

LIVE_STATES = ("scheduled", "available", "running", "retryable", "blocked")
FINAL_STATES = ("completed", "dead", "cancelled")
STATES = LIVE_STATES + FINAL_STATES

CancelOutcome = Literal["cancelled", "cancel_requested", "already_final"]
RetryOutcome = Literal["retried", "made_available", "already_available", "running", "blocked"]

_json = msgspec.json.Encoder()


# -- errors ------------------------------------------------------------------------------


class UnknownJobs(PgjobdError):
    """Some job ids name no live job and no final record; nothing was changed."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        listed = ", ".join(str(i) for i in self.ids)
        super().__init__(f"no such job{'s' if len(self.ids) > 1 else ''}: {listed}")


class RetryBlocked(PgjobdError):
    """Retrying these jobs would break a live job's unique_key; nothing was changed."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        listed = ", ".join(str(i) for i in self.ids)
        super().__init__(
            f"cannot retry job(s) {listed}: a live job holds the same unique_key "
            "(or two of them share one); nothing was changed"
        )


class UnknownSchedule(PgjobdError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no such cron schedule: {name}")


class InvalidInput(PgjobdError, ValueError):
    """A bad argument (a queue name, a state): the CLI's usage error."""


class MissingRole(PgjobdError):
    """The session may not act: its login lacks the schema's admin role."""

    def __init__(self, action: str, role: str, login: str) -> None:
        self.action, self.role, self.login = action, role, login
        super().__init__(
            f"{action} needs role {role}: login {login} is not a member of it "
            f"(GRANT {role} TO {login})"
        )


class ScrubRefused(PgjobdError):
    """Live jobs match the scrub's filter; nothing was changed."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        listed = ", ".join(str(i) for i in self.ids)
        super().__init__(
            f"live jobs match: {listed}{' and more' if len(self.ids) >= 20 else ''}. "
            "Scrub only touches finished jobs: cancel them or let them finish, or narrow "
            "--before; nothing was changed"
        )


# -- results -----------------------------------------------------------------------------


class MemberStatus(msgspec.Struct, frozen=True):
    id: str
    host: str
    pid: int
    version: str
    leader: bool
    started_at: datetime
    heartbeat_at: datetime
    uptime_s: float
    queues: list[str]


class LeaderStatus(msgspec.Struct, frozen=True):
    member: str
    term: int


class QueueLimits(msgspec.Struct, frozen=True):
    """A queue's fleet-wide limits (contract §9), and the running count they cap."""

    global_concurrency: int | None
    running: int
    rate_limit: str | None  # "N/DURATION"
    max_depth: int | None
    tenant_concurrency: int | None = None
    fair: bool = False


class QueueStatus(msgspec.Struct, frozen=True):
    available: int
    scheduled: int
    running: int
    retryable: int
    oldest_available_age_s: float | None
    paused: bool
    dead_last_hour: int
    throughput_per_s: float
    limited: QueueLimits
    blocked: int = 0  # waiting for dependencies (depends_on, after)


class BreakerStatus(msgspec.Struct, frozen=True):
    """A kind's circuit breaker: closed, open (not claimed) or half_open (one probe)."""

    state: str
    since: datetime | None  # when it entered that state (None: never changed)
    circuit_breaker: str  # "N/DURATION": N failed attempts within DURATION open it
    cooldown_s: float
    probe: int | None  # the probe job while one runs


class Status(msgspec.Struct, frozen=True):
    members: list[MemberStatus]
    leader: LeaderStatus | None
    queues: dict[str, QueueStatus]
    # Per kind that declares a circuit breaker.
    breakers: dict[str, BreakerStatus] = msgspec.field(default_factory=dict)


class JobSummary(msgspec.Struct, frozen=True):
    """One line of `jobs list`."""

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
    tenant: str | None = None


class DeadJob(msgspec.Struct, frozen=True):
    """One line of `dlq list`."""

    id: int
    kind: str
    queue: str
    attempt: int
    max_attempts: int
    reason: str | None
    finished_at: datetime
    enqueued_at: datetime
    last_error: str | None
    args: dict[str, Any]
    fingerprint: str | None = None  # of its last failed attempt's error


class DeadGroup(msgspec.Struct, frozen=True):
    """Dead jobs sharing the fingerprint of their last failed attempt (and a reason)."""

    fingerprint: str | None
    reason: str | None
    count: int
    kinds: list[str]
    last_dead_at: datetime
    last_error: str | None


class JobActed(msgspec.Struct, frozen=True):
    """What an admin action did to one job (not a handler's pgjobd.JobOutcome)."""

    id: int
    outcome: str  # CancelOutcome or RetryOutcome
    state: str  # the job's state before the action


class JobsAction(msgspec.Struct, frozen=True):
    """What `jobs cancel` / `jobs retry` did, per job, in the order given."""

    action: str
    jobs: list[JobActed]
    audit_id: int


class QueueAction(msgspec.Struct, frozen=True):
    action: str
    queue: str
    paused: bool
    changed: bool
    audit_id: int


class Redrive(msgspec.Struct, frozen=True):
    action: str
    ids: list[int]
    blocked: list[int]  # stayed dead: a live job holds their unique_key
    audit_id: int


class CronListed(msgspec.Struct, frozen=True):
    """A cron entry as `cron list` shows it (the configured one is config.CronEntry)."""

    name: str
    schedule: str
    timezone: str
    kind: str
    queue: str | None
    catch_up: str
    enabled: bool
    source: str
    last_slot: datetime | None
    next_run: datetime | None
    args: dict[str, Any]
    error: str | None  # why next_run could not be computed (a bad 'api' row)


class Scrubbed(msgspec.Struct, frozen=True):
    action: str
    ids: list[int]  # the final jobs whose payloads were overwritten
    attempts: int  # attempt rows whose errors were overwritten
    audit_id: int


class CronTriggered(msgspec.Struct, frozen=True):
    action: str
    name: str
    id: int
    audit_id: int


# -- helpers -----------------------------------------------------------------------------


def os_user() -> str | None:
    """Who runs this process, as the operating system says: $USER, else the login name."""
    user = os.environ.get("USER")
    if user:
        return user
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return None


@asynccontextmanager
async def _connection(db: Db) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            yield conn
    else:
        yield db


def _unique(ids: Iterable[int]) -> list[int]:
    seen: dict[int, None] = {}
    for job_id in ids:
        if isinstance(job_id, bool) or not isinstance(job_id, int):
            raise InvalidInput(f"job ids are integers, got {job_id!r}")
        if not -(2**63) <= job_id < 2**63:
            raise InvalidInput(f"job ids are 64-bit integers, got {job_id}")
        seen.setdefault(job_id, None)
    return list(seen)


T = TypeVar("T")


def _with_args(row: Mapping[str, Any], into: type[T]) -> T:
    """A row whose `args` column is JSON text, as a Struct (unknown columns ignored);
    the fields named in its `redact` column, if any, masked."""
    args = redact_args(read_json(row["args"]), row.get("redact"))
    return msgspec.convert({**row, "args": args}, into)


def read_json(text: str) -> Any:
    """JSON text PostgreSQL stored, for display: never fails on what jsonb accepts.

    jsonb holds numbers beyond a float's range and integers of thousands of digits,
    which msgspec refuses; those are shown as their text. Nesting too deep for Python
    (the SQL functions refuse more than 100 levels; a direct INSERT might not) gives
    ``{"pgjobd_unreadable_json": <the text>}``."""
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        return json.loads(text, parse_int=_int_or_text, parse_float=_float_or_text)
    except (ValueError, RecursionError):
        return {"pgjobd_unreadable_json": text}


def _int_or_text(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        return text


def _float_or_text(text: str) -> float | str:
    value = float(text)
    return value if math.isfinite(value) else text


async def _audit(
    conn: asyncpg.Connection,
    q: Queries,
    user: str | None,
    action: str,
    *,
    target: str | None = None,
    job_ids: Sequence[int] = (),
    detail: dict[str, Any] | None = None,
    arguments: dict[str, Any] | None = None,
) -> int:
    """The action's audit row, in the caller's transaction. `user` is $USER for the
    CLI and the client, or the console's token name; `arguments` what the caller asked
    for, `detail` what the action did."""
    detail_json = _json.encode(detail or {}).decode()
    arguments_json = _json.encode(arguments or {}).decode()
    return await q.admin_audit_insert(
        conn, user, action, target, list(job_ids), detail_json, arguments_json
    )


async def _require_admin(conn: asyncpg.Connection, q: Queries, schema: str, action: str) -> None:
    """MissingRole unless this session may run admin actions on `schema`."""
    row = await q.admin_role_missing(conn, f"{schema}_admin", schema)
    if row is not None:
        raise MissingRole(action, row.role, row.login)


async def _states(
    conn: asyncpg.Connection, q: Queries, ids: list[int]
) -> tuple[dict[int, str], dict[int, str]]:
    """Locks the live jobs among `ids`; (live states, final states). Unknown ids raise."""
    live = {r.id: r.state for r in await q.admin_jobs_lock_live(conn, ids)}
    rest = [i for i in ids if i not in live]
    final: dict[int, str] = {}
    if rest:
        final = {r.id: r.state for r in await q.admin_jobs_final_states(conn, rest)}
    unknown = [i for i in rest if i not in final]
    if unknown:
        raise UnknownJobs(unknown)
    return live, final


# -- status ------------------------------------------------------------------------------


async def status(db: Db, schema: str, *, liveness: timedelta = MEMBER_LIVENESS) -> Status:
    """Members, leader and queues, read in one snapshot; every live job counted now."""
    return (await status_as_counted(db, schema, liveness=liveness))[0]


async def status_as_counted(
    db: Db,
    schema: str,
    *,
    liveness: timedelta = MEMBER_LIVENESS,
    published_within: timedelta | None = None,
) -> tuple[Status, datetime | None]:
    """`status`, with the live counts the leader last published (its queue_stats role)
    when they are at most `published_within` old, and when they were counted; else (or
    without `published_within`) counted now, and None. The web console's overview."""
    q = for_schema(schema)
    async with (
        _connection(db) as conn,
        conn.transaction(isolation="repeatable_read", readonly=True),
    ):
        members, leader = await _fleet(conn, q, schema, liveness)
        queue_rows = await q.admin_status_queues(conn, liveness, published_within)
        breaker_rows = await q.admin_status_breakers(conn)
    queues = {r.queue: _queue_status(r) for r in queue_rows}
    breakers = {
        r.kind: BreakerStatus(
            state=r.state, since=r.since, cooldown_s=r.cooldown_s, probe=r.probe,
            circuit_breaker=str(RateLimit(r.failures, timedelta(seconds=r.window_s))),
        )
        for r in breaker_rows
    }  # fmt: skip
    counted_at = queue_rows[0].counted_at if queue_rows else None
    status = Status(members=members, leader=leader, queues=queues, breakers=breakers)
    return status, counted_at


async def fleet(
    db: Db, schema: str, *, liveness: timedelta = MEMBER_LIVENESS
) -> tuple[list[MemberStatus], LeaderStatus | None]:
    """`status`'s members and leader without its queue counts (which read every live
    job): the web console's members page."""
    q = for_schema(schema)
    async with (
        _connection(db) as conn,
        conn.transaction(isolation="repeatable_read", readonly=True),
    ):
        return await _fleet(conn, q, schema, liveness)


async def _fleet(
    conn: asyncpg.Connection, q: Queries, schema: str, liveness: timedelta
) -> tuple[list[MemberStatus], LeaderStatus | None]:
    leader_row = await q.admin_status_leader(conn, *unsigned(lock_key(LEADER, schema)))
    member_rows = await q.admin_status_members(conn, liveness)
    leader = LeaderStatus(member=leader_row.member, term=leader_row.term) if leader_row else None
    members = [
        msgspec.convert(
            {**r._asdict(), "leader": leader is not None and leader.member == r.id}, MemberStatus
        )
        for r in member_rows
    ]
    return members, leader


def _queue_status(row: QueueStatusRow) -> QueueStatus:
    record = row._asdict()
    del record["counted_at"]
    starts, window = record.pop("rate_limit"), record.pop("rate_window")
    record["limited"] = {
        "global_concurrency": record.pop("global_concurrency"),
        "running": row.running,
        "rate_limit": None if starts is None else str(RateLimit(starts, window)),
        "max_depth": record.pop("max_depth"),
        "tenant_concurrency": record.pop("tenant_concurrency"),
        "fair": record.pop("fair"),
    }
    return msgspec.convert(record, QueueStatus)


# -- jobs --------------------------------------------------------------------------------


async def list_jobs(
    db: Db,
    schema: str,
    *,
    states: Sequence[str] | None = None,
    queue: str | None = None,
    kind: str | None = None,
    limit: int = DEFAULT_LIMIT,
    tenant: str | None = None,
    before: int | None = None,
) -> list[JobSummary]:
    """Jobs newest first; live states are read from the hot table, final ones from
    history, and only the tables the states need are read. `before` pages by key: only
    jobs with a lower id (the previous page's last id)."""
    if states is not None:
        bad = sorted(set(states) - set(STATES))
        if bad:
            expected = ", ".join(STATES)
            raise InvalidInput(f"unknown state {', '.join(bad)}: expected one of {expected}")
    if limit < 1:
        raise InvalidInput(f"limit must be at least 1, got {limit}")
    live = states is None or any(s in LIVE_STATES for s in states)
    final = states is None or any(s in FINAL_STATES for s in states)
    q = for_schema(schema)
    async with _connection(db) as conn:
        rows = await q.admin_jobs_list(
            conn, list(states) if states is not None else None, queue, kind, limit, live, final,
            tenant, before,
        )  # fmt: skip
    return [msgspec.convert(r._asdict(), JobSummary) for r in rows]


async def cancel_jobs(
    db: Db, schema: str, ids: Iterable[int], *, user: str | None = None
) -> JobsAction:
    """Cancel jobs: a pending one (scheduled, available, retryable) is moved to history
    as cancelled at once; a running one gets cancel_requested and its member is told
    (NOTIFY <schema>.job_cancel) to set the handler's ctx.cancelled; a finished one is
    left alone. All-or-nothing: an unknown id raises UnknownJobs, nothing changes."""
    wanted = _unique(ids)
    q = for_schema(schema)
    async with _connection(db) as conn, conn.transaction():
        await _require_admin(conn, q, schema, "jobs.cancel")
        live, final = await _states(conn, q, wanted)
        pending = [i for i, s in live.items() if s != "running"]
        running = [i for i, s in live.items() if s == "running"]
        done = await q.admin_jobs_cancel(conn, pending, running)
        cancelled, flagged = set(done.cancelled), set(done.flagged)
        outcomes = []
        for i in wanted:
            outcome: CancelOutcome = "already_final"
            if i in cancelled:
                outcome = "cancelled"
            elif i in flagged:
                outcome = "cancel_requested"
            outcomes.append(JobActed(id=i, outcome=outcome, state=live.get(i) or final[i]))
        audit_id = await _audit(
            conn, q, user, "jobs.cancel", job_ids=wanted,
            detail={"outcomes": {str(o.id): o.outcome for o in outcomes}},
            arguments={"ids": wanted},
        )  # fmt: skip
    return JobsAction(action="jobs.cancel", jobs=outcomes, audit_id=audit_id)


async def retry_jobs(
    db: Db, schema: str, ids: Iterable[int], *, user: str | None = None
) -> JobsAction:
    """Run jobs again now: a finished one (dead, cancelled, completed) goes back to the
    hot table under its id as available, its final record deleted in the same statement
    (attempts kept; max_attempts raised to attempt + 1 if spent); a scheduled or
    retryable one becomes available now; available and running ones are left alone.
    All-or-nothing: an unknown id raises UnknownJobs, a unique_key held by a live job
    raises RetryBlocked, and nothing changes."""
    wanted = _unique(ids)
    q = for_schema(schema)
    async with _connection(db) as conn, conn.transaction():
        await _require_admin(conn, q, schema, "jobs.retry")
        live, final = await _states(conn, q, wanted)
        waiting = [i for i, s in live.items() if s in ("scheduled", "retryable")]
        made: set[int] = set()
        if waiting:
            made = set((await q.admin_jobs_make_available(conn, waiting)).ids)
        revived: set[int] = set()
        if final:
            revive = await q.admin_jobs_revive(conn, list(final))
            if revive.blocked:
                raise RetryBlocked(revive.blocked)
            revived = set(revive.ids)
        outcomes = []
        for i in wanted:
            outcome: RetryOutcome
            if i in revived:
                outcome = "retried"
            elif i in made:
                outcome = "made_available"
            elif live.get(i) in ("running", "blocked"):
                outcome = live[i]  # type: ignore[assignment]  # a RetryOutcome too
            else:  # available, or revived by someone else meanwhile
                outcome = "already_available"
            outcomes.append(JobActed(id=i, outcome=outcome, state=live.get(i) or final[i]))
        audit_id = await _audit(
            conn, q, user, "jobs.retry", job_ids=wanted,
            detail={"outcomes": {str(o.id): o.outcome for o in outcomes}},
            arguments={"ids": wanted},
        )  # fmt: skip
    return JobsAction(action="jobs.retry", jobs=outcomes, audit_id=audit_id)


# -- queues ------------------------------------------------------------------------------


async def set_paused(
    db: Db, schema: str, queue: str, paused: bool, *, user: str | None = None
) -> QueueAction:
    """Pause or resume `queue` fleet-wide (no member claims from a paused queue; jobs
    already running finish). Members are told on <schema>.queue_control."""
    problem = queue_name_problem(queue)
    if problem:
        raise InvalidInput(problem)
    action = "queues.pause" if paused else "queues.resume"
    q = for_schema(schema)
    async with _connection(db) as conn, conn.transaction():
        await _require_admin(conn, q, schema, action)
        row = await q.admin_queue_set_paused(conn, queue, paused, user)
        changed = row.was_paused != row.paused
        audit_id = await _audit(
            conn, q, user, action, target=queue, detail={"changed": changed},
            arguments={"queue": queue, "paused": paused},
        )  # fmt: skip
    return QueueAction(
        action=action, queue=queue, paused=row.paused, changed=changed, audit_id=audit_id
    )


# -- dead letters ------------------------------------------------------------------------


async def list_dead(
    db: Db,
    schema: str,
    *,
    kind: str | None = None,
    queue: str | None = None,
    since: datetime | timedelta | None = None,
    limit: int = DEFAULT_LIMIT,
    fingerprint: str | None = None,
) -> list[DeadJob]:
    """Dead jobs, most recently dead first; `since` is a time, or a duration before now."""
    if limit < 1:
        raise InvalidInput(f"limit must be at least 1, got {limit}")
    q = for_schema(schema)
    async with _connection(db) as conn:
        start = await _since(conn, since)
        rows = await q.admin_dlq_list(conn, kind, queue, start, limit, fingerprint)
    return [_with_args(r._asdict(), DeadJob) for r in rows]


async def redacted_fields(db: Db, schema: str, kind: str) -> list[str]:
    """The args fields kind's handler declared redact=[...] (as its members recorded
    them): what to mask before showing a job's args (redact.redact_args)."""
    q = for_schema(schema)
    async with _connection(db) as conn:
        row = await q.admin_kind_redact(conn, kind)
    return list(row.redact or []) if row is not None else []


async def group_dead(
    db: Db,
    schema: str,
    *,
    kind: str | None = None,
    queue: str | None = None,
    since: datetime | timedelta | None = None,
) -> list[DeadGroup]:
    """Every matching dead job counted by its error's fingerprint, largest group first."""
    q = for_schema(schema)
    async with _connection(db) as conn:
        start = await _since(conn, since)
        rows = await q.admin_dlq_groups(conn, kind, queue, start)
    return [
        DeadGroup(fingerprint=r.fingerprint, reason=r.reason, count=r.jobs, kinds=r.kinds,
                  last_dead_at=r.last_dead_at, last_error=r.last_error)
        for r in rows
    ]  # fmt: skip


async def redrive(
    db: Db,
    schema: str,
    *,
    kind: str | None = None,
    queue: str | None = None,
    since: datetime | timedelta | None = None,
    user: str | None = None,
    fingerprint: str | None = None,
) -> Redrive:
    """Retry every matching dead job (as `retry_jobs` does a dead one), in one statement.
    Jobs whose unique_key a live job holds stay dead and are listed in `blocked`."""
    q = for_schema(schema)
    async with _connection(db) as conn, conn.transaction():
        await _require_admin(conn, q, schema, "dlq.redrive")
        start = await _since(conn, since)
        dead = await q.admin_dlq_ids(conn, kind, queue, start, fingerprint)
        filters = {"kind": kind, "queue": queue, "since": start.isoformat() if start else None,
                   "fingerprint": fingerprint}  # fmt: skip
        arguments = {"kind": kind, "queue": queue, "since": _shown_since(since),
                     "fingerprint": fingerprint}  # fmt: skip
        return await _redrive_ids(
            conn, q, dead, user, target=queue, detail={"filters": filters}, arguments=arguments
        )


async def redrive_group(
    db: Db, schema: str, key: str, *, within: timedelta, user: str | None = None
) -> Redrive:
    """Retry the dead jobs of one error group (the web console's dead-jobs page: the
    SQL function dead_group_key) that died within `within`, as `redrive` does."""
    q = for_schema(schema)
    async with _connection(db) as conn, conn.transaction():
        await _require_admin(conn, q, schema, "dlq.redrive")
        dead = await q.admin_dlq_group_ids(conn, key, within)
        detail = {"group": key, "within_s": within.total_seconds()}
        arguments = {"group": key, "within": within.total_seconds()}
        return await _redrive_ids(
            conn, q, dead, user, target=None, detail=detail, arguments=arguments
        )


async def _redrive_ids(
    conn: asyncpg.Connection,
    q: Queries,
    dead: list[int],
    user: str | None,
    *,
    target: str | None,
    detail: dict[str, Any],
    arguments: dict[str, Any],
) -> Redrive:
    ids: list[int] = []
    blocked: list[int] = []
    if dead:
        revive = await q.admin_jobs_revive(conn, dead)
        ids, blocked = revive.ids, revive.blocked
    audit_id = await _audit(
        conn, q, user, "dlq.redrive", target=target, job_ids=ids,
        detail={**detail, "blocked": blocked}, arguments=arguments,
    )  # fmt: skip
    return Redrive(action="dlq.redrive", ids=ids, blocked=blocked, audit_id=audit_id)


def _shown_since(since: datetime | timedelta | None) -> str | float | None:
    """A since/before argument for the audit: a time as ISO text, a duration in s."""
    if isinstance(since, timedelta):
        return since.total_seconds()
    return since.isoformat() if since is not None else None


async def _since(conn: asyncpg.Connection, since: datetime | timedelta | None) -> datetime | None:
    if isinstance(since, timedelta):
        now: datetime = await conn.fetchval("SELECT now()")
        return now - since
    return since


# -- cron --------------------------------------------------------------------------------


async def list_cron(db: Db, schema: str) -> list[CronListed]:
    """Every schedule with its next run after the database's now (None when disabled or
    when it never fires again)."""
    q = for_schema(schema)
    async with _connection(db) as conn:
        rows = await q.admin_cron_list(conn)
    entries = []
    for r in rows:
        if r.name is None:
            continue
        next_run: datetime | None = None
        error: str | None = None
        try:
            zone = cron_schedule.check(r.schedule, r.timezone)
            if r.enabled:
                next_run = cron_schedule.next_slot_remembered(r.schedule, zone, r.now)
        except cron_schedule.ScheduleError as e:
            error = str(e)
        record = {**r._asdict(), "next_run": next_run, "error": error}
        entries.append(_with_args(record, CronListed))
    return entries


async def trigger_cron(db: Db, schema: str, name: str, *, user: str | None = None) -> CronTriggered:
    """Enqueue one job of schedule `name` now (roles.cron.trigger); UnknownSchedule if
    there is none."""
    q = for_schema(schema)
    async with _connection(db) as conn, conn.transaction():
        await _require_admin(conn, q, schema, "cron.trigger")
        job_id = await cron_role.trigger(conn, q, name)
        if job_id is None:
            raise UnknownSchedule(name)
        audit_id = await _audit(
            conn, q, user, "cron.trigger", target=name, job_ids=[job_id],
            arguments={"name": name},
        )  # fmt: skip
    return CronTriggered(action="cron.trigger", name=name, id=job_id, audit_id=audit_id)


# -- scrub -------------------------------------------------------------------------------


async def scrub(
    db: Db,
    schema: str,
    *,
    tenant: str | None = None,
    kind: str | None = None,
    before: datetime | timedelta | None = None,
    user: str | None = None,
) -> Scrubbed:
    """Overwrite the args, results and error texts of the final jobs of `tenant` and/or
    `kind` that finished before `before` (a time, or a duration before now; None: ever)
    with {"scrubbed": true}, in job_history and in their attempts, audited. Refuses
    (ScrubRefused, nothing changed) while live jobs match: those are not final yet."""
    if tenant is None and kind is None:
        raise InvalidInput("scrub needs a tenant or a kind (or both)")
    if tenant is not None and (problem := text_problem("tenant", tenant, MAX_TENANT_BYTES)):
        raise InvalidInput(f"scrub: {problem}")
    if kind is not None and (problem := kind_name_problem(kind)):
        raise InvalidInput(f"scrub: {problem}")
    q = for_schema(schema)
    async with _connection(db) as conn, conn.transaction():
        await _require_admin(conn, q, schema, "jobs.scrub")
        cutoff = await _since(conn, before)
        live = await q.admin_scrub_live(conn, tenant, kind, cutoff)
        if live:
            raise ScrubRefused(live)
        row = await q.admin_scrub(conn, tenant, kind, cutoff)
        ids, attempts = list(row.ids), int(row.attempts)
        audit_id = await _audit(
            conn, q, user, "jobs.scrub", job_ids=ids, detail={"attempts": attempts},
            arguments={"tenant": tenant, "kind": kind, "before": _shown_since(before),
                       "cutoff": cutoff.isoformat() if cutoff else None},
        )  # fmt: skip
    return Scrubbed(action="jobs.scrub", ids=ids, attempts=attempts, audit_id=audit_id)
