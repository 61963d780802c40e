"""job_claim's start in claim order (`after_*`) and the producer's cursor, on a real
PostgreSQL: a claim after a key takes only jobs after it, and a job that becomes
available behind a busy producer's cursor still starts within CURSOR_HEAD_S."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import anyio
import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd.completer import OwnEnds
from pgjobd.model import ClaimedJob
from pgjobd.producer import CURSOR_HEAD_S, MAX_POLL_S, Producer
from pgjobd.queries import for_schema
from pgjobd.statements.job import ClaimKey
from tests.captured_events import events
from tests.integration.test_plans import _plan
from tests.integration.test_producer_slots import producer_running

pytestmark = pytest.mark.anyio
LEASE = timedelta(minutes=1)


async def _enqueue(conn: asyncpg.Connection, schema: str, n: int, priority: int) -> list[int]:
    rows = await conn.fetch(
        f"SELECT e.id FROM {schema}.enqueue_many("
        "kinds => array_fill('k'::text, ARRAY[$1::integer]), "
        "args => array_fill('{}'::jsonb, ARRAY[$1::integer]), "
        "priorities => array_fill($2::integer, ARRAY[$1::integer])) AS e ORDER BY e.ord",
        n, priority,
    )  # fmt: skip
    return [row["id"] for row in rows]


async def test_a_claim_after_a_key_takes_only_the_jobs_after_it(
    conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    ids = await _enqueue(conn, schema, 6, priority=2)
    urgent = await _enqueue(conn, schema, 1, priority=0)
    first = await q.job_claim(conn, "default", 3, "m", LEASE)
    first = sorted(first, key=lambda r: (r.priority, r.scheduled_at, r.id))
    assert [r.id for r in first] == [*urgent, *ids[:2]]
    last = first[-1]
    behind = await _enqueue(conn, schema, 1, priority=1)  # before the key in claim order
    after = await q.job_claim(
        conn, "default", 10, "m", LEASE, last.priority, last.scheduled_at, last.id
    )
    assert sorted(r.id for r in after) == ids[2:]
    assert [r.id for r in await q.job_claim(conn, "default", 10, "m", LEASE)] == behind


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    priority=st.none() | st.sampled_from([-(2**15), -1, 0, 2, 3, 2**15 - 1, 2**15, -(2**31)]),
    run_at=st.none()
    | st.sampled_from([datetime.min.replace(tzinfo=UTC), datetime.max.replace(tzinfo=UTC)])
    | st.datetimes(timezones=st.just(UTC)),
    job_id=st.none() | st.sampled_from([-(2**63), 0, 1, 2**63 - 1]) | st.integers(1, 10),
)
async def test_a_claims_start_at_its_edges_takes_what_follows_it_or_is_refused(
    conn: asyncpg.Connection, schema: str,
    priority: int | None, run_at: datetime | None, job_id: int | None,
) -> None:  # fmt: skip
    """after_* at the edges of their types, and NULLs (each NULL is the head's value
    for its column: -32768, '-infinity', 0): the claim takes exactly the waiting jobs
    after the key, or a value out of the column's range is refused and nothing is
    claimed."""
    q = for_schema(schema)
    await conn.execute(f"TRUNCATE {schema}.job")
    await _enqueue(conn, schema, 5, priority=2)
    jobs = await conn.fetch(f"SELECT priority, run_at, id FROM {schema}.job")
    key = (
        -(2**15) if priority is None else priority,
        datetime.min.replace(tzinfo=UTC) if run_at is None else run_at,
        0 if job_id is None else job_id,
    )
    try:
        rows = await q.job_claim(conn, "default", 10, "m", LEASE, priority, run_at, job_id)
    except (asyncpg.DataError, OverflowError):
        assert priority is not None and not -(2**15) <= priority < 2**15
        rows = []
    else:
        expected = [j["id"] for j in jobs if tuple(j) > key]
        assert sorted(r.id for r in rows) == sorted(expected)
    running = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE state = 'running'")
    assert running == len(rows)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    jobs=st.lists(
        st.tuples(st.integers(-3, 3), st.integers(0, 3), st.sampled_from(["available", "running"])),
        max_size=8,
    ),
    key=st.tuples(
        st.integers(-(2**15), 2**15 - 1) | st.integers(-3, 3),
        st.integers(-1, 4),
        st.integers(0, 12),
    ),
)
async def test_a_look_behind_a_key_sees_exactly_the_available_jobs_at_or_before_it(
    conn: asyncpg.Connection, schema: str,
    jobs: list[tuple[int, int, str]], key: tuple[int, int, int],
) -> None:  # fmt: skip
    """job_available_behind against its definition: some job of the queue is available
    at or before the key in claim order (running jobs and other queues' do not
    count)."""
    q = for_schema(schema)
    await conn.execute(f"TRUNCATE {schema}.job")
    t0 = datetime(2026, 12, 6, tzinfo=UTC)
    for n, (priority, minutes, state) in enumerate(jobs, start=1):
        lease = ("m", n, t0) if state == "running" else (None, None, None)
        await conn.execute(
            f"INSERT INTO {schema}.job (id, state, queue, kind, args, priority, run_at, "
            "owner, fence, lease_expires_at) "
            f"VALUES ($1, $2::{schema}.job_state, 'default', 'k', '{{}}', $3, $4, $5, $6, $7)",
            n, state, priority, t0 + timedelta(minutes=minutes), *lease,
        )  # fmt: skip
        await conn.execute(  # (another queue's job before every key)
            f"INSERT INTO {schema}.job (id, state, queue, kind, args, priority, run_at) "
            "VALUES ($1, 'available', 'other', 'k', '{}', -32768, $2)",
            n + 100, t0 - timedelta(days=1),
        )  # fmt: skip
    at = ClaimKey(key[0], t0 + timedelta(minutes=key[1]), key[2])
    rows = await conn.fetch(f"SELECT priority, run_at, id, state FROM {schema}.job "
                            "WHERE queue = 'default'")  # fmt: skip
    expected = any(r["state"] == "available" and tuple(r)[:3] <= tuple(at) for r in rows)
    assert await q.job_available_behind(conn, "default", *at) == expected


@asynccontextmanager
async def past_one_job(
    dsn: str, conn: asyncpg.Connection, schema: str, workers: FreeingSlots | None = None
) -> AsyncIterator[tuple[Producer, FreeingSlots, int]]:
    """A running producer of a queue that held one job (priority 5), once it handed that
    job over: its cursor is that job's place."""
    (job_id,) = await _enqueue(conn, schema, 1, priority=5)
    workers = workers or FreeingSlots()
    async with producer_running(dsn, for_schema(schema), workers) as producer:
        with anyio.fail_after(10):
            while not workers.submitted:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        cursor = producer.cursor.after
        assert cursor is not None and cursor.id == job_id
        yield producer, workers, job_id


async def test_an_idle_producers_job_behind_its_cursor_starts_at_its_next_claim(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """A claim that comes back empty keeps the cursor and looks behind it at once: an
    urgent job enqueued behind an idle producer's cursor starts after the wake-up's
    claim, the look and one claim from the head, with no wait for CURSOR_HEAD_S."""
    async with past_one_job(dsn, conn, schema) as (producer, workers, _):
        claims = len(producer.claim_seconds)
        with anyio.fail_after(MAX_POLL_S * 3):
            while len(producer.claim_seconds) < claims + 2:  # noqa: ASYNC110 (idle: empty claims)
                await anyio.sleep(0.01)
        assert producer.claimed == 1
        (urgent,) = await _enqueue(conn, schema, 1, priority=0)
        producer.wakeup.set()  # (the NOTIFY's part: nothing listens here)
        woken_at = anyio.current_time()
        with anyio.fail_after(10):
            while urgent not in [j.id for j in workers.submitted]:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        waited = anyio.current_time() - woken_at
    assert waited < CURSOR_HEAD_S, waited


class FreeingSlots:
    """Four slots that free as soon as a job is handed over (a no-op handler)."""

    own_ends: OwnEnds | None = None

    def __init__(self) -> None:
        self.submitted: list[ClaimedJob] = []
        self._changed = anyio.Event()

    def slots(self) -> int:
        return 4

    def free_slots(self) -> int:
        return 4

    async def wait_changed(self) -> None:
        await self._changed.wait()

    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None:
        self.submitted += jobs
        self._changed.set()
        self._changed = anyio.Event()


class SlotsThatLockTheTable(FreeingSlots):
    """FreeingSlots whose next hand-over, once `lock_on` is set, ends with the job table
    locked (ACCESS EXCLUSIVE, in a transaction left open on that connection): the look
    behind the cursor that follows the hand-over waits for the lock."""

    def __init__(self) -> None:
        super().__init__()
        self.lock_on: tuple[asyncpg.Connection, str] | None = None
        self.locked = anyio.Event()

    async def submit_many(self, jobs: Sequence[ClaimedJob]) -> None:
        await super().submit_many(jobs)
        if self.lock_on is not None:
            holder, schema = self.lock_on
            self.lock_on = None
            await holder.execute(f"BEGIN; LOCK TABLE {schema}.job IN ACCESS EXCLUSIVE MODE")
            self.locked.set()


async def test_a_look_whose_connection_is_lost_is_asked_again_by_the_next_claim(
    dsn: str, conn: asyncpg.Connection, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The look's session ends under it (its backend terminated while the look waits for
    a lock): the producer logs producer.look_behind_failed and goes on, the next claim
    asks for a look again, and a job behind the cursor still starts."""
    caplog.set_level(logging.WARNING, logger="pgjobd.producer")
    workers = SlotsThatLockTheTable()
    async with past_one_job(dsn, conn, schema, workers) as (producer, _, _):
        holder = await asyncpg.connect(dsn)
        try:  # (closed before the producer stops: a claim waiting for the lock is shielded)
            workers.lock_on = (holder, schema)  # at the next (empty) claim's hand-over
            with anyio.fail_after(MAX_POLL_S + 5):
                await workers.locked.wait()
                look = None
                while look is None:  # of the sessions the lock holds up (a claim too), the look
                    look = await conn.fetchval(
                        "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) "
                        "AND left(query, 200) = left($2, 200)",
                        holder.get_server_pid(), for_schema(schema).sql("job_available_behind"),
                    )  # fmt: skip
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", look)
        finally:
            await holder.close()
        with anyio.fail_after(10):
            while "producer.look_behind_failed" not in events(caplog):  # noqa: ASYNC110
                await anyio.sleep(0.01)
        (urgent,) = await _enqueue(conn, schema, 1, priority=0)  # behind the cursor
        producer.wakeup.set()
        with anyio.fail_after(MAX_POLL_S + 5):
            while urgent not in [j.id for j in workers.submitted]:  # noqa: ASYNC110
                await anyio.sleep(0.001)


async def test_a_job_behind_a_busy_producers_cursor_starts_within_its_head_interval(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """A producer with a backlog claims after its cursor; an urgent job enqueued behind
    it (a higher priority) is not seen by those claims but starts at the next claim
    from the head, within CURSOR_HEAD_S, long before the backlog runs out."""
    q = for_schema(schema)
    await _enqueue(conn, schema, 20_000, priority=5)
    workers = FreeingSlots()
    async with producer_running(dsn, q, workers) as producer:
        with anyio.fail_after(10):
            while producer.cursor.after is None:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        (urgent,) = await _enqueue(conn, schema, 1, priority=0)
        enqueued_at = anyio.current_time()
        with anyio.fail_after(10):
            while urgent not in [j.id for j in workers.submitted]:  # noqa: ASYNC110
                await anyio.sleep(0.001)
        waited = anyio.current_time() - enqueued_at
        ran = len(workers.submitted)
    assert waited < CURSOR_HEAD_S + 0.5, (waited, ran)
    assert ran < 20_000  # the backlog had not run out


async def test_a_claim_after_its_cursor_skips_what_a_held_horizon_keeps_at_the_head(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """While a snapshot holds the xmin horizon, every job claimed since leaves an entry
    at the head of the claim index that no scan can skip without a heap visit: a claim
    from the head reads them all, a claim after the cursor starts past them (its start
    is an index condition), so its buffers stay in proportion to its batch."""
    q = for_schema(schema)
    await conn.execute(
        f"INSERT INTO {schema}.job (state, queue, kind, args) "
        "SELECT 'available', 'default', 'k', '{}' FROM generate_series(1, 50050)"
    )
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await holder.fetchval(f"SELECT count(*) FROM {schema}.job")
        # 50,000 jobs gone (run and finished) while the snapshot holds them.
        last = await conn.fetchrow(
            f"WITH gone AS (DELETE FROM {schema}.job WHERE id IN (SELECT id FROM {schema}.job "
            "ORDER BY id LIMIT 50000) RETURNING priority, run_at, id) "
            "SELECT * FROM gone ORDER BY id DESC LIMIT 1"
        )
        sql = q.sql("job_claim")
        base = ("default", 50, "m", LEASE)
        plans = []
        for start in [(None, None, None), (last["priority"], last["run_at"], last["id"])]:
            planner = await asyncpg.connect(dsn)  # (_plan deallocates every statement)
            try:
                plans.append(await _plan(planner, sql, (*base, *start), generic=False,
                                         analyze=True))  # fmt: skip
            finally:
                await planner.close()
        head, after = plans
    finally:
        await holder.close()
    buffers = {
        name: plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
        for name, plan in (("head", head), ("after", after))
    }
    assert head["Actual Rows"] == after["Actual Rows"] == 50
    assert buffers["after"] < 25 * 50 < buffers["head"], buffers


async def test_the_cursors_own_job_rescued_starts_again(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """Regression: a job the reaper made available again keeps its place in claim order,
    which was the idle producer's cursor itself: claims start after it and the look
    asked only before it, so it never started again (e2e
    test_a_job_claimed_again_by_its_member_keeps_its_live_attempt, CI)."""
    async with past_one_job(dsn, conn, schema) as (_, workers, job_id):
        await conn.execute(  # what the reaper does to a job whose lease ran out
            f"UPDATE {schema}.job SET state = 'available', fence = NULL, owner = NULL, "
            "lease_expires_at = NULL WHERE id = $1",
            job_id,
        )
        with anyio.fail_after(MAX_POLL_S + 2):
            while len(workers.submitted) < 2:  # noqa: ASYNC110
                await anyio.sleep(0.001)
    assert [j.id for j in workers.submitted] == [job_id, job_id]
