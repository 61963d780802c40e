"""The testing kit: run handlers in a test, drain a test schema, assert what was enqueued.

- `await run_job(handler, args)` runs one attempt inline, with no database: the args
  take the path a job's args take (encoded to JSON, converted with the handler's args
  type), and the attempt runs through pgjobd.execution, the code a worker process runs.
  The outcome's state follows the database's rule (job_end_reason).
- `await drain(client, handlers)` runs every due job of the client's schema inline,
  claimed and recorded by the daemon's own statements (job_claim, the completer's
  job_complete_many and job_fail_many), until none is due.
- `assert_enqueued`, `assert_not_enqueued`, `all_enqueued` look at the live jobs.

The pytest plugin (pgjobd.testing.plugin, entry point `pgjobd`) provides the fixtures
`pgjobd_client` and `pgjobd_drain`; the helpers use its client unless given one.
Everything here runs on asyncio (as pytest's anyio plugin does by default).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from pgjobd.execution import execute, run_attempt
from pgjobd.handler_api import HandlerSpec, handler_spec
from pgjobd.handler_loader import Registry
from pgjobd.middleware import Middleware
from pgjobd.model import ClaimedJob, Verdict
from pgjobd.protocol import Done

if TYPE_CHECKING:
    import asyncpg

    from pgjobd.client import Client
    from pgjobd.completer import Completer
    from pgjobd.config import QueueConfig
    from pgjobd.statements.job import ClaimRow

__all__ = [
    "Enqueued",
    "RunOutcome",
    "all_enqueued",
    "assert_enqueued",
    "assert_not_enqueued",
    "declare_kinds",
    "drain",
    "run_job",
]

State = Literal["completed", "retryable", "snoozed", "dead", "cancelled"]

# When a job falls back to the built-in defaults (job_defaults, QueueConfig).
DEFAULT_MAX_ATTEMPTS = 20
DEFAULT_TIMEOUT_S = 300.0
# The member id the drain claims as (job.owner while a drained job runs).
DRAIN_MEMBER = "pgjobd.testing"
# A drain that runs this many attempts and still finds work due stops (a handler that
# always snoozes or retries, with fast_forward, would otherwise run forever).
DEFAULT_MAX_RUNS = 1000


class _Current:
    """The client of the running test, set by the plugin's pgjobd_client fixture (a
    plain attribute: async fixtures may run in another task than their test)."""

    client: Client | None = None


current = _Current()


class RunOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What became of one attempt.

    state: completed, retryable (it runs again), snoozed (it runs again, the attempt not
    counted), dead (reason says why), or cancelled. result: the handler's return value
    as stored (JSON-decoded). after: the delay of Retry(after=...) or Snooze(...); None
    for a failure, whose delay is the queue's backoff. error: "Class: message" of a
    failed, retried, snoozed or discarded attempt.
    """

    state: State
    kind: str
    attempt: int
    job_id: int = 0
    result: Any = None
    after: timedelta | None = None
    reason: str | None = None
    error: str | None = None
    error_class: str | None = None
    traceback: str | None = None
    verdict: Verdict = "completed"  # what became of the attempt, as the completer gets it


class Enqueued(msgspec.Struct, frozen=True, kw_only=True):
    """A live job, as the assertion helpers see it."""

    id: int
    kind: str
    queue: str
    state: str
    args: dict[str, Any]
    priority: int
    tenant: str | None
    unique_key: str | None
    run_at: datetime
    attempt: int
    max_attempts: int


# -- run_job -------------------------------------------------------------------------


async def run_job(
    handler: Callable[..., Any] | HandlerSpec,
    args: Any = None,
    *,
    attempt: int = 1,
    max_attempts: int | None = None,
    tenant: str | None = None,
    queue: str | None = None,
    middleware: Sequence[Middleware] = (),
) -> RunOutcome:
    """Run one attempt of `handler` (a function decorated with @job) on `args` inline.

    `args` is what an application would enqueue (a dict, or a value of the handler's
    args type): it is encoded to JSON and converted as a worker converts it, so args
    that would end a real job invalid_args end this one so too. `attempt` is the
    attempt's number (1 on the first run); `max_attempts` defaults to the handler's,
    else 20 (the database's default).
    """
    spec = handler if isinstance(handler, HandlerSpec) else handler_spec(handler)
    if spec is None:
        raise TypeError(f"run_job takes a function decorated with @job, not {handler!r}")
    if not (isinstance(attempt, int) and attempt >= 1):
        raise ValueError(f"attempt must be an int >= 1, not {attempt!r}")
    limit = max_attempts if max_attempts is not None else spec.max_attempts
    limit = DEFAULT_MAX_ATTEMPTS if limit is None else limit
    if not (isinstance(limit, int) and limit >= 1):
        raise ValueError(f"max_attempts must be an int >= 1, not {max_attempts!r}")
    now = datetime.now(UTC)
    job = ClaimedJob(
        id=0, fence=0, kind=spec.kind, queue=queue or spec.queue or "default",
        attempt=attempt, max_attempts=limit, crashes=0, priority=spec.priority or 0,
        tenant=tenant, enqueued_at=now, scheduled_at=now, args=_args_json(args),
    )  # fmt: skip
    timeout_s = spec.timeout_s or DEFAULT_TIMEOUT_S
    done = await run_attempt(spec, job, timeout_s, middleware=middleware)
    return _outcome(job, done, _end_reason(done.verdict, attempt, limit))


def _args_json(args: Any) -> bytes:
    try:
        encoded = msgspec.json.encode({} if args is None else args)
    except (TypeError, ValueError) as e:
        raise TypeError(f"args are not JSON-encodable: {e}") from None
    if not encoded.startswith(b"{"):
        raise TypeError(f"args must encode to a JSON object, not {type(args).__name__}")
    return encoded


def _end_reason(outcome: Verdict, attempt: int, max_attempts: int) -> str | None:
    """job_end_reason (migration 0006) for the outcomes an attempt can have in a test
    (no crash, no cancel request). tests/integration/test_testing_kit.py holds the two
    to agreeing."""
    if outcome in ("discarded", "invalid_args"):
        return outcome
    if outcome in ("completed", "snoozed", "given_back"):
        return None
    if attempt >= max_attempts:
        return "unknown_kind" if outcome == "unknown_kind" else "attempts_exhausted"
    return None


def _outcome(job: ClaimedJob, done: Done, reason: str | None) -> RunOutcome:
    state: State
    if reason == "cancelled":
        state = "cancelled"
    elif reason is not None:
        state = "dead"
    elif done.verdict == "completed":
        state = "completed"
    elif done.verdict == "snoozed":
        state = "snoozed"
    else:
        state = "retryable"
    after = None
    if done.verdict in ("retry", "snoozed") and done.after_s is not None:
        after = timedelta(seconds=done.after_s)
    error = ": ".join(p for p in (done.error_class, done.error_message) if p) or None
    return RunOutcome(
        state=state, kind=job.kind, attempt=job.attempt, job_id=job.id,
        result=None if done.result is None else msgspec.json.decode(done.result),
        after=after, reason=reason, error=error, error_class=done.error_class,
        traceback=done.traceback, verdict=done.verdict,
    )  # fmt: skip


# -- drain ---------------------------------------------------------------------------


async def declare_kinds(
    client: Client, handlers: Registry, queues: Mapping[str, QueueConfig] | None = None
) -> None:
    """Record the handlers' kinds with their defaults in the client's schema, as a member
    does when its workers start: enqueues that name only a kind then get its queue,
    priority and max_attempts."""
    from pgjobd import config as pgjobd_config  # noqa: PLC0415
    from pgjobd.member.generations import declare_kinds as declare  # noqa: PLC0415
    from pgjobd.worker import kind_info  # noqa: PLC0415

    queue_configs = dict(queues or {})
    queue_configs.setdefault(pgjobd_config.DEFAULT_QUEUE, pgjobd_config.QueueConfig())
    kinds = [kind_info(spec) for spec in handlers.values()]
    await declare(client.pool, client.queries, kinds, queue_configs, DRAIN_MEMBER)


async def drain(
    client: Client,
    handlers: Registry,
    *,
    queue: str | None = None,
    fast_forward: bool = False,
    queues: Mapping[str, QueueConfig] | None = None,
    middleware: Sequence[Middleware] = (),
    max_runs: int = DEFAULT_MAX_RUNS,
) -> list[RunOutcome]:
    """Run every due job of the client's schema (or of one queue) inline, one at a
    time in claim order, until none is due; return the outcomes in the order they ran.

    Jobs are claimed with the daemon's claim statement (a paused queue gives nothing)
    and their outcomes recorded by the daemon's completer, so states, attempts, errors
    and history land in the database as a member would write them. A job that fails
    waits for its backoff like any other; `fast_forward=True` makes every waiting job
    (retrying, delayed or snoozed) due at once, so retries run until they end.
    `queues` gives the queues' settings (backoff, history); default: the built-in ones.
    """
    import anyio  # noqa: PLC0415 (not for run_job, which needs no event loop library)

    from pgjobd import config as pgjobd_config  # noqa: PLC0415
    from pgjobd.completer import Completer  # noqa: PLC0415 (the daemon's, for drains only)

    queue_configs = dict(queues or {})
    queue_configs.setdefault(pgjobd_config.DEFAULT_QUEUE, pgjobd_config.QueueConfig())
    _, never_sent = anyio.create_memory_object_stream[Any](0)
    completer = Completer(client.pool, client.queries, DRAIN_MEMBER, queue_configs, never_sent)
    q = client.queries
    outcomes: list[RunOutcome] = []
    async with never_sent:
        while True:
            async with client.pool.acquire() as conn:
                if fast_forward:
                    await q.job_fast_forward(conn, queue)
                await q.job_promote_due(conn, 10_000)
                due = await q.job_due_queues(conn, queue)
            ran_before = len(outcomes)
            for name in due:
                outcomes += await _drain_queue(client, handlers, completer, name, middleware)
                if len(outcomes) > max_runs:
                    raise RuntimeError(
                        f"drain ran {len(outcomes)} attempts and jobs are still due "
                        "(a handler that always retries or snoozes?)"
                    )
            if len(outcomes) == ran_before:
                return outcomes


async def _drain_queue(
    client: Client,
    handlers: Registry,
    completer: Completer,
    queue: str,
    middleware: Sequence[Middleware],
) -> list[RunOutcome]:
    outcomes: list[RunOutcome] = []
    while True:
        async with client.pool.acquire() as conn:
            rows = await _claim_one(client, conn, queue)
        if not rows:
            return outcomes
        job = rows[0].claimed_job()
        spec = handlers.get(job.kind)
        timeout_s = (spec.timeout_s if spec else None) or _queue_timeout(completer, queue)
        done = await execute(
            handlers, job, timeout_s, where="the handlers given to the drain",
            middleware=middleware,
            results=_results_reader(client, job.depends_on + job.after),
        )  # fmt: skip
        await completer.flush([done.outcome(job)])
        info = await client.job(job.id)
        reason = info.reason if info is not None else None
        if info is not None and info.state == "cancelled":
            reason = "cancelled"
        outcomes.append(_outcome(job, done, reason))


async def _claim_one(client: Client, conn: asyncpg.Connection, queue: str) -> list[ClaimRow]:
    """One job of `queue` by the claim a member would use: job_claim_flow where the
    queue needs flow control (queue_flow_get, read afresh each time), else job_claim.
    A limit that holds every due job back gives nothing, which ends the queue's drain."""
    q = client.queries
    lease = timedelta(hours=1)
    if not await q.queue_flow_get(conn, queue):
        return await q.job_claim(conn, queue, 1, DRAIN_MEMBER, lease)
    rows = await q.job_claim_flow(conn, queue, 1, DRAIN_MEMBER, lease)
    return [row.claim_row() for row in rows if row.id is not None]


def _results_reader(
    client: Client, ids: tuple[int, ...]
) -> Callable[[], Awaitable[dict[int, Any]]]:
    """ctx.results() in a drain: the results of the jobs `ids`, read from the database."""

    async def read() -> dict[int, Any]:
        async with client.pool.acquire() as conn:
            text = await client.queries.job_results(conn, list(ids))
        decoded = msgspec.json.decode(text or "{}")
        return {int(k): v for k, v in decoded.items()}

    return read


def _queue_timeout(completer: Completer, queue: str) -> float:
    config = completer.queues.get(queue) or completer.queues["default"]
    return float(config.timeout.total_seconds())


# -- assertions ----------------------------------------------------------------------


async def all_enqueued(
    kind: str | Callable[..., Any] | None = None,
    *,
    args: Any = None,
    queue: str | None = None,
    tenant: str | None = None,
    client: Client | None = None,
) -> list[Enqueued]:
    """The live jobs (not yet final) that match, oldest first. `args` matches jobs whose
    args hold every key and value given (jsonb containment); a handler stands for its kind.
    """
    client = _client(client)
    args_json = None if args is None else _args_json(args).decode()
    async with client.pool.acquire() as conn:
        rows = await client.queries.job_list_live(conn, _kind(kind), queue, tenant, args_json)
    return [
        msgspec.convert({**row._asdict(), "args": msgspec.json.decode(row.args)}, Enqueued)
        for row in rows
    ]


async def assert_enqueued(
    kind: str | Callable[..., Any],
    *,
    args: Any = None,
    queue: str | None = None,
    tenant: str | None = None,
    count: int | None = None,
    client: Client | None = None,
) -> list[Enqueued]:
    """AssertionError unless a live job matches (exactly `count` of them, if given);
    returns the matching jobs."""
    found = await all_enqueued(kind, args=args, queue=queue, tenant=tenant, client=client)
    if (count is None and found) or (count is not None and len(found) == count):
        return found
    wanted = _described(kind, args, queue, tenant)
    live = await all_enqueued(client=client)
    seen = "\n".join(f"  {_shown(job)}" for job in live[:20]) or "  (none)"
    expected = "a job" if count is None else f"{count} job(s)"
    raise AssertionError(
        f"expected {expected} enqueued matching {wanted}, found {len(found)}; live jobs:\n{seen}"
    )


async def assert_not_enqueued(
    kind: str | Callable[..., Any],
    *,
    args: Any = None,
    queue: str | None = None,
    tenant: str | None = None,
    client: Client | None = None,
) -> None:
    """AssertionError if a live job matches."""
    found = await all_enqueued(kind, args=args, queue=queue, tenant=tenant, client=client)
    if found:
        wanted = _described(kind, args, queue, tenant)
        jobs = "\n".join(f"  {_shown(job)}" for job in found[:20])
        raise AssertionError(f"expected no job enqueued matching {wanted}, found:\n{jobs}")


def _client(client: Client | None) -> Client:
    client = client if client is not None else current.client
    if client is None:
        raise RuntimeError(
            "no client: pass client=..., or use the pgjobd_client fixture in this test"
        )
    return client


def _kind(kind: str | Callable[..., Any] | None) -> str | None:
    if kind is None or isinstance(kind, str):
        return kind
    spec = handler_spec(kind)
    if spec is None:
        raise TypeError(f"expected a kind or a function decorated with @job, not {kind!r}")
    return spec.kind


def _described(kind: Any, args: Any, queue: str | None, tenant: str | None) -> str:
    parts = [f"kind={_kind(kind)!r}"]
    if args is not None:
        parts.append(f"args⊇{msgspec.json.encode(args).decode()}")
    parts += [f"{name}={value!r}" for name, value in (("queue", queue), ("tenant", tenant))
              if value is not None]  # fmt: skip
    return ", ".join(parts)


def _shown(job: Enqueued) -> str:
    text = msgspec.json.encode(job.args).decode()
    text = text if len(text) <= 120 else text[:117] + "..."
    tenant = f" tenant={job.tenant!r}" if job.tenant else ""
    return f"#{job.id} {job.kind} queue={job.queue} {job.state}{tenant} args={text}"
