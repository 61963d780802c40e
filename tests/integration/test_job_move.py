"""job_move, the one way a job ends (migration 0020): it moves exactly the jobs whose
fence still holds (or that were given none), writes one final record each (unless told
not to keep it) and announces every one; and the paths that call it decide a job's end
on the row version they move, whatever changes the row while they wait for it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar

import anyio
import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.queries import Queries, for_schema
from pgjobd.statements.job import CompleteRow, FailRow
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.anyio
LEASE = timedelta(seconds=30)
QUEUE = "moves"
H = TypeVar("H")
W = TypeVar("W")


async def _claim(conn: asyncpg.Connection, q: Queries, n: int) -> list[tuple[int, int]]:
    rows = await q.job_claim(conn, QUEUE, n, "member-a", LEASE)
    return [(r.id, r.fence) for r in rows]


async def _enqueue(conn: asyncpg.Connection, schema: str, n: int, max_attempts: int = 5) -> None:
    await conn.execute(
        f"SELECT {schema}.enqueue('k', queue => $1, max_attempts => $2) "
        "FROM generate_series(1, $3)",
        QUEUE, max_attempts, n,
    )  # fmt: skip


async def _ending(conn: asyncpg.Connection, schema: str, job_id: int) -> dict[str, Any]:
    """What became of the job: live (its state) or its final records, and attempts."""
    live = await conn.fetchval(f"SELECT state::text FROM {schema}.job WHERE id = $1", job_id)
    final = await conn.fetch(
        f"SELECT state::text, reason FROM {schema}.job_history WHERE id = $1", job_id
    )
    attempts = await conn.fetch(
        f"SELECT outcome FROM {schema}.job_attempt WHERE job_id = $1 ORDER BY attempt", job_id
    )
    return {
        "live": live,
        "final": [(r["state"], r["reason"]) for r in final],
        "attempts": [r["outcome"] for r in attempts],
    }


async def _waiting_on_lock(conn: asyncpg.Connection, other: asyncpg.Connection) -> bool:
    return bool(await conn.fetchval(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1",
        other.get_server_pid(),
    ))  # fmt: skip


async def _while_waiting(
    conn: asyncpg.Connection,
    holder: asyncpg.Connection,
    hold: Callable[[], Awaitable[H]],
    waiter: asyncpg.Connection,
    wait: Callable[[], Awaitable[W]],
) -> tuple[H, W]:
    """Runs `hold` in a transaction on `holder`, then `wait` on `waiter` until it waits
    for a lock, then commits `hold`; returns what each returned."""
    waited: list[W] = []
    tx = holder.transaction()
    await tx.start()
    committed = False
    try:
        held = await hold()

        async def waiting() -> None:
            waited.append(await wait())

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting)
            await wait_until(lambda: _waiting_on_lock(conn, waiter), timeout_s=10)
            await tx.commit()
            committed = True
    finally:
        if not committed:
            await tx.rollback()
    return held, waited[0]


async def _lease_expired(
    conn: asyncpg.Connection, q: Queries, max_attempts: int
) -> tuple[int, int]:
    """(id, fence) of a job running with its lease expired, on its first attempt."""
    await _enqueue(conn, q.schema, 1, max_attempts=max_attempts)
    [(job_id, fence)] = await _claim(conn, q, 1)
    await conn.execute(
        f"UPDATE {q.schema}.job SET lease_expires_at = now() - interval '1 s' WHERE id = $1",
        job_id,
    )
    return job_id, fence


def _failed(job_id: int, fence: int) -> FailRow:
    return FailRow(job_id, fence, "failed", 100, timedelta(0), "E", "boom", None, 0.1, True, None)


@pytest.fixture
async def sessions(dsn: str) -> AsyncIterator[tuple[asyncpg.Connection, asyncpg.Connection]]:
    a, b = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


@pytest.fixture
async def term(dsn: str, schema: str) -> AsyncIterator[int]:
    """A leader term of this test's (its session holds the leader's lock)."""
    session = await asyncpg.connect(dsn)
    try:
        assert await session.fetchval(
            "SELECT pg_try_advisory_lock($1, $2)", *lock_key(LEADER, schema)
        )
        yield await for_schema(schema).leader_term_begin(session, "test")
    finally:
        await session.close()


async def test_a_failure_that_waits_on_a_cancel_request_ends_the_job_cancelled(
    conn: asyncpg.Connection, schema: str,
    sessions: tuple[asyncpg.Connection, asyncpg.Connection],
) -> None:  # fmt: skip
    """Regression: job_fail_many decided retry-or-end twice, in its UPDATE and in its
    DELETE, each on its own version of the row. An admin's cancel request committed
    while the failure waited for the row made the UPDATE (rechecking the new version)
    see a cancelled job and the DELETE (filtering the old one) a retried one: neither
    wrote, and the job stayed running, its failure lost, until its lease expired."""
    q = for_schema(schema)
    await _enqueue(conn, schema, 1)
    [(job_id, fence)] = await _claim(conn, q, 1)
    admin, member = sessions
    _, recorded = await _while_waiting(
        conn,
        admin,
        lambda: admin.execute(
            f"UPDATE {schema}.job SET cancel_requested = true WHERE id = $1", job_id
        ),
        member,
        lambda: q.job_fail_many(member, [_failed(job_id, fence)], "member-a"),
    )
    assert [(r.id, r.reason) for r in recorded] == [(job_id, "cancelled")]
    assert await _ending(conn, schema, job_id) == {
        "live": None, "final": [("cancelled", "cancelled")], "attempts": ["failed"],
    }  # fmt: skip


@pytest.mark.parametrize("attempts_left", [True, False], ids=["rescued", "died"])
async def test_a_failure_that_waits_on_the_reaper_changes_nothing_the_reaper_ended(
    conn: asyncpg.Connection, schema: str, term: int, attempts_left: bool,
    sessions: tuple[asyncpg.Connection, asyncpg.Connection],
) -> None:  # fmt: skip
    """The reaper takes the job first (its lease expired); the member's failure of the
    same attempt, waiting for the row meanwhile, finds its fence gone: one ending, the
    reaper's, with one attempt row and at most one final record."""
    q = for_schema(schema)
    job_id, fence = await _lease_expired(conn, q, max_attempts=5 if attempts_left else 1)
    reaper, member = sessions
    reaped, recorded = await _while_waiting(
        conn,
        reaper,
        lambda: q.job_reap_expired(reaper, term, timedelta(0), 10, [], 100),
        member,
        lambda: q.job_fail_many(member, [_failed(job_id, fence)], "member-a"),
    )
    assert recorded == []
    assert (reaped.rescued, reaped.died) == ((1, 0) if attempts_left else (0, 1))
    assert await _ending(conn, schema, job_id) == (
        {"live": "available", "final": [], "attempts": ["lease_expired"]}
        if attempts_left
        else {
            "live": None,
            "final": [("dead", "attempts_exhausted")],
            "attempts": ["lease_expired"],
        }
    )


@pytest.mark.parametrize("attempts_left", [True, False], ids=["retried", "died"])
async def test_the_reaper_passes_over_a_job_whose_failure_is_being_recorded(
    conn: asyncpg.Connection, schema: str, term: int, attempts_left: bool,
    sessions: tuple[asyncpg.Connection, asyncpg.Connection],
) -> None:  # fmt: skip
    """The failure holds the row (its transaction still open) when the reaper comes:
    the reaper skips it, and the failure's ending is the only one."""
    q = for_schema(schema)
    job_id, fence = await _lease_expired(conn, q, max_attempts=5 if attempts_left else 1)
    member, reaper = sessions
    async with member.transaction():
        recorded = await q.job_fail_many(member, [_failed(job_id, fence)], "member-a")
        reaped = await q.job_reap_expired(reaper, term, timedelta(0), 10, [], 100)
        assert (reaped.rescued, reaped.died) == (0, 0)
    assert [r.reason for r in recorded] == [None if attempts_left else "attempts_exhausted"]
    assert await _ending(conn, schema, job_id) == (
        {"live": "retryable", "final": [], "attempts": ["failed"]}
        if attempts_left
        else {"live": None, "final": [("dead", "attempts_exhausted")], "attempts": ["failed"]}
    )


# Per job given to job_move: its fence as claimed, a stale one, or none (NULL); keep
# (None: the default, keep), and whether the job is left out of the call altogether.
FENCES = st.sampled_from(["current", "stale", "none"])
ENTRY = st.one_of(st.none(), st.tuples(FENCES, st.sampled_from([True, False, None])))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    entries=st.lists(ENTRY, min_size=1, max_size=12),
    again=st.sampled_from([None, "stale", "none"]),
)
async def test_job_move_moves_exactly_the_jobs_whose_fence_holds_or_was_not_given(
    conn: asyncpg.Connection, schema: str, entries: list[tuple[str, bool | None] | None],
    again: str | None,
) -> None:  # fmt: skip
    q = for_schema(schema)
    await conn.execute(f"TRUNCATE {schema}.job, {schema}.job_history")
    await _enqueue(conn, schema, len(entries))
    claimed = await _claim(conn, q, len(entries))
    # (job id, its fence, which fence is given, keep), one per entry in the call
    given_ = [(job_id, fence, *e) for (job_id, fence), e in zip(claimed, entries, strict=True)
              if e is not None]  # fmt: skip
    if again and given_:  # the first job again (stale fence or none): never moved twice
        given_.append((*given_[0][:2], again, given_[0][3]))
    ids = [job_id for job_id, _, _, _ in given_]
    fences = [
        {"current": fence, "stale": fence + 1_000_000, "none": None}[which]
        for _, fence, which, _ in given_
    ]
    keep = [k for _, _, _, k in given_]
    async with _listening(conn, schema) as heard:
        moved = await conn.fetch(
            f"SELECT id, fence FROM {schema}.job_move($1::bigint[], $2::bigint[], NULL, "
            "NULL, NULL, $3::boolean[])",
            ids, fences, keep,
        )  # fmt: skip
        await wait_until(lambda: _heard_all(heard, moved), timeout_s=5)
    matched = {(job_id, fence, k) for job_id, fence, which, k in given_ if which != "stale"}
    expected = {(job_id, fence) for job_id, fence, _ in matched}
    assert {(r["id"], r["fence"]) for r in moved} == expected
    assert len(moved) == len(expected)
    live = {r["id"] for r in await conn.fetch(f"SELECT id FROM {schema}.job")}
    assert live == {job_id for job_id, _ in claimed} - {job_id for job_id, _ in expected}
    kept = [r["id"] for r in await conn.fetch(f"SELECT id FROM {schema}.job_history")]
    assert sorted(kept) == sorted(job_id for job_id, _, k in matched if k is not False)
    announced = [int(x) for payload in heard for x in payload.split(",")]
    assert sorted(announced) == sorted(job_id for job_id, _ in expected)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(
        st.tuples(
            st.none() | st.sampled_from(["1", '{"a": [1, "x"]}', "null", '"\\u00e9"']),
            st.booleans(),
        ),
        min_size=1,
        max_size=8,
    )
)
async def test_job_complete_many_keeps_the_records_and_results_asked_for_whatever_the_mix(
    conn: asyncpg.Connection, schema: str, rows: list[tuple[str | None, bool]]
) -> None:
    """job_complete_many passes no results, or every record kept, as NULL arrays (the
    common batch); any other mix as it is. Either way each job ends completed, with a
    final record exactly where asked and the result it was given."""
    q = for_schema(schema)
    await conn.execute(f"TRUNCATE {schema}.job, {schema}.job_history")
    await _enqueue(conn, schema, len(rows))
    claimed = await _claim(conn, q, len(rows))
    batch = [CompleteRow(job_id, fence, result, keep)
             for (job_id, fence), (result, keep) in zip(claimed, rows, strict=True)]  # fmt: skip
    finished = await q.job_complete_many(conn, batch)
    assert sorted(finished) == sorted(claimed)
    assert not await conn.fetchval(f"SELECT count(*) FROM {schema}.job")
    kept = {
        r["id"]: (r["state"], r["result"])
        for r in await conn.fetch(f"SELECT id, state::text, result::text FROM {schema}.job_history")
    }
    expected = {
        row.id: ("completed", None if row.result is None else json_text(row.result))
        for row in batch if row.keep_history
    }  # fmt: skip
    assert kept == expected


def json_text(text: str) -> str:
    """JSON text as PostgreSQL's jsonb gives it back."""
    return json.dumps(json.loads(text), separators=(", ", ": "), ensure_ascii=False)


@asynccontextmanager
async def _listening(conn: asyncpg.Connection, schema: str) -> AsyncIterator[list[str]]:
    """The payloads announced on <schema>.job_final while inside, as they arrive."""
    heard: list[str] = []

    def hear(*args: object) -> None:
        heard.append(str(args[-1]))

    await conn.add_listener(f"{schema}.job_final", hear)
    try:
        yield heard
    finally:
        await conn.remove_listener(f"{schema}.job_final", hear)


async def _heard_all(heard: list[str], moved: Sequence[object]) -> bool:
    await anyio.sleep(0.01)
    return sum(len(p.split(",")) for p in heard) >= len(moved)


async def test_every_job_moved_is_announced_at_most_400_to_a_notification(
    conn: asyncpg.Connection, schema: str
) -> None:
    """client.wait's announcements, as job_finish made them: every job ended, kept or
    not, on <schema>.job_final, its ids joined by ',', at most 400 to a payload."""
    await _enqueue(conn, schema, 901)
    ids = [r["id"] for r in await conn.fetch(f"SELECT id FROM {schema}.job ORDER BY id")]
    async with _listening(conn, schema) as heard:
        moved = await conn.fetchval(
            f"SELECT count(*) FROM {schema}.job_move($1::bigint[], NULL, NULL, NULL, NULL, "
            "$2::boolean[])",
            ids, [i % 2 == 0 for i in range(len(ids))],
        )  # fmt: skip
        await wait_until(lambda: _heard_all(heard, ids), timeout_s=5)
    assert moved == len(ids)
    payloads = [[int(x) for x in p.split(",")] for p in heard]
    assert max(len(p) for p in payloads) <= 400 and len(payloads) == 3
    assert sorted(x for p in payloads for x in p) == ids
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history") == 451
