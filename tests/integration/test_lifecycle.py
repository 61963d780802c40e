"""The job lifecycle (issue 13) through the real statements: dependencies and their
release in the finishing statement, dependency_failed down a chain, batches' `after`
edges, expiry at claim time and by the reaper, replace and unique_for, and wait().
Jobs are claimed and finished with the member's own statements (job_claim,
job_complete_many, job_fail_many), so no daemon is needed to see the SQL's rules."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import anyio
import asyncpg
import pytest

from pgjobd import EnqueueError
from pgjobd.admin import UnknownJobs
from pgjobd.client import Client, JobSpec, SyncClient
from pgjobd.queries import Queries, for_schema
from pgjobd.roles import RoleContext
from pgjobd.roles.reaper import Reaper
from pgjobd.statements.job import ClaimRow, CompleteRow, FailRow
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.anyio
LEASE = timedelta(seconds=30)


@pytest.fixture
async def client(dsn: str, schema: str) -> AsyncIterator[Client]:
    async with await Client.connect(dsn, schema=schema) as c:
        yield c


async def claim(conn: asyncpg.Connection, q: Queries, limit: int = 100) -> list[ClaimRow]:
    return await q.job_claim(conn, "default", limit, "m1", LEASE)


async def complete(
    conn: asyncpg.Connection, q: Queries, jobs: Sequence[ClaimRow], result: object = None
) -> None:
    encoded = json.dumps(result) if result is not None else None
    rows = [CompleteRow(j.id, j.fence, encoded, True) for j in jobs]
    assert len(await q.job_complete_many(conn, rows)) == len(jobs)


async def discard(conn: asyncpg.Connection, q: Queries, jobs: Sequence[ClaimRow]) -> None:
    rows = [
        FailRow(j.id, j.fence, "discarded", 3, timedelta(0), "Boom", "no", None, 0.0, True, "fp")
        for j in jobs
    ]
    recorded = await q.job_fail_many(conn, rows, "m1")
    assert [r.reason for r in recorded] == ["discarded"] * len(jobs)


async def results(conn: asyncpg.Connection, q: Queries, job: ClaimRow) -> Any:
    """What ctx.results() gives the claimed `job` (the member's own statement)."""
    ids = [*(job.depends_on or ()), *(job.after_jobs or ())]
    return json.loads(await q.job_results(conn, ids) or "{}")


async def states(conn: asyncpg.Connection, schema: str) -> dict[int, str]:
    live = await conn.fetch(f"SELECT id, state::text FROM {schema}.job")
    final = await conn.fetch(f"SELECT id, coalesce(reason, state::text) AS state "
                             f"FROM {schema}.job_history")  # fmt: skip
    return {**{r["id"]: r["state"] for r in final}, **{r["id"]: r["state"] for r in live}}


async def test_a_diamond_runs_in_order_and_releases_in_the_finishing_statement(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    a = await client.enqueue("a")
    b = await client.enqueue("b", depends_on=[a])
    c = await client.enqueue("c", depends_on=[a])
    d = await client.enqueue("d", depends_on=[b, c])
    assert await states(conn, schema) == {a: "available", b: "blocked", c: "blocked",
                                          d: "blocked"}  # fmt: skip

    first = await claim(conn, q)
    assert [j.id for j in first] == [a]
    await complete(conn, q, first, {"from": "a"})
    # b and c are available the moment a's completion committed: no promoter involved.
    second = await claim(conn, q)
    assert sorted(j.id for j in second) == [b, c]
    for j in second:
        assert await results(conn, q, j) == {str(a): {"from": "a"}}
    assert list(second[0].depends_on or ()) == [a]
    await complete(conn, q, second[:1], 1)
    assert (await states(conn, schema))[d] == "blocked"
    await complete(conn, q, second[1:], 2)
    third = await claim(conn, q)
    assert [j.id for j in third] == [d]
    assert await results(conn, q, third[0]) == {str(second[0].id): 1, str(second[1].id): 2}
    # Every edge fired is gone.
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_dependency") == 0


async def test_a_failed_dependency_ends_its_dependants_dead_transitively(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    a = await client.enqueue("a")
    b = await client.enqueue("b", depends_on=[a])
    c = await client.enqueue("c", depends_on=[b])
    callback = await client.enqueue("cb", after=[a, b])  # an `after` edge runs anyway
    await discard(conn, q, await claim(conn, q))
    found = await states(conn, schema)
    assert found == {a: "discarded", b: "dependency_failed", c: "dependency_failed",
                     callback: "available"}  # fmt: skip
    info = await client.job(c)
    assert info is not None and info.state == "dead" and info.reason == "dependency_failed"
    assert info.depends_on == [b]
    assert "DependencyFailed: job" in (info.last_error or "")
    [cb] = await claim(conn, q)
    assert cb.blockers_failed == 2 and sorted(cb.after_jobs or ()) == [a, b]


async def test_a_dependency_already_ended_is_not_waited_for(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    a = await client.enqueue("a")
    await complete(conn, q, await claim(conn, q), "done")
    bad = await client.enqueue("bad")
    await discard(conn, q, await claim(conn, q))
    b = await client.enqueue("b", depends_on=[a])
    c = await client.enqueue("c", depends_on=[a, bad])
    found = await states(conn, schema)
    assert found[b] == "available" and found[c] == "dependency_failed"


async def test_unknown_dependency_ids_are_refused_and_nothing_is_written(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    a = await client.enqueue("a")
    with pytest.raises(EnqueueError, match="dependency 987654 names no job"):
        await client.enqueue("b", depends_on=[a, 987654])
    with pytest.raises(EnqueueError, match="job 2 of 2: dependency 987654 names no job"):
        await client.enqueue_many([("x", {}), JobSpec("y", {}, after=[987654])])
    with pytest.raises(EnqueueError, match="depends_on must be a list of job ids"):
        await client.enqueue("b", depends_on="12")  # type: ignore[arg-type]
    with pytest.raises(asyncpg.PostgresError) as raised:
        await conn.execute(f"SELECT {schema}.enqueue('b', depends_on => ARRAY[987654::bigint])")
    assert raised.value.sqlstate == "PJ008"
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 1


async def test_fan_in_counts_down_without_reading_the_dependant_list(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    children = await client.enqueue_many([("child", {"n": n}) for n in range(2000)])
    callback = await client.enqueue("callback", depends_on=children)
    assert await conn.fetchval(f"SELECT blockers FROM {schema}.job WHERE id = $1",
                               callback) == 2000  # fmt: skip
    for _ in range(4):
        claimed = await claim(conn, q, 500)
        assert len(claimed) == 500 and callback not in {j.id for j in claimed}
        await complete(conn, q, claimed, 1)
    [cb] = await claim(conn, q)
    assert cb.id == callback and len(await results(conn, q, cb)) == 2000


async def test_sql_callers_get_dependencies_too(conn: asyncpg.Connection, schema: str) -> None:
    a = await conn.fetchval(f"SELECT {schema}.enqueue('a', '{{}}')")
    b = await conn.fetchval(
        f"SELECT {schema}.enqueue('b', '{{}}', depends_on => ARRAY[$1::bigint])", a
    )
    rows = await conn.fetch(
        f"SELECT * FROM {schema}.enqueue_many(ARRAY['x', 'y'], ARRAY['{{}}', '{{}}']::jsonb[], "
        f"dependencies => ARRAY[NULL, $1::text])", "{" + str(b) + "}",
    )  # fmt: skip
    assert await states(conn, schema) == {a: "available", b: "blocked", rows[0]["id"]: "available",
                                          rows[1]["id"]: "blocked"}  # fmt: skip


async def test_expired_jobs_are_never_claimed_and_the_reaper_ends_them(
    client: Client, conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    soon = await client.enqueue("soon", ttl="1ms")
    later = await client.enqueue("later", ttl="1h")
    copied = await client.enqueue_many([("copied", {}), ("copied", {})], ttl="1ms")
    await conn.execute("SELECT pg_sleep(0.01)")
    claimed = await claim(conn, q)
    assert [j.id for j in claimed] == [later]
    await Reaper().tick(leading)
    found = await states(conn, schema)
    assert [found[i] for i in (soon, *copied)] == ["expired"] * 3
    info = await client.job(soon)
    assert info is not None and info.state == "dead" and info.reason == "expired"
    with pytest.raises(EnqueueError, match="ttl must be positive"):
        await client.enqueue("x", ttl="-1s")
    with pytest.raises(asyncpg.PostgresError, match="give expires_at or ttl, not both"):
        await conn.execute(f"SELECT {schema}.enqueue('x', expires_at => now(), "
                           "ttl => interval '1s')")  # fmt: skip


async def test_replace_debounces_a_waiting_job_and_follows_a_running_one(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    first = await client.enqueue("sync", {"v": 1}, unique_key="k", delay="1h")
    again = await client.enqueue("sync", {"v": 2}, unique_key="k", on_conflict="replace",
                                 priority=5)  # fmt: skip
    assert again == first
    row = await conn.fetchrow(f"SELECT args, state::text, priority FROM {schema}.job")
    assert json.loads(row["args"]) == {"v": 2} and row["state"] == "available"
    assert row["priority"] == 5
    [running] = await claim(conn, q)
    follower = await client.enqueue("sync", {"v": 3}, unique_key="k", on_conflict="replace")
    assert follower != first
    assert await client.enqueue("sync", {"v": 4}, unique_key="k", on_conflict="replace") == (
        follower
    )
    assert (await states(conn, schema))[follower] == "blocked"
    await complete(conn, q, [running])
    [next_run] = await claim(conn, q)
    assert next_run.id == follower and json.loads(next_run.args) == {"v": 4}
    # The follower took the key when it was released.
    assert await client.enqueue("sync", {"v": 5}, unique_key="k") == follower


async def test_unique_for_matches_a_recent_completion(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    first = await client.enqueue("once", unique_key="u")
    await complete(conn, q, await claim(conn, q))
    assert await client.enqueue("once", unique_key="u", unique_for="1h") == first
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0
    again = await client.enqueue("once", unique_key="u")  # without a window: a new job
    assert again != first
    with pytest.raises(EnqueueError, match="unique_for needs a unique_key"):
        await client.enqueue("once", unique_for="1h")


async def test_wait_returns_final_jobs_and_times_out_on_live_ones(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    done = await client.enqueue("a")
    await complete(conn, q, await claim(conn, q), {"ok": True})
    info = await client.wait(done)
    assert info.state == "completed" and info.result == {"ok": True}
    pending = await client.enqueue("b", delay="1h")
    with pytest.raises(TimeoutError):
        await client.wait(pending, timeout=0.05)
    with pytest.raises(UnknownJobs):
        await client.wait(999_999)


async def test_wait_on_a_thousand_jobs_at_once_wakes_on_their_ends(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    ids = await client.enqueue_many([("w", {"n": n}) for n in range(1000)])
    results: dict[int, str] = {}

    async def wait_one(job_id: int) -> None:
        results[job_id] = (await client.wait(job_id, timeout=120)).state

    async with anyio.create_task_group() as tg:
        for job_id in ids:
            tg.start_soon(wait_one, job_id)
        # Every waiter is registered before the jobs end (else this proves less).
        await wait_until(lambda: len(client._final._waiters) == 1000, 60, "1000 waiters")
        assert client._final._users == 1000
        while claimed := await claim(conn, q, 250):
            await complete(conn, q, claimed)
    assert results == dict.fromkeys(ids, "completed")
    assert client._final._conn is None  # the LISTEN connection went back to the pool


async def test_a_batch_callback_runs_once_after_all_ended_with_the_counts(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    batch = await client.enqueue_batch([("part", {"n": n}) for n in range(5)], ("done", {}))
    assert (await states(conn, schema))[batch.callback_id] == "blocked"
    parts = await claim(conn, q)
    await discard(conn, q, parts[:2])
    await complete(conn, q, parts[2:])
    [cb] = await claim(conn, q)
    assert cb.id == batch.callback_id and cb.blockers_failed == 2
    assert sorted(cb.after_jobs or ()) == sorted(batch.ids)
    with pytest.raises(EnqueueError):
        await client.enqueue_batch([("part", {}), ("part", {"bad": 1})], ("done", {}),
                                   queue="bad queue!")  # fmt: skip
    with pytest.raises(EnqueueError, match="unique_for must be positive"):  # the callback's
        await client.enqueue_batch(
            [("part", {})], JobSpec("done", unique_key="x", unique_for="-1s")
        )
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE kind = 'part'") == 0


async def test_sync_client_waits_without_an_event_loop(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)

    def application_code() -> tuple[str, str]:
        with SyncClient(dsn, schema=schema) as sync:
            job_id = sync.enqueue("k")
            anyio.from_thread.run(_finish_one, conn, q)
            done = sync.wait(job_id, timeout=30).state
            pending = sync.enqueue("k", delay="1h")
            try:
                sync.wait(pending, timeout=0.05)
            except TimeoutError:
                return done, "timed out"
            return done, "returned"

    assert await anyio.to_thread.run_sync(application_code) == ("completed", "timed out")


async def _finish_one(conn: asyncpg.Connection, q: Queries) -> None:
    await complete(conn, q, await claim(conn, q, 1))


async def _dependency_touches(conn: asyncpg.Connection, schema: str) -> int:
    """Scans of job_dependency so far in this transaction (pg_stat_xact_*: exact, ours)."""
    touched = await conn.fetchval(
        "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables "
        "WHERE schemaname = $1 AND relname = 'job_dependency'",
        schema,
    )
    return int(touched or 0)


async def test_finishing_jobs_nothing_depends_on_never_reads_the_dependency_edges(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    """The common completion pays nothing for dependencies (migration settle_dependants):
    through 0014 every finished batch looked its ids up in job_dependency."""
    q = for_schema(schema)
    parent = await client.enqueue("parent")
    await client.enqueue_many([("plain", {"i": i}) for i in range(20)])
    child = await client.enqueue("child", depends_on=[parent])
    claimed = await claim(conn, q)
    async with conn.transaction():
        await complete(conn, q, [j for j in claimed if j.id != parent])
        assert await _dependency_touches(conn, schema) == 0
    async with conn.transaction():
        await complete(conn, q, [j for j in claimed if j.id == parent])
        assert await _dependency_touches(conn, schema) > 0
    assert (await states(conn, schema))[child] == "available"


async def test_a_dependant_enqueued_while_its_dependency_finishes_is_released(
    dsn: str, client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    """The dependant's enqueue flags the running dependency under its row lock; a
    completion that waits on that lock deletes the flagged row and settles it."""
    q = for_schema(schema)
    parent = await client.enqueue("parent")
    [running] = await claim(conn, q)
    enqueuer = await asyncpg.connect(dsn)
    completer = await asyncpg.connect(dsn)
    try:
        tx = enqueuer.transaction()
        await tx.start()
        child = await enqueuer.fetchval(
            f"SELECT {schema}.enqueue('child', '{{}}'::jsonb, depends_on => $1)", [parent]
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(complete, completer, q, [running])
            await wait_until(lambda: _waiting_on_lock(conn, completer), timeout_s=10)
            await tx.commit()
        assert (await states(conn, schema))[child] == "available"
    finally:
        await enqueuer.close()
        await completer.close()


async def _waiting_on_lock(conn: asyncpg.Connection, other: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
        other.get_server_pid(),
    ))  # fmt: skip
