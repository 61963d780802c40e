"""The leader's fence is its term, checked at the moment a role's write commits: a deposed
leader's write that waited on a lock while the next leader was elected lands nowhere,
a backend that reuses the old leader's pid changes nothing, the lock is freed only once
the term's roles have stopped, and the reaper lets every member have one lease of
database time in each new term before it judges a lease lost."""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import ClassVar

import anyio
import asyncpg
import pytest

from pgjobd.config import Config, DaemonConfig, DatabaseConfig
from pgjobd.duration import Duration
from pgjobd.leader import Elector, Leadership, unsigned
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.queries import Queries, for_schema
from pgjobd.roles import Deposed, RoleContext
from pgjobd.roles.reaper import Reaper
from pgjobd.roles.runner import RoleRunner

pytestmark = pytest.mark.anyio
WAIT_S = 30  # generous: the machine may be busy


async def until(check: Callable[[], Awaitable[object]]) -> None:
    """Wait until `check()` is true (polled; the machine may be busy)."""
    with anyio.fail_after(WAIT_S):
        while True:
            if await check():
                return
            await anyio.sleep(0.05)


class Leaders:
    """Sessions that take the leader lock and begin terms, as an Elector does."""

    def __init__(self, dsn: str, schema: str, pool: asyncpg.Pool) -> None:
        self.dsn, self.schema, self.pool = dsn, schema, pool
        self.q: Queries = for_schema(schema)
        self.sessions: list[asyncpg.Connection] = []

    async def elect(
        self, *, lease: timedelta = timedelta(seconds=30)
    ) -> tuple[asyncpg.Connection, RoleContext]:
        session = await asyncpg.connect(self.dsn)
        self.sessions.append(session)
        key = lock_key(LEADER, self.schema)
        await until(lambda: self.q.leader_try_lock(session, *key))
        term = await self.q.leader_term_begin(session, "test")
        config = Config(
            database=DatabaseConfig(schema=self.schema),
            daemon=DaemonConfig(lease=Duration(seconds=lease.total_seconds())),
        )
        return session, RoleContext(self.pool, self.q, config, "test", term)

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()


@pytest.fixture
async def leaders(dsn: str, schema: str) -> AsyncIterator[Leaders]:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    made = Leaders(dsn, schema, pool)
    try:
        yield made
    finally:
        await made.close()
        await pool.close()


async def _expired_job(conn: asyncpg.Connection, schema: str) -> int:
    """A running job of a member that stopped renewing: the reaper's to take back."""
    job_id: int = await conn.fetchval(f"SELECT {schema}.enqueue('echo', queue => 'nobody')")
    await conn.execute(
        f"UPDATE {schema}.job SET state = 'running', owner = 'gone', fence = 1, attempt = 1, "
        "lease_expires_at = now() - interval '1 minute' WHERE id = $1",
        job_id,
    )
    return job_id


async def _age_term(conn: asyncpg.Connection, schema: str, term: int) -> None:
    """As if the term had begun long ago (past its first lease, when the reaper reaps)."""
    await conn.execute(
        f"UPDATE {schema}.leader SET elected_at = now() - interval '1 hour' WHERE term = $1",
        term,
    )


async def _job(conn: asyncpg.Connection, schema: str, job_id: int) -> asyncpg.Record:
    row = await conn.fetchrow(
        f"SELECT state, owner, crashes, (SELECT count(*) FROM {schema}.job_attempt "
        f"WHERE job_id = $1) AS attempts FROM {schema}.job WHERE id = $1",
        job_id,
    )
    assert row is not None
    return row


async def _waiting_on_a_lock(conn: asyncpg.Connection, query_like: str) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE $1)",
            query_like,
        )
    )


async def test_a_deposed_leaders_write_that_waited_on_a_lock_lands_nowhere(
    dsn: str, conn: asyncpg.Connection, schema: str, leaders: Leaders
) -> None:
    old_session, old = await leaders.elect()
    await _age_term(conn, schema, old.term)
    job_id = await _expired_job(conn, schema)

    # Hold today's job_attempt partition: the old leader's reap locks the job row, then
    # waits here when it routes the attempt row into the partition, after its
    # statement began (where the old fence was evaluated, once).
    blocker = await asyncpg.connect(dsn)
    blocker_tx = blocker.transaction()
    await blocker_tx.start()
    partition = await blocker.fetchval(
        "SELECT format('%I.%I', $1::text, 'job_attempt_p' || "
        "to_char((now() AT TIME ZONE 'UTC')::date, 'YYYYMMDD'))",
        schema,
    )
    await blocker.execute(f"LOCK TABLE {partition} IN SHARE MODE")
    outcome: list[BaseException | None] = []

    async def old_reaper() -> None:
        try:
            await Reaper().tick(old)
            outcome.append(None)
        except Exception as e:
            outcome.append(e)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(old_reaper)
            await until(lambda: _waiting_on_a_lock(conn, "%Takes back running jobs%"))
            # The old leader's session goes (its lock with it); a new leader is elected
            # while the old statement still waits.
            await old_session.close()
            _, new = await leaders.elect()
            assert new.term > old.term
            await blocker_tx.rollback()  # the old statement goes on
    finally:
        await blocker.close()

    assert len(outcome) == 1 and isinstance(outcome[0], Deposed), outcome
    job = await _job(conn, schema, job_id)
    assert (job["state"], job["owner"], job["crashes"], job["attempts"]) == (
        "running", "gone", 0, 0
    )  # fmt: skip


async def test_a_backend_that_reuses_the_old_leaders_pid_does_not_pass_the_fence(
    conn: asyncpg.Connection, schema: str, leaders: Leaders
) -> None:
    old_session, old = await leaders.elect()
    await _age_term(conn, schema, old.term)
    await old_session.close()
    new_session, new = await leaders.elect()
    await _age_term(conn, schema, new.term)
    # The new leader's session has the pid the old term was begun on, as a backend
    # started after the old one ended may.
    await conn.execute(
        f"UPDATE {schema}.leader SET backend_pid = $1 WHERE term = $2",
        new_session.get_server_pid(), old.term,
    )  # fmt: skip
    job_id = await _expired_job(conn, schema)

    with pytest.raises(Deposed):
        await Reaper().tick(old)
    assert (await _job(conn, schema, job_id))["state"] == "running"

    await Reaper().tick(new)
    assert (await _job(conn, schema, job_id))["state"] == "available"


async def test_the_reaper_waits_one_lease_into_its_term(
    conn: asyncpg.Connection, schema: str, leaders: Leaders
) -> None:
    # After an outage the leader's session is new, and so is its term: each member gets
    # one lease of database time to record what it finished meanwhile and renew.
    lease = timedelta(seconds=4)
    _, ctx = await leaders.elect(lease=lease)
    job_id = await _expired_job(conn, schema)
    reaper = Reaper()

    await reaper.tick(ctx)
    term_age = await conn.fetchval(
        f"SELECT now() - elected_at FROM {schema}.leader WHERE term = $1", ctx.term
    )
    if term_age < lease:  # the tick ran within the term's first lease
        assert (await _job(conn, schema, job_id))["state"] == "running"
        assert reaper.interval_s(ctx.config) <= lease.total_seconds() + 0.1

    await until(
        lambda: conn.fetchval(
            f"SELECT now() - elected_at >= $2 FROM {schema}.leader WHERE term = $1",
            ctx.term,
            lease,
        )
    )
    await reaper.tick(ctx)
    assert (await _job(conn, schema, job_id))["state"] == "available"


class SlowRole:
    """A role whose statement is in flight, and finishes, after the term is cancelled."""

    name: ClassVar[str] = "slow"

    def __init__(self, sleep_s: float = 1.5) -> None:
        self.sleep_s = sleep_s
        self.started = anyio.Event()
        self.finished_at: float | None = None

    def interval_s(self, config: Config) -> float:
        return 3600.0

    async def tick(self, ctx: RoleContext) -> None:
        async with ctx.pool.acquire() as conn:
            self.started.set()
            with anyio.CancelScope(shield=True):
                await conn.execute("SELECT pg_sleep($1)", self.sleep_s)
                self.finished_at = await conn.fetchval(
                    "SELECT extract(epoch FROM clock_timestamp())::float8"
                )


async def test_the_lock_is_freed_only_once_the_terms_roles_have_stopped(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    config = Config(database=DatabaseConfig(schema=schema), dsn=dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    role = SlowRole()
    try:
        async with anyio.create_task_group() as tg:
            send, receive = anyio.create_memory_object_stream[Leadership](16)
            runner = RoleRunner(
                pool, queries=for_schema(schema), config=config, member_id="test",
                roles=[role], changes=receive,
            )  # fmt: skip
            tg.start_soon(runner.run)
            tg.start_soon(Elector(config, for_schema(schema), "test", send).run)
            with anyio.fail_after(WAIT_S):
                await role.started.wait()
            tg.cancel_scope.cancel()  # a drain: the member stops leading
    finally:
        await pool.close()

    assert role.finished_at is not None
    resigned_at = await conn.fetchval(
        f"SELECT extract(epoch FROM resigned_at)::float8 FROM {schema}.leader"
    )
    assert resigned_at is not None and resigned_at >= role.finished_at


async def _true(value: object) -> bool:
    return bool(value)


async def test_a_leader_whose_term_ended_frees_the_lock_only_once_its_roles_stopped(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    # Not a drain: the runner goes on, learns that the term ended and stops the roles;
    # the elector must wait for them, not only for the runner to have heard.
    config = Config(database=DatabaseConfig(schema=schema), dsn=dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    role = SlowRole(sleep_s=3.0)
    k1, k2 = unsigned(lock_key(LEADER, schema))
    held = (
        "SELECT extract(epoch FROM clock_timestamp())::float8 AS at, EXISTS (SELECT FROM "
        "pg_locks WHERE locktype = 'advisory' AND classid::bigint = $1 AND objid::bigint = $2 "
        "AND objsubid = 2 AND pid = $3 AND granted) AS held"
    )
    try:
        async with anyio.create_task_group() as tg:
            send, receive = anyio.create_memory_object_stream[Leadership](16)
            runner = RoleRunner(
                pool, queries=for_schema(schema), config=config, member_id="test",
                roles=[role], changes=receive,
            )  # fmt: skip
            tg.start_soon(runner.run)
            tg.start_soon(Elector(config, for_schema(schema), "test", send).run)
            with anyio.fail_after(WAIT_S):
                await role.started.wait()
            pid = await conn.fetchval(f"SELECT backend_pid FROM {schema}.leader")
            await conn.execute(f"UPDATE {schema}.leader SET resigned_at = now()")  # ended
            freed_at = None
            with anyio.fail_after(WAIT_S):
                while freed_at is None:
                    row = await conn.fetchrow(held, k1, k2, pid)
                    freed_at = None if row["held"] else row["at"]
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
    finally:
        await pool.close()

    assert role.finished_at is not None and freed_at >= role.finished_at


class Failing:
    name: ClassVar[str] = "failing"

    def interval_s(self, config: Config) -> float:
        return 0.05

    async def tick(self, ctx: RoleContext) -> None:
        raise RuntimeError("a bug in a role")


async def test_a_lost_connection_is_a_warning_with_the_retry_and_a_bug_an_error(
    dsn: str, conn: asyncpg.Connection, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = Config(database=DatabaseConfig(schema=schema))
    q = for_schema(schema)
    session = await asyncpg.connect(dsn)
    assert await q.leader_try_lock(session, *lock_key(LEADER, schema))
    term = await q.leader_term_begin(session, "test")
    with socket.socket() as s:  # a port where no database listens: as when it is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = await asyncpg.create_pool(
        f"postgresql://root@127.0.0.1:{port}/test", min_size=0, max_size=1
    )
    try:
        with caplog.at_level(logging.INFO, logger="pgjobd.roles.runner"):
            async with anyio.create_task_group() as tg:
                send, receive = anyio.create_memory_object_stream[Leadership](16)
                runner = RoleRunner(
                    pool, queries=q, config=config, member_id="test",
                    roles=[Reaper(), Failing()], changes=receive,
                )  # fmt: skip
                tg.start_soon(runner.run)
                await send.send(Leadership(True, term))
                await until(
                    lambda: _true(runner.errors.get("reaper") and runner.errors.get("failing"))
                )
                tg.cancel_scope.cancel()
    finally:
        await pool.close()
        await session.close()

    reaper_records = [r for r in caplog.records if "role reaper" in r.getMessage()]
    assert reaper_records, [r.getMessage() for r in caplog.records]
    for record in reaper_records:
        assert record.levelno == logging.WARNING and record.exc_info is None
        assert "retrying in" in record.getMessage()
    bug = [r for r in caplog.records if "role failing failed" in r.getMessage()]
    assert bug and all(r.levelno == logging.ERROR and r.exc_info for r in bug)


async def test_after_a_refused_tick_the_reaper_waits_one_lease(
    dsn: str, conn: asyncpg.Connection, schema: str, leaders: Leaders
) -> None:
    # Found by the chaos scenario disk-full-data: with the data volume full the leader
    # kept its session and its term, its reaper's writes were refused as the members'
    # outcomes were, and its first tick once space returned took back jobs whose
    # outcomes members still held (completed work dropped as stale, run again).
    lease = timedelta(seconds=4)
    _, ctx = await leaders.elect(lease=lease)
    await _age_term(conn, schema, ctx.term)
    job_id = await _expired_job(conn, schema)
    reaper = Reaper()
    # A database that refuses writes (full, or read-only) for the leader's pool.
    refusing = await asyncpg.create_pool(
        dsn, min_size=1, max_size=1, server_settings={"default_transaction_read_only": "on"}
    )
    try:
        with pytest.raises(asyncpg.PostgresError):
            await reaper.tick(dataclasses.replace(ctx, pool=refusing))
    finally:
        await refusing.close()

    await reaper.tick(ctx)  # writes are taken again: members first get a lease
    assert (await _job(conn, schema, job_id))["state"] == "running"
    assert reaper.interval_s(ctx.config) <= lease.total_seconds() + 0.1

    await anyio.sleep(lease.total_seconds())
    await reaper.tick(ctx)
    assert (await _job(conn, schema, job_id))["state"] == "available"
