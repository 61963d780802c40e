"""Several real members on one database: one leader at a time, fast takeover, fenced
roles, and the reaper bringing back the jobs of a member that died."""

from __future__ import annotations

import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import Client, migrate
from pgjobd.embedded import KILL_SAFE_SETTINGS, Cluster
from pgjobd.leader import unsigned
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.queries import for_schema

from .conftest import HANDLERS, MemberProcess, run_member, wait_all_final, wait_until
from .events import JSON_LOG, events, log_events, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]


async def leader_locks(conn: asyncpg.Connection, schema: str) -> list[int]:
    """Backend pids holding the schema's leader lock (at most one, by construction)."""
    k1, k2 = unsigned(lock_key(LEADER, schema))
    rows = await conn.fetch(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid::bigint = $1 "
        "AND objid::bigint = $2 AND objsubid = 2 AND granted",
        k1, k2,
    )  # fmt: skip
    return [r["pid"] for r in rows]


async def current_term(conn: asyncpg.Connection, schema: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        f"SELECT l.term, l.member, l.backend_pid FROM {schema}.leader AS l "
        "ORDER BY l.term DESC LIMIT 1"
    )


async def leader_member(
    conn: asyncpg.Connection, schema: str, members: list[MemberProcess]
) -> MemberProcess:
    """The member process whose session holds the lock now."""

    async def find() -> MemberProcess | None:
        pids = await leader_locks(conn, schema)
        term = await current_term(conn, schema)
        if len(pids) != 1 or term is None or term["backend_pid"] != pids[0]:
            return None
        member_pid = int(term["member"].split(":")[1])
        return next((m for m in members if m.process.pid == member_pid), None)

    found: MemberProcess = await wait_until(find, what="a leader")
    return found


@pytest.mark.core
async def test_one_leader_among_three_and_fast_takeover(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    members = [await start_member() for _ in range(3)]
    leader = await leader_member(conn, schema, members)

    for _ in range(20):  # sampled: never two lock holders, always the latest term's
        assert len(await leader_locks(conn, schema)) == 1
        await anyio.sleep(0.05)

    # Killed: the kernel closes its session, the lock goes, a candidate takes it.
    first_term = (await current_term(conn, schema))["term"]
    killed_at = time.monotonic()
    leader.send_signal(signal.SIGKILL)
    survivors = [m for m in members if m is not leader]
    second = await leader_member(conn, schema, survivors)
    took_over_s = time.monotonic() - killed_at
    assert (await current_term(conn, schema))["term"] > first_term
    assert took_over_s < 3.0, f"new leader after {took_over_s:.2f}s"

    # Graceful: it resigns and says so; a candidate takes over at once.
    stopped_at = time.monotonic()
    stop = anyio.create_task_group()
    async with stop:
        stop.start_soon(second.stop)
        third = await leader_member(conn, schema, [m for m in survivors if m is not second])
    assert time.monotonic() - stopped_at < 1.5
    assert third is not second
    resigned = await conn.fetchval(
        f"SELECT resigned_at IS NOT NULL FROM {schema}.leader WHERE term = $1",
        (await current_term(conn, schema))["term"] - 1,
    )
    assert resigned


@pytest.mark.core
async def test_a_terminated_leader_session_stops_its_roles_and_its_writes_land_nowhere(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    member = await start_member(daemon=JSON_LOG)
    await leader_member(conn, schema, [member])
    old = await current_term(conn, schema)

    await conn.execute("SELECT pg_terminate_backend($1)", old["backend_pid"])

    await wait_for_event(member, "leader.lost", term=old["term"])
    new = await wait_until(lambda: _newer_term(conn, schema, old["term"]), what="a new term")
    await wait_for_event(member, "leader.gained", term=new["term"])
    terms = [(e["event"], e["term"]) for e in log_events(member.log)
             if e.get("event") in ("leader.gained", "leader.lost")]  # fmt: skip
    # the old term's roles stopped before the new term's started
    assert terms.index(("leader.lost", old["term"])) < terms.index(("leader.gained", new["term"]))

    # A role statement of the deposed term changes nothing; the new term's does.
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('echo', queue => 'nobody')")
    await conn.execute(
        f"UPDATE {schema}.job SET state = 'running', owner = 'gone', fence = 1, "
        "attempt = 1, lease_expires_at = now() - interval '1 minute' WHERE id = $1",
        job_id,
    )
    q = for_schema(schema)
    no_wait = timedelta(0)  # as if each term had lasted its first lease
    async with conn.transaction():
        # Hold the row, so the live leader's reaper (SKIP LOCKED) leaves it to us.
        await conn.execute(f"SELECT FROM {schema}.job WHERE id = $1 FOR UPDATE", job_id)
        deposed = await q.job_reap_expired(conn, old["term"], no_wait, 10, [], 3)
        assert (deposed.rescued, deposed.died) == (0, 0)
        state = await conn.fetchval(f"SELECT state FROM {schema}.job WHERE id = $1", job_id)
        assert state == "running"
    current = await q.job_reap_expired(conn, new["term"], no_wait, 10, [], 3)
    assert (
        current.rescued == 1
        or await conn.fetchval(f"SELECT state FROM {schema}.job WHERE id = $1", job_id)
        == "available"
    )  # the live leader's reaper may have got there first


async def _newer_term(conn: asyncpg.Connection, schema: str, than: int) -> asyncpg.Record | None:
    row = await current_term(conn, schema)
    return row if row is not None and row["term"] > than else None


@pytest.mark.core
async def test_the_jobs_of_a_killed_member_run_again_elsewhere(
    client: Client,
    dsn: str,
    schema: str,
    conn: asyncpg.Connection,
    start_member: StartMember,
    tmp_path: Path,
) -> None:
    ledger = tmp_path / "ledger"
    doomed = await start_member(daemon='lease = "2s"')
    ids = await client.enqueue_many(
        [("record", {"path": str(ledger), "hold_s": 3.0}) for _ in range(6)]
    )

    async def all_claimed() -> bool:
        return await conn.fetchval(
            f"SELECT count(*) FROM {schema}.job WHERE state = 'running'"
        ) == len(ids)

    await wait_until(all_claimed, what="the jobs running on the doomed member")
    doomed.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    rescuer = await start_member(daemon=f'lease = "2s"\n{JSON_LOG}')

    records = await wait_all_final(conn, schema, len(ids), timeout_s=40)
    recovered_s = time.monotonic() - killed_at
    attempts = await conn.fetch(
        f"SELECT job_id, attempt, member, outcome, error_message FROM {schema}.job_attempt "
        "ORDER BY job_id, attempt"
    )
    # On failure, what each attempt was and what the member that ran them again logged.
    story = "\n".join(map(str, attempts)) + "\n" + ledger.read_text() + rescuer.log[-4000:]
    assert {r["state"] for r in records.values()} == {"completed"}, story
    assert sorted(r["attempt"] for r in records.values()) == [2] * len(ids), story
    lost = [r["job_id"] for r in attempts if r["outcome"] == "lease_expired"]
    assert sorted(lost) == sorted(ids), story
    # Each has crashed before (its member died) and runs apart: the first claim's jobs
    # beyond its two worker processes go back once, and later claims take what they place.
    assert len(events(rescuer, "job.given_back")) <= len(ids) - 2, story
    # lease 2s + reaper interval 5s + the rerun's 3s, with room for a slow machine
    assert recovered_s < 20, recovered_s


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A private PostgreSQL the test can stop and start."""
    with Cluster(tmp_path / "pg", settings=KILL_SAFE_SETTINGS) as running:
        yield running


async def test_a_job_completed_on_its_last_attempt_during_an_outage_longer_than_the_lease_completes(
    cluster: Cluster, tmp_path: Path
) -> None:
    # The outcomes wait in the member's completer while the database is away for longer
    # than the lease. When it is back, the leader's session (and so its term) is new,
    # and its reaper waits one lease into the term: the completer records them first.
    await cluster.ensure_database("outage")
    dsn = cluster.dsn("outage")
    schema = "pgjobd"
    conn = await asyncpg.connect(dsn)
    await migrate.migrate(conn, schema)
    ledger = tmp_path / "ledger"
    await conn.execute(
        f"SELECT {schema}.enqueue('record', jsonb_build_object('path', $1::text, "
        "'hold_s', 1.5), max_attempts => 1) FROM generate_series(1, 8)",
        str(ledger),
    )
    await conn.close()
    config = tmp_path / "pgjobd.toml"
    lease_s = 8
    config.write_text(
        f'[database]\nschema = "{schema}"\n[daemon]\nhandlers = ["{HANDLERS}"]\n'
        f'metrics_listen = ""\n{JSON_LOG}lease = "{lease_s}s"\n'
        "[queues.default]\nconcurrency = 8\nprocesses = 1\n"
    )
    member = await run_member(config, dsn, tmp_path / "member.log")
    try:
        await wait_until(lambda: _running(dsn, schema, 8), what="8 jobs running", timeout_s=30)
        cluster.stop("fast")
        stopped_at = time.monotonic()
        await wait_for_event(member, "completer.blocked", timeout_s=30)  # outcomes held
        await anyio.sleep(max(0.0, lease_s + 3 - (time.monotonic() - stopped_at)))
        cluster.start()

        conn = await asyncpg.connect(dsn)
        try:

            async def final() -> list[asyncpg.Record] | None:
                rows = await conn.fetch(f"SELECT state, reason FROM {schema}.job_history")
                return rows if len(rows) == 8 else None

            records = await wait_until(final, timeout_s=60, what="8 final records")
            assert [(r["state"], r["reason"]) for r in records] == [("completed", None)] * 8
        finally:
            await conn.close()
    finally:
        assert await member.stop() == 0, member.log[-3000:]


async def _running(dsn: str, schema: str, count: int) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        running = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE state = 'running'")
        return bool(running == count)
    finally:
        await conn.close()
