"""Enqueueing from Python applications, and reading jobs back.

Every enqueue is checked here first (cheap, no round trip), then written by the
database: single jobs and batches with unique keys through the schema's SQL
``enqueue_many`` function (the same code path SQL callers use), plain batches by COPY
straight into the job table, with the options the SQL functions' own defaults
(``job_defaults``) give them, resolved in one round trip before: measured faster
(bench/enqueue.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import typing
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Literal, NamedTuple, Self, TypedDict, TypeVar, Unpack, overload

import anyio.from_thread
import asyncpg
import msgspec

from pgjobd import admin, db, errors, migrate, tracing
from pgjobd.config import MAX_ARGS_BYTES, Pooler
from pgjobd.duration import to_timedelta
from pgjobd.errors import DuplicateJob, EnqueueError, QueueFull
from pgjobd.handler_api import (
    VERSION_KEY,
    ArgsError,
    DurationLike,
    HandlerSpec,
    JobContext,
    NewerArgs,
    handler_spec,
    upgraded,
    validate_args,
)
from pgjobd.handler_loader import Registry
from pgjobd.names import (
    MAX_TENANT_BYTES,
    kind_name_problem,
    queue_name_problem,
    schema_name_problem,
    shown,
    text_problem,
)
from pgjobd.queries import Queries, for_schema
from pgjobd.statements.job import CopyRow, CopySet, EnqueueRow

# The limits of what a job may hold, as the SQL functions and the job table check them
# (migrations 0002 and 0005): what every member, role and admin command can read back.
MAX_ARGS_DEPTH = 100  # no value at nesting level 100 (the args object is level 0)
MAX_UNIQUE_KEY_BYTES = 512
MAX_GROUP_KEY_BYTES = 512
MAX_KIND_CHARS = 128
MAX_MAX_ATTEMPTS = 2**31 - 1
EARLIEST_RUN_AT = datetime(1970, 1, 1, tzinfo=UTC)
RUN_AT_BEFORE = datetime(9999, 1, 1, tzinfo=UTC)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
OnConflict = Literal["return", "raise", "replace"]
T = TypeVar("T")
# Client.connect's session limits: the defaults of database.statement_timeout and
# database.idle_in_transaction_session_timeout.
DEFAULT_STATEMENT_TIMEOUT = "30s"
DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT = "60s"
# Every job that ends is announced here (payload: comma-separated ids); see wait().
_FINAL_CHANNEL = "{schema}.job_final"
_json_encoder = msgspec.json.Encoder()
# A "\u0000" escape in JSON text: preceded by an even number of backslashes (an odd
# number means the backslash itself is escaped and "u0000" is plain text).
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


A = TypeVar("A")


class EnqueueOptions(TypedDict, total=False):
    """The keyword options of `Client.enqueue` (for its typed overloads)."""

    queue: str | None
    priority: int | None
    delay: DurationLike | None
    run_at: datetime | None
    tenant: str | None
    unique_key: str | None
    max_attempts: int | None
    on_conflict: OnConflict
    depends_on: Sequence[int] | None
    after: Sequence[int] | None
    ttl: DurationLike | None
    expires_at: datetime | None
    unique_for: DurationLike | None
    conn: asyncpg.Connection | None
    group: str | None


class JobSpec(msgspec.Struct, frozen=True):
    """One job for `Client.enqueue_many`; None options fall back to the call's options."""

    kind: str
    args: Any = msgspec.field(default_factory=dict)
    queue: str | None = None
    priority: int | None = None
    delay: DurationLike | None = None
    run_at: datetime | None = None
    tenant: str | None = None
    unique_key: str | None = None
    max_attempts: int | None = None
    group: str | None = None
    depends_on: Sequence[int] | None = None
    after: Sequence[int] | None = None
    ttl: DurationLike | None = None
    expires_at: datetime | None = None
    unique_for: DurationLike | None = None


class Batch(msgspec.Struct, frozen=True):
    """What `Client.enqueue_batch` wrote: the jobs' ids in input order, and the callback's."""

    ids: list[int]
    callback_id: int


class JobError(msgspec.Struct, frozen=True):
    attempt: int
    error: str
    at: datetime


class JobInfo(msgspec.Struct, frozen=True):
    """A job as `pgjobd jobs show --json` shows it; `state` is a plain string."""

    id: int
    kind: str
    queue: str
    state: str
    attempt: int
    max_attempts: int
    args: dict[str, Any]
    result: Any
    reason: str | None
    errors: list[JobError]
    priority: int
    tenant: str | None
    unique_key: str | None
    run_at: datetime
    enqueued_at: datetime
    finished_at: datetime | None
    last_error: str | None
    depends_on: list[int] = []
    after: list[int] = []
    dependants: list[int] = []
    expires_at: datetime | None = None


class _Options(NamedTuple):
    """A job's options that passed the client-side checks (None: not given). The
    (kind, args) items of one enqueue_many call share one."""

    queue: str | None
    priority: int | None
    delay: timedelta | None
    run_at: datetime | None
    tenant: str | None
    unique_key: str | None
    max_attempts: int | None
    group: str | None
    depends_on: list[int] | None
    after: list[int] | None
    ttl: timedelta | None
    expires_at: datetime | None
    unique_for: timedelta | None

    @property
    def needs_function(self) -> bool:
        """Whether only the SQL function can enqueue it (the COPY path cannot)."""
        return (
            self.unique_key is not None or self.depends_on is not None
            or self.after is not None or self.unique_for is not None
        )  # fmt: skip


class _Checked(NamedTuple):
    """A job that passed the client-side checks, ready for the database."""

    kind: str
    args_json: str
    options: _Options


class Client:
    """Enqueues jobs into one pgjobd schema through an asyncpg pool.

    ``Client(pool)`` uses the application's pool; ``await Client.connect(dsn)`` makes
    and owns one (closed with the client). Give ``handlers`` (a `Registry`) to have args
    validated against the handlers' declared args types at enqueue time.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        schema: str = "pgjobd",
        handlers: Registry | None = None,
    ) -> None:
        problem = schema_name_problem(schema)
        if problem:
            raise ValueError(problem)
        self.pool = pool
        self.schema = schema
        self.handlers = handlers
        self._q: Queries = for_schema(schema)
        self._owns_pool = False
        self._schema_checked = False
        self._final = _FinalWatch(pool, _FINAL_CHANNEL.format(schema=schema))

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        schema: str = "pgjobd",
        handlers: Registry | None = None,
        min_size: int = 1,
        max_size: int = 10,
        tenant: str | None = None,
        statement_timeout: DurationLike = DEFAULT_STATEMENT_TIMEOUT,
        idle_in_transaction_timeout: DurationLike = DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT,
        pooler: Pooler = "none",
    ) -> Client:
        """A client with a pool of its own. Its sessions run with `statement_timeout` and
        `idle_in_transaction_timeout` (PostgreSQL's idle_in_transaction_session_timeout);
        with `tenant`, they set pgjobd.tenant: jobs enqueued without a tenant get this
        one, jobs of other tenants are refused, and under `migrate --rls` a producer or
        readonly login reads only this tenant's jobs.

        `pooler` says what `dsn` goes through ("none", or a PgBouncer-style pooler in
        "session" or "transaction" mode): through a transaction pooler no statement is
        cached as a prepared statement (another transaction's server connection would
        not know it), statement_timeout is enforced by the client, and `tenant` (a
        session setting such a pooler does not keep) is refused."""
        if tenant is not None and (problem := text_problem("tenant", tenant, MAX_TENANT_BYTES)):
            raise ValueError(problem)
        if tenant is not None and pooler == "transaction":
            raise ValueError(
                "tenant: pgjobd.tenant is a session setting, which a transaction pooler "
                "does not keep from one transaction to the next; connect directly or "
                "through a session-mode pool"
            )
        timeout = to_timedelta(statement_timeout)
        settings = db.session_settings(
            timeout, to_timedelta(idle_in_transaction_timeout), "pgjobd client", tenant
        )
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, reset=skip_session_reset,
            **db.settings_options(settings, pooler, timeout),
        )  # fmt: skip
        client = cls(pool, schema=schema, handlers=handlers)
        client._owns_pool = True
        try:
            await client.check_schema()
        except asyncpg.QueryCanceledError as e:
            await pool.close()
            raise ValueError(
                f"statement_timeout: PostgreSQL cancelled the client's first statement (its "
                f"schema check) under a limit of {settings['statement_timeout']} ms; a limit "
                "this short cancels ordinary statements"
            ) from e
        except BaseException:
            await pool.close()
            raise
        return client

    @property
    def queries(self) -> Queries:
        """The named statements, rendered for this client's schema."""
        return self._q

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        await self._final.close()
        if self._owns_pool:
            await self.pool.close()

    async def check_schema(self) -> None:
        """Refuse a schema that is missing, older or newer than this code (SchemaError)."""
        if not self._schema_checked:
            async with self.pool.acquire() as conn:
                await migrate.check_schema(conn, self.schema)
            self._schema_checked = True

    @overload
    async def enqueue(
        self, kind: Callable[[A, JobContext], Any], args: A, **options: Unpack[EnqueueOptions]
    ) -> int: ...

    @overload
    async def enqueue(
        self, kind: Callable[[A], Any], args: A, **options: Unpack[EnqueueOptions]
    ) -> int: ...

    @overload
    async def enqueue(
        self, kind: str, args: Any = None, **options: Unpack[EnqueueOptions]
    ) -> int: ...

    async def enqueue(
        self,
        kind: str | Callable[..., Any],
        args: Any = None,
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: DurationLike | None = None,
        run_at: datetime | None = None,
        tenant: str | None = None,
        unique_key: str | None = None,
        max_attempts: int | None = None,
        on_conflict: OnConflict = "return",
        depends_on: Sequence[int] | None = None,
        after: Sequence[int] | None = None,
        ttl: DurationLike | None = None,
        expires_at: datetime | None = None,
        unique_for: DurationLike | None = None,
        conn: asyncpg.Connection | None = None,
        group: str | None = None,
    ) -> int:
        """Enqueue one job and return its id.

        `kind` is a kind's name, or a handler (a function decorated with @job): then its
        kind, with args checked against its args type (statically by a type checker, at
        run time here) and its declared queue, priority and max_attempts as defaults.
        A live job with the same unique_key makes this return that job's id without
        writing anything (or raise DuplicateJob with ``on_conflict="raise"``; with
        ``"replace"``, it takes this job's args, run time and priority, or, when it is
        running, this job runs after it). With ``conn``, the job is written in that
        connection's current transaction. Jobs of one ``group`` (in one queue) run one at
        a time, in (priority, id) order. QueueFull when the queue holds its max_depth of
        live jobs. ``depends_on``: ids of jobs that must complete first; ``after``: ids
        of jobs that must end first, whatever their end. ``ttl`` / ``expires_at``: the
        job never starts after then (it ends dead, 'expired'). ``unique_for``: the
        unique_key also matches jobs completed that recently.
        """
        handler = _handler_of(kind, args, position=None)
        if handler is not None:
            kind = handler.kind
            queue = handler.queue if queue is None else queue
            priority = handler.priority if priority is None else priority
            max_attempts = handler.max_attempts if max_attempts is None else max_attempts
        spec = JobSpec(typing.cast(str, kind), {} if args is None else args, queue=queue,
                       priority=priority, delay=delay, run_at=run_at, tenant=tenant,
                       unique_key=unique_key, max_attempts=max_attempts, group=group,
                       depends_on=depends_on, after=after, ttl=ttl, expires_at=expires_at,
                       unique_for=unique_for)  # fmt: skip
        job = self._check(spec, position=None, handler=handler)
        o = job.options
        _check_on_conflict(on_conflict, o)
        await self.check_schema()
        with tracing.enqueue_span(job.kind, o.queue) as trace_context:
            trace_json = _trace_json(trace_context)
            job_id: int = await self._run(
                conn,
                lambda c: self._q.job_enqueue(
                    c, job.kind, job.args_json, o.queue, o.priority, o.run_at, o.tenant,
                    o.unique_key, o.max_attempts, o.delay, on_conflict, o.group,
                    o.depends_on, o.expires_at, o.ttl, o.unique_for, o.after, trace_json,
                ),
            )  # fmt: skip
        return job_id

    async def enqueue_many(
        self,
        jobs: Iterable[JobSpec | tuple[str | Callable[..., Any], Any]],
        *,
        queue: str | None = None,
        priority: int | None = None,
        delay: DurationLike | None = None,
        run_at: datetime | None = None,
        tenant: str | None = None,
        unique_key: str | None = None,
        max_attempts: int | None = None,
        on_conflict: OnConflict = "return",
        depends_on: Sequence[int] | None = None,
        after: Sequence[int] | None = None,
        ttl: DurationLike | None = None,
        expires_at: datetime | None = None,
        unique_for: DurationLike | None = None,
        conn: asyncpg.Connection | None = None,
        group: str | None = None,
    ) -> list[int]:
        """Enqueue many jobs in one transaction; returns their ids in input order.

        Items are ``(kind, args)`` tuples (the kind a name or a handler, whose args are
        then checked against its args type) or `JobSpec` values; the keyword options apply
        to items that leave them unset. Either every job is written or none is.
        """
        defaults: dict[str, Any] = {
            name: value
            for name, value in (
                ("queue", queue), ("priority", priority), ("delay", delay), ("run_at", run_at),
                ("tenant", tenant), ("unique_key", unique_key), ("max_attempts", max_attempts),
                ("group", group),
                ("depends_on", depends_on), ("after", after), ("ttl", ttl),
                ("expires_at", expires_at), ("unique_for", unique_for),
            )
            if value is not None
        }  # fmt: skip
        # (kind, args) items take every option from the call: check those once.
        shared = _checked_options(JobSpec("", **defaults), _rejecter(None))
        _check_on_conflict(on_conflict)
        shared_refused = on_conflict == "replace" and shared.unique_key is None
        needs_function = on_conflict != "return"
        checked: list[_Checked] = []
        valid_kinds: set[str] = set()
        for position, item in enumerate(jobs, start=1):
            if type(item) is tuple and len(item) == 2:
                kind, args = item
                handler = None if type(kind) is str else _handler_of(kind, args, position)
                name = typing.cast(str, kind) if handler is None else handler.kind
                if name not in valid_kinds:
                    if problem := _kind_problem(name):
                        raise EnqueueError(f"job {position}: {problem}")
                    valid_kinds.add(name)
                args_json = self._encode_args(name, {} if args is None else args, position,
                                              handler)  # fmt: skip
                if shared_refused:
                    _check_on_conflict(on_conflict, shared, position)
                checked.append(_Checked(name, args_json, shared))
            else:
                spec, handler = _as_spec(item, position)
                spec = _with_defaults(spec, defaults)
                job = self._check(spec, position, handler)
                _check_on_conflict(on_conflict, job.options, position)
                needs_function = needs_function or job.options.needs_function
                checked.append(job)
        if not checked:
            return []
        if shared.needs_function and any(job.options is shared for job in checked):
            needs_function = True
        await self.check_schema()
        kinds = {job.kind for job in checked}
        queues = {job.options.queue for job in checked}
        with tracing.enqueue_span(
            kinds.pop() if len(kinds) == 1 else "(many)",
            queues.pop() if len(queues) == 1 else None,
            len(checked),
        ) as trace_context:
            # One context for the batch: every job was enqueued in the same span.
            trace_json = _trace_json(trace_context)
            if needs_function:
                return await self._insert_through_function(checked, on_conflict, conn, trace_json)
            return await self._copy(checked, conn, trace_json)

    async def enqueue_batch(
        self,
        jobs: Iterable[JobSpec | tuple[str, Any]],
        callback: JobSpec | tuple[str, Any],
        *,
        conn: asyncpg.Connection | None = None,
        **options: Any,
    ) -> Batch:
        """Enqueue `jobs` and a `callback` job that runs once after every one of them has
        ended, whatever the end; its handler reads how many completed and failed in
        ``ctx.batch``. One transaction: all of it is written or nothing. ``options``
        are enqueue_many's, for the jobs (not the callback)."""
        spec, _ = _as_spec(callback, 0)
        if spec.after is not None or spec.depends_on is not None:
            raise EnqueueError("a batch's callback waits for the batch: give it no after "
                               "or depends_on of its own")  # fmt: skip
        if conn is None:
            async with self.pool.acquire() as own, own.transaction():
                return await self.enqueue_batch(jobs, callback, conn=own, **options)
        async with conn.transaction():
            ids = await self.enqueue_many(jobs, conn=conn, **options)
            if not ids:
                raise EnqueueError("a batch needs at least one job")
            fields = {f: getattr(spec, f) for f in spec.__struct_fields__ if f != "kind"}
            fields["args"] = {} if fields["args"] is None else fields["args"]
            callback_id = await self.enqueue(spec.kind, conn=conn, **{**fields, "after": ids})
        return Batch(ids=ids, callback_id=callback_id)

    async def job(self, job_id: int) -> JobInfo | None:
        """The job with this id, live or finished, or None if there is none."""
        if not _is_int(job_id):
            raise TypeError(f"job ids are integers, got {shown(job_id)}")
        if not _INT64_MIN <= job_id <= _INT64_MAX:
            return None  # no job has an id beyond a bigint
        await self.check_schema()
        async with self.pool.acquire() as conn:
            row = await self._q.job_get(conn, job_id)
            if row is None:
                return None
            attempts = await self._q.job_attempt_errors(conn, job_id)
            dependants = await self._q.job_dependants(conn, job_id)
        record: dict[str, Any] = row._asdict()
        record["dependants"] = [d.id for d in dependants]
        for column in ("args", "result"):
            if record[column] is not None:
                record[column] = admin.read_json(record[column])
        record["errors"] = [a._asdict() for a in attempts]
        return msgspec.convert(record, JobInfo)

    async def wait(self, job_id: int, timeout: float | None = None) -> JobInfo:  # noqa: ASYNC109 (contract §10 names it)
        """The job once it is final (completed, dead or cancelled); at once if it already
        is. Raises TimeoutError after `timeout` seconds, pgjobd.admin.UnknownJobs for an
        id that names no job (or a job whose queue keeps no final records).

        Waiting costs no polling: the client LISTENs, on one connection of its pool for
        all its waiters, to the announcement every finishing statement makes."""
        _check_job_id(job_id)
        await self.check_schema()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            async with self._final.watching(job_id) as ended:
                async with self.pool.acquire() as conn:
                    live = await self._q.job_live_ids(conn, [job_id])
                if live:
                    left = None if deadline is None else max(0.0, deadline - loop.time())
                    try:
                        await asyncio.wait_for(asyncio.shield(ended), left)
                    except ConnectionError:
                        continue  # the LISTEN session was lost: listen again, look again
            info = await self.job(job_id)
            if info is None:
                raise admin.UnknownJobs([job_id])
            if info.state in _FINAL_STATES:
                return info
            # Live again (retried by an admin) by the time it was read: wait again.

    async def cancel(self, job_id: int) -> str:
        """Cancel a job: a pending one is cancelled at once ("cancelled"); a running one
        is asked to stop ("cancel_requested": its handler's ctx.cancelled is set, and
        unless it completes it ends cancelled); a finished one is left ("already_final").
        Audited; raises pgjobd.admin.UnknownJobs for an unknown id."""
        _check_job_id(job_id)
        await self.check_schema()
        done = await admin.cancel_jobs(self.pool, self.schema, [job_id], user=admin.os_user())
        return done.jobs[0].outcome

    async def retry(self, job_id: int) -> str:
        """Run a job again now: a finished one (dead, cancelled, completed) goes back
        under its id ("retried"), a scheduled or retryable one is made available now
        ("made_available"); "already_available" and "running" change nothing. Audited;
        raises pgjobd.admin.UnknownJobs for an unknown id, RetryBlocked when a live job
        holds its unique_key."""
        _check_job_id(job_id)
        await self.check_schema()
        done = await admin.retry_jobs(self.pool, self.schema, [job_id], user=admin.os_user())
        return done.jobs[0].outcome

    # -- checks ---------------------------------------------------------------------

    def _check(
        self, spec: JobSpec, position: int | None, handler: HandlerSpec | None = None
    ) -> _Checked:
        reject = _rejecter(position)
        if problem := _kind_problem(spec.kind):
            raise reject(problem)
        args_json = self._encode_args(spec.kind, spec.args, position, handler)
        return _Checked(spec.kind, args_json, _checked_options(spec, reject))

    def _encode_args(
        self, kind: str, args: Any, position: int | None, handler: HandlerSpec | None = None
    ) -> str:
        """The args as compact JSON text, checked (and against the handler's type)."""
        try:
            encoded = _json_encoder.encode(args)
        except (TypeError, ValueError) as e:
            raise _rejecter(position)(f"args are not JSON-encodable: {e}") from None
        except RecursionError:
            raise _rejecter(position)(_TOO_DEEP) from None
        if not encoded.startswith(b"{") or len(encoded) > MAX_ARGS_BYTES:
            reject = _rejecter(position)
            if not encoded.startswith(b"{"):
                kind_of = type(args).__name__
                raise reject(f"args must be a JSON object, not {kind_of} ({encoded[:40]!r})")
            raise reject(
                f"args JSON text is {len(encoded)} bytes, over the {MAX_ARGS_BYTES}-byte limit"
            )
        if b"\\u0000" in encoded and _NUL_ESCAPE.search(encoded):
            raise _rejecter(position)(
                "args contain a NUL character (\\u0000), which PostgreSQL cannot store"
            )
        if _too_deep(encoded):
            raise _rejecter(position)(_TOO_DEEP)
        if handler is None and self.handlers is not None:
            handler = self.handlers.get(kind)
            if handler is None:
                known = ", ".join(self.handlers.kinds()) or "none"
                raise _rejecter(position)(f"unknown kind {kind!r}: the handlers given know {known}")
        if handler is not None:
            reject = _rejecter(position)
            decoded = msgspec.json.decode(encoded)
            if handler.args_version > 1 and VERSION_KEY not in decoded:
                # Stamped: the worker then knows which version these args are.
                decoded[VERSION_KEY] = handler.args_version
                encoded = _json_encoder.encode(decoded)
            try:
                validate_args(handler, upgraded(handler, dict(decoded)))
            except ArgsError as e:
                raise reject(str(e)) from None
            except NewerArgs as e:
                raise reject(f"{e} (the handlers given are older)") from None
        return encoded.decode()

    # -- writing --------------------------------------------------------------------

    async def _insert_through_function(
        self,
        jobs: Sequence[_Checked],
        on_conflict: OnConflict,
        conn: asyncpg.Connection | None,
        trace_json: str | None,
    ) -> list[int]:
        rows = [
            EnqueueRow(kind, args_json, o.queue, o.priority, o.run_at, o.delay, o.tenant,
                       o.unique_key, o.max_attempts, o.group, _id_list(o.depends_on),
                       o.expires_at, o.ttl, o.unique_for, _id_list(o.after), trace_json)
            for kind, args_json, o in jobs
        ]  # fmt: skip
        return await self._run(conn, lambda c: self._q.job_enqueue_many(c, rows, on_conflict))

    async def _copy(
        self, jobs: Sequence[_Checked], conn: asyncpg.Connection | None, trace_json: str | None
    ) -> list[int]:
        if conn is not None:
            async with conn.transaction():
                return await self._copy_in_transaction(conn, jobs, trace_json)
        async with self.pool.acquire() as own, own.transaction():
            return await self._copy_in_transaction(own, jobs, trace_json)

    async def _copy_in_transaction(
        self, conn: asyncpg.Connection, jobs: Sequence[_Checked], trace_json: str | None
    ) -> list[int]:
        """COPY the jobs straight into the job table, with the options the SQL functions'
        own defaults (job_defaults) give them: resolved for each distinct set of given
        options in one round trip before (job_copy_prepare), which also admits the batch,
        wakes the queues and draws the ids."""
        sets: dict[tuple[Any, ...], int] = {}  # a set of options: its position
        set_of: list[int] = []  # each job's
        last_kind, last_options, index = None, None, -1
        for kind, _, o in jobs:
            if kind is not last_kind or o is not last_options:  # (the same objects, often)
                last_kind, last_options = kind, o
                key = (kind, o.queue, o.priority, o.run_at, o.delay, o.max_attempts, o.ttl,
                       o.expires_at, o.tenant, o.group)  # fmt: skip
                index = sets.setdefault(key, len(sets))
            set_of.append(index)
        counts = Counter(set_of)
        given = [CopySet._make((*key[:8], counts[i], key[9] is not None))
                 for key, i in sets.items()]  # fmt: skip
        try:
            prepared = await self._q.job_copy_prepare(conn, given, len(jobs))
            # Each set's columns after (id, kind, args), in CopyRow's order.
            tails = [
                (key[8], key[9], trace_json, *resolved)
                for key, resolved in zip(sets, zip(prepared.states, prepared.queues,
                                                   prepared.priorities, prepared.run_ats,
                                                   prepared.max_attempts, prepared.expires_ats,
                                                   strict=True), strict=True)
            ]  # fmt: skip
            records = [
                (job_id, kind, args_json, *tails[i])
                for job_id, (kind, args_json, _), i in zip(prepared.ids, jobs, set_of, strict=True)
            ]  # fmt: skip
            if prepared.row_security:
                await self._q.job_copy_insert(conn, [CopyRow._make(r) for r in records])
            else:
                await conn.copy_records_to_table(
                    "job", schema_name=self.schema, columns=CopyRow._fields, records=records
                )
        except asyncpg.CheckViolationError as e:
            raise EnqueueError(f"the database rejected a job: {e}") from None
        except asyncpg.PostgresError as e:
            raise _translated(e) from None
        return prepared.ids

    async def _run(
        self, conn: asyncpg.Connection | None, run: Callable[[asyncpg.Connection], Awaitable[T]]
    ) -> T:
        """`run` on `conn`, or on a connection of the pool; SQL errors as EnqueueErrors."""
        try:
            if conn is not None:
                return await run(conn)
            async with self.pool.acquire() as own:
                return await run(own)
        except asyncpg.PostgresError as e:
            raise _translated(e) from None


class SyncClient:
    """`Client` for code without an event loop; runs one in a background thread."""

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "pgjobd",
        handlers: Registry | None = None,
        tenant: str | None = None,
        pooler: Pooler = "none",
    ) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._client: Client = self._portal.call(
                lambda: Client.connect(
                    dsn, schema=schema, handlers=handlers, tenant=tenant, pooler=pooler
                )
            )
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    def enqueue(self, kind: str | Callable[..., Any], args: Any = None, **options: Any) -> int:
        result: int = self._portal.call(lambda: self._client.enqueue(kind, args, **options))
        return result

    def enqueue_many(
        self, jobs: Iterable[JobSpec | tuple[str | Callable[..., Any], Any]], **options: Any
    ) -> list[int]:
        items = list(jobs)
        result: list[int] = self._portal.call(lambda: self._client.enqueue_many(items, **options))
        return result

    def job(self, job_id: int) -> JobInfo | None:
        result: JobInfo | None = self._portal.call(self._client.job, job_id)
        return result

    def wait(self, job_id: int, timeout: float | None = None) -> JobInfo:
        result: JobInfo = self._portal.call(self._client.wait, job_id, timeout)
        return result

    def enqueue_batch(
        self, jobs: Iterable[JobSpec | tuple[str, Any]], callback: JobSpec | tuple[str, Any],
        **options: Any,
    ) -> Batch:  # fmt: skip
        items = list(jobs)
        result: Batch = self._portal.call(
            lambda: self._client.enqueue_batch(items, callback, **options)
        )
        return result

    def cancel(self, job_id: int) -> str:
        result: str = self._portal.call(self._client.cancel, job_id)
        return result

    def retry(self, job_id: int) -> str:
        result: str = self._portal.call(self._client.retry, job_id)
        return result

    def close(self) -> None:
        try:
            self._portal.call(self._client.close)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def skip_session_reset(conn: asyncpg.Connection) -> None:
    """A `reset` for ``asyncpg.create_pool`` that skips the reset query on release.

    asyncpg's default runs UNLISTEN, RESET ALL and unlocks advisory locks each time a
    connection goes back to the pool: a round trip per enqueue. The client's own pool
    never leaves such session state behind, so it skips it; an application pool that
    doesn't either may do the same. An open transaction is still rolled back.
    """


def _translated(error: asyncpg.PostgresError) -> Exception:
    """The Python error for an error raised by pgjobd's SQL functions."""
    message = str(error).removeprefix("pgjobd: ")
    if error.sqlstate == errors.SQLSTATE_DUPLICATE_JOB:
        detail = getattr(error, "detail", None) or "0"
        key = message.split("'")[1] if "'" in message else ""
        return DuplicateJob(key, int(detail))
    if error.sqlstate == errors.SQLSTATE_QUEUE_FULL:
        return QueueFull(message)
    if error.sqlstate in errors.ENQUEUE_SQLSTATES:
        return EnqueueError(message)
    return error  # type: ignore[no-any-return]  # asyncpg is untyped


def _check_on_conflict(
    on_conflict: str, options: _Options | None = None, position: int | None = None
) -> None:
    if on_conflict not in ("return", "raise", "replace"):
        raise EnqueueError(
            f"on_conflict must be 'return', 'raise' or 'replace', not {on_conflict!r}"
        )
    if on_conflict == "replace" and options is not None and options.unique_key is None:
        raise _rejecter(position)("on_conflict 'replace' needs a unique_key")


def _id_list(ids: list[int] | None) -> str | None:
    """Job ids as PostgreSQL array text ('{1,2}'): enqueue_many's arrays cannot be ragged."""
    return None if ids is None else "{" + ",".join(map(str, ids)) + "}"


def _job_ids(name: str, value: object, reject: Callable[[str], EnqueueError]) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise reject(f"{name} must be a list of job ids, got {shown(value)}")
    ids = list(value)
    for item in ids:
        if not _is_int(item) or not _INT64_MIN <= item <= _INT64_MAX:
            raise reject(f"{name} holds {shown(item)}, which is not a job id (an int)")
    return ids


def _positive_duration(
    name: str, value: DurationLike, reject: Callable[[str], EnqueueError]
) -> timedelta:
    try:
        duration = to_timedelta(value)
    except (TypeError, ValueError) as e:
        raise reject(f"invalid {name}: {e}") from None
    if duration <= timedelta(0):
        raise reject(f"{name} must be positive, got {value!r}")
    if duration > timedelta(days=365 * 1000):
        raise reject(f"{name} {value!r} is too long")
    return duration


def _handler_of(kind: object, args: object, position: int | None) -> HandlerSpec | None:
    """The handler spec when `kind` is a handler function (None for a kind's name), with
    `args` checked to be of its args type when that is a class (a Struct, a dataclass)."""
    if isinstance(kind, str):
        return None
    spec = handler_spec(kind)
    if spec is None:
        raise _rejecter(position)(
            f"kind must be a str or a function decorated with @job, got {shown(kind)}"
        )
    expected = spec.args_type
    if (
        isinstance(expected, type)
        and not typing.is_typeddict(expected)
        and not isinstance(args, (expected, Mapping))
    ):
        raise _rejecter(position)(
            f"args for {spec.kind!r} must be a {expected.__qualname__} (the args type of "
            f"{spec.name}) or a mapping, not {type(args).__qualname__}"
        )
    return spec


def _trace_json(trace_context: Mapping[str, str] | None) -> str | None:
    return None if trace_context is None else _json_encoder.encode(trace_context).decode()


def _as_spec(
    item: JobSpec | tuple[str | Callable[..., Any], Any], position: int
) -> tuple[JobSpec, HandlerSpec | None]:
    if isinstance(item, JobSpec):
        return item, None
    if isinstance(item, tuple) and len(item) == 2:
        kind, args = item
        handler = _handler_of(kind, args, position)
        name = handler.kind if handler is not None else typing.cast(str, kind)
        return JobSpec(name, {} if args is None else args), handler
    raise EnqueueError(f"job {position}: expected a JobSpec or a (kind, args) tuple, got {item!r}")


def _with_defaults(spec: JobSpec, defaults: Mapping[str, Any]) -> JobSpec:
    """The spec with the call's options filled in where it left them unset. An item's own
    delay or run_at also stands for the other: the call's run_at does not override a delay."""
    changes = {name: value for name, value in defaults.items() if getattr(spec, name) is None}
    if spec.run_at is not None or spec.delay is not None:
        changes.pop("delay", None)
        changes.pop("run_at", None)
    return msgspec.structs.replace(spec, **changes) if changes else spec


def _checked_options(spec: JobSpec, reject: Callable[[str], EnqueueError]) -> _Options:
    """The spec's options, checked (not its kind and args)."""
    if spec.queue is not None and (problem := _queue_problem(spec.queue)):
        raise reject(problem)
    if spec.priority is not None and not (
        _is_int(spec.priority) and -32768 <= spec.priority <= 32767
    ):
        raise reject(f"priority must be an int from -32768 to 32767, got {spec.priority!r}")
    if spec.max_attempts is not None and not (
        _is_int(spec.max_attempts) and 1 <= spec.max_attempts <= MAX_MAX_ATTEMPTS
    ):
        raise reject(
            f"max_attempts must be an int from 1 to {MAX_MAX_ATTEMPTS}, "
            f"got {shown(spec.max_attempts)}"
        )
    delay = None
    if spec.delay is not None:
        if spec.run_at is not None:
            raise reject("give delay or run_at, not both")
        try:
            delay = to_timedelta(spec.delay)
        except (TypeError, ValueError) as e:
            raise reject(f"invalid delay: {e}") from None
        if delay < timedelta(0):
            raise reject(f"delay must not be negative, got {spec.delay!r}")
        try:
            too_long = datetime.now(UTC) + delay >= RUN_AT_BEFORE
        except OverflowError:
            too_long = True
        if too_long:
            raise reject(_delay_too_long(spec.delay))
    if spec.run_at is not None:
        if not isinstance(spec.run_at, datetime) or spec.run_at.utcoffset() is None:
            raise reject(f"run_at must be a timezone-aware datetime, got {shown(spec.run_at)}")
        if not EARLIEST_RUN_AT <= spec.run_at < RUN_AT_BEFORE:
            raise reject(
                f"run_at {spec.run_at.isoformat()} is out of range: expected a time from "
                "1970-01-01 up to (not including) 9999-01-01 UTC"
            )
    if spec.unique_key is not None and (
        problem := text_problem("unique_key", spec.unique_key, MAX_UNIQUE_KEY_BYTES)
    ):
        raise reject(problem)
    if spec.tenant is not None and (
        problem := text_problem("tenant", spec.tenant, MAX_TENANT_BYTES)
    ):
        raise reject(problem)
    if spec.group is not None and (
        problem := text_problem("group", spec.group, MAX_GROUP_KEY_BYTES)
    ):
        raise reject(problem)
    depends_on = after = ttl = unique_for = None
    if spec.depends_on is not None:
        depends_on = _job_ids("depends_on", spec.depends_on, reject)
    if spec.after is not None:
        after = _job_ids("after", spec.after, reject)
    if spec.ttl is not None:
        if spec.expires_at is not None:
            raise reject("give ttl or expires_at, not both")
        ttl = _positive_duration("ttl", spec.ttl, reject)
    if spec.expires_at is not None and (
        not isinstance(spec.expires_at, datetime) or spec.expires_at.utcoffset() is None
    ):
        raise reject(f"expires_at must be a timezone-aware datetime, got {shown(spec.expires_at)}")
    if spec.unique_for is not None:
        if spec.unique_key is None:
            raise reject("unique_for needs a unique_key")
        unique_for = _positive_duration("unique_for", spec.unique_for, reject)
    return _Options(spec.queue, spec.priority, delay, spec.run_at, spec.tenant,
                    spec.unique_key, spec.max_attempts, spec.group, depends_on, after, ttl,
                    spec.expires_at, unique_for)  # fmt: skip


def _rejecter(position: int | None) -> Callable[[str], EnqueueError]:
    where = "" if position is None else f"job {position}: "
    return lambda message: EnqueueError(f"{where}{message}")


def _kind_problem(kind: object) -> str | None:
    if not isinstance(kind, str):
        return f"kind must be a str, got {shown(kind)}"
    if len(kind) > MAX_KIND_CHARS:  # not worth a place in kind_name_problem's cache
        return f"invalid job kind {shown(kind)}: over {MAX_KIND_CHARS} characters"
    return kind_name_problem(kind)


def _queue_problem(queue: object) -> str | None:
    if not isinstance(queue, str):
        return f"queue must be a str, got {shown(queue)}"
    if len(queue) > 64:
        return f"invalid queue name {shown(queue)}: over 64 characters"
    return queue_name_problem(queue)


_TOO_DEEP = f"args are nested more than {MAX_ARGS_DEPTH} levels deep"


def _too_deep(encoded: bytes) -> bool:
    """Does this JSON object hold a value at nesting level MAX_ARGS_DEPTH (the object
    itself is level 0)? The rule jsonb_path_exists(args, 'strict $.**{100}') applies."""
    # A value at level 100 takes at least 205 bytes ('{"":' and 99 '[]' pairs), and
    # 100 containers: most args are ruled out by their length, the rest at C speed.
    if len(encoded) < 2 * MAX_ARGS_DEPTH or (
        encoded.count(b"[") + encoded.count(b"{") < MAX_ARGS_DEPTH
    ):
        return False
    # Strings become one '"' each, then a key (a string before ':') goes: what is left
    # is brackets, separators and the scalar values' characters.
    tokens = _JSON_STRING.sub(b'"', encoded).replace(b'":', b":")
    depth = 0
    for byte in tokens:
        if byte in b"]}":
            depth -= 1
        elif byte not in b",: \t\r\n":
            if depth >= MAX_ARGS_DEPTH:
                return True
            if byte in b"[{":
                depth += 1
    return False


def _delay_too_long(delay: object) -> str:
    return f"delay {shown(delay)} is too long: the job would run on or after 9999-01-01"


def _check_job_id(job_id: object) -> None:
    if not _is_int(job_id):
        raise TypeError(f"job ids are integers, got {shown(job_id)}")
    if not _INT64_MIN <= job_id <= _INT64_MAX:  # type: ignore[operator]
        raise admin.UnknownJobs([job_id])  # type: ignore[list-item]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FINAL_STATES = frozenset({"completed", "dead", "cancelled"})


class _FinalWatch:
    """The waiters of one client, on one LISTEN connection taken from its pool while
    anyone waits: each announcement on <schema>.job_final wakes the waiters of its ids."""

    def __init__(self, pool: asyncpg.Pool, channel: str) -> None:
        self._pool = pool
        self._channel = channel
        self._conn: asyncpg.Connection | None = None
        self._waiters: dict[int, set[asyncio.Future[None]]] = {}
        self._users = 0
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def watching(self, job_id: int) -> AsyncIterator[asyncio.Future[None]]:
        """A future set when job_id's end is announced; the LISTEN is active on entry."""
        self._users += 1
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        try:
            async with self._lock:
                if self._conn is None:
                    conn = await self._pool.acquire()
                    try:
                        await conn.add_listener(self._channel, self._heard)
                        conn.add_termination_listener(self._lost)
                    except BaseException:
                        await self._pool.release(conn)
                        raise
                    self._conn = conn
            self._waiters.setdefault(job_id, set()).add(ended)
            yield ended
        finally:
            waiting = self._waiters.get(job_id)
            if waiting is not None:
                waiting.discard(ended)
                if not waiting:
                    del self._waiters[job_id]
            self._users -= 1
            if self._users == 0:
                await self.close()

    def _heard(self, conn: object, pid: int, channel: str, payload: str) -> None:
        for text in payload.split(","):
            with contextlib.suppress(ValueError):
                for ended in self._waiters.pop(int(text), ()):
                    if not ended.done():
                        ended.set_result(None)

    def _lost(self, conn: object) -> None:
        """The LISTEN session is gone: every waiter looks again (on a new one)."""
        self._conn = None
        for waiting in self._waiters.values():
            for ended in waiting:
                if not ended.done():
                    ended.set_exception(ConnectionError("the LISTEN session was lost"))
        self._waiters.clear()

    async def close(self) -> None:
        async with self._lock:
            if self._conn is None or self._users > 0:
                return
            conn, self._conn = self._conn, None
            with contextlib.suppress(Exception):
                conn.remove_termination_listener(self._lost)
                await conn.remove_listener(self._channel, self._heard)
            await self._pool.release(conn)
