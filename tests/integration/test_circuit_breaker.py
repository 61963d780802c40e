"""The per-kind circuit breaker on a real PostgreSQL: the breaker role's transitions
(kind_breakers_step, run by roles/breaker.py on a FakeClock), and what every claim path
does while a breaker is not closed: open, no claim path starts the kind's jobs (so
none is charged an attempt); half-open, exactly one starts, whoever races for it; its
success closes the breaker, its failure opens it again."""

from __future__ import annotations

from datetime import datetime, timedelta

import anyio
import asyncpg
import pytest

from pgjobd import admin, metrics
from pgjobd.clock import FakeClock
from pgjobd.queries import Queries, for_schema
from pgjobd.roles import Deposed, RoleContext
from pgjobd.roles.breaker import BreakerKeeper
from pgjobd.statements.job import CompleteRow, FailRow
from pgjobd.statements.member import KindDeclared
from tests.integration.test_admin import pgjobd, pgjobd_json

pytestmark = pytest.mark.anyio
LEASE = timedelta(seconds=30)
COOLDOWN = timedelta(seconds=30)


def _flaky(breaker: bool = True, failures: int = 3) -> KindDeclared:
    return KindDeclared(
        "flaky", "q", 0, 100, 60.0, None, None, None, "[]",
        failures if breaker else None, timedelta(minutes=1) if breaker else None,
        COOLDOWN if breaker else None,
    )  # fmt: skip


async def _setup(conn: asyncpg.Connection, schema: str, flaky: int = 6, other: int = 3) -> None:
    q = for_schema(schema)
    await q.kind_declare_many(conn, [_flaky()], "m")
    for _ in range(flaky):
        await conn.execute(f"SELECT {schema}.enqueue('flaky', '{{}}', queue => 'q')")
    for _ in range(other):
        await conn.execute(f"SELECT {schema}.enqueue('steady', '{{}}', queue => 'q')")


async def _fail(conn: asyncpg.Connection, q: Queries, jobs: list[tuple[int, int]]) -> None:
    rows = [FailRow(i, f, "failed", 3, timedelta(0), "E", "boom", None, 0.0, True)
            for i, f in jobs]  # fmt: skip
    assert len(await q.job_fail_many(conn, rows, "m")) == len(jobs)
    await q.job_promote_due(conn, 100)  # back to available at once (no backoff)


async def _complete(conn: asyncpg.Connection, q: Queries, jobs: list[tuple[int, int]]) -> None:
    rows = [CompleteRow(i, f, None, True) for i, f in jobs]
    assert len(await q.job_complete_many(conn, rows)) == len(jobs)


async def _claim_flow(conn: asyncpg.Connection, q: Queries, n: int = 10) -> list[tuple[int, int]]:
    """(id, fence) of the flaky jobs a flow claim took; the others are completed."""
    rows = [r for r in await q.job_claim_flow(conn, "q", n, "m", LEASE) if r.id is not None]
    others = [(r.id, r.fence) for r in rows if r.kind != "flaky"]
    if others:
        await _complete(conn, q, others)
    return [(r.id, r.fence) for r in rows if r.kind == "flaky"]


async def _attempts(conn: asyncpg.Connection, schema: str) -> dict[int, int]:
    return dict(await conn.fetch(f"SELECT id, attempt FROM {schema}.job WHERE kind = 'flaky'"))


async def _state(keeper: BreakerKeeper, ctx: RoleContext) -> tuple[str, str | None]:
    [row] = [r for r in await keeper.step(ctx) if r.kind == "flaky"]
    return row.state, row.change


async def _half_open_and_claim(
    conn: asyncpg.Connection, schema: str, ctx: RoleContext
) -> tuple[BreakerKeeper, list[tuple[int, int]]]:
    """An opened breaker past its 30 s cool-down, half-open, and what a flow claim took."""
    keeper = await _open(conn, schema, ctx)
    assert isinstance(keeper.clock, FakeClock)
    keeper.clock.advance(seconds=31)
    await _state(keeper, ctx)
    return keeper, await _claim_flow(conn, for_schema(schema))


async def _open(conn: asyncpg.Connection, schema: str, ctx: RoleContext) -> BreakerKeeper:
    """A breaker opened by 3 failed attempts (the window's threshold), on a clock an
    hour behind the database's (so that every real failure is after its changes)."""
    q = for_schema(schema)
    db_now: datetime = await conn.fetchval("SELECT now()")
    keeper = BreakerKeeper(clock=FakeClock(db_now - timedelta(hours=1)))
    await _setup(conn, schema)
    jobs = await _claim_flow(conn, q, 3)
    assert len(jobs) == 3
    await _fail(conn, q, jobs[:2])
    assert await _state(keeper, ctx) == ("closed", None)  # 2 of 3
    await _fail(conn, q, jobs[2:])
    assert await _state(keeper, ctx) == ("open", "opened")
    return keeper


async def test_failures_in_the_window_open_it_and_no_claim_path_starts_the_kind(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    await _open(conn, schema, leading)
    assert metrics.REGISTRY.get_sample_value("pgjobd_kind_breaker_state", {"kind": "flaky"}) == 2
    before = await _attempts(conn, schema)
    # The unlimited claim sees a limited kind: it claims nothing; the producer asks
    # queue_flow_get and claims through job_claim_flow, which skips the kind.
    assert await q.job_claim(conn, "q", 10, "m", LEASE) == []
    assert await q.queue_flow_get(conn, "q")
    rows = [r for r in await q.job_claim_flow(conn, "q", 10, "m", LEASE) if r.id is not None]
    assert sorted(r.kind for r in rows) == ["steady"] * 3
    assert await q.job_claim_flow(conn, "q", 10, "m", LEASE) == []
    # Not charged: the flaky jobs' attempts are what they were.
    assert await _attempts(conn, schema) == before
    assert sorted(before.values()) == [0, 0, 0, 1, 1, 1]


async def test_cool_down_half_opens_and_racing_claimers_start_exactly_one_probe(
    conn: asyncpg.Connection, schema: str, dsn: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    keeper = await _open(conn, schema, leading)
    assert isinstance(keeper.clock, FakeClock)
    keeper.clock.advance(seconds=29)
    assert await _state(keeper, leading) == ("open", None)
    keeper.clock.advance(seconds=2)
    assert await _state(keeper, leading) == ("half_open", "half_open")
    assert await q.queue_flow_get(conn, "q")
    assert await q.job_claim(conn, "q", 10, "m", LEASE) == []
    taken: list[tuple[int, int]] = []

    async def claimer(n: int) -> None:
        session = await asyncpg.connect(dsn)
        try:
            for _ in range(5):
                rows = await q.job_claim_flow(session, "q", 3, f"m{n}", LEASE)
                taken.extend((r.id, r.fence) for r in rows if r.kind == "flaky")
                await anyio.sleep(0.001)
        finally:
            await session.close()

    async with anyio.create_task_group() as tg:
        for n in range(8):
            tg.start_soon(claimer, n)
    assert len(taken) == 1, taken
    probe = await conn.fetchrow(
        f"SELECT breaker_limit, breaker_probe FROM {schema}.kind WHERE name = 'flaky'"
    )
    assert (probe["breaker_limit"], probe["breaker_probe"]) == (0, taken[0][0])
    # Still half-open while the probe runs, whatever the clock says.
    keeper.clock.advance(minutes=10)
    assert await _state(keeper, leading) == ("half_open", None)
    assert await _claim_flow(conn, q) == []


async def test_the_probe_s_success_closes_it_and_failures_before_do_not_count_again(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    keeper, probes = await _half_open_and_claim(conn, schema, leading)
    [probe] = probes
    await _complete(conn, q, [probe])
    assert await _claim_flow(conn, q) == []  # until the role has seen it
    assert await _state(keeper, leading) == ("closed", "closed")
    assert metrics.REGISTRY.get_sample_value("pgjobd_kind_breaker_state", {"kind": "flaky"}) == 0
    # Closed: the unlimited claim takes the kind again.
    assert not await q.queue_flow_get(conn, "q")
    jobs = [(r.id, r.fence) for r in await q.job_claim(conn, "q", 2, "m", LEASE)]
    assert len(jobs) == 2
    # The 3 failures that opened it are still in the window: they do not count again.
    await _fail(conn, q, jobs[:1])
    assert await _state(keeper, leading) == ("closed", None)
    await _fail(conn, q, jobs[1:])
    assert await _state(keeper, leading) == ("closed", None)


async def test_the_probe_s_failure_opens_it_again_for_another_cool_down(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    keeper, probes = await _half_open_and_claim(conn, schema, leading)
    [probe] = probes
    await _fail(conn, q, [probe])
    # Until the role has seen the probe's outcome, no other job of the kind starts
    # (the claim marked the probe taken: a limit of 1 running would let the next in).
    assert await _claim_flow(conn, q) == []
    [row] = await keeper.step(leading)
    assert (row.state, row.change, row.probe) == ("open", "opened", probe[0])
    before = await _attempts(conn, schema)
    assert await _claim_flow(conn, q) == []
    keeper.clock.advance(seconds=29)
    assert await _state(keeper, leading) == ("open", None)
    assert await _claim_flow(conn, q) == []
    assert await _attempts(conn, schema) == before
    keeper.clock.advance(seconds=2)
    assert await _state(keeper, leading) == ("half_open", "half_open")
    assert len(await _claim_flow(conn, q)) == 1


async def test_a_probe_that_ends_without_a_verdict_lets_another_one_run(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    keeper, probes = await _half_open_and_claim(conn, schema, leading)
    [(probe, _)] = probes
    # An operator cancels the running probe: its job leaves the hot table, cancelled.
    await conn.execute(
        f"WITH gone AS (DELETE FROM {schema}.job WHERE id = $1 RETURNING *) "
        f"INSERT INTO {schema}.job_history (id, run_at, enqueued_at, attempt, max_attempts, "
        f"priority, state, reason, queue, kind, args) "
        f"SELECT id, run_at, enqueued_at, attempt, max_attempts, priority, 'cancelled', "
        f"'cancelled', queue, kind, args FROM gone",
        probe,
    )
    assert await _state(keeper, leading) == ("half_open", "half_open")
    assert len(await _claim_flow(conn, q)) == 1


async def test_a_declaration_without_a_breaker_closes_it_and_one_with_keeps_its_state(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    keeper = await _open(conn, schema, leading)
    await q.kind_declare_many(conn, [_flaky()], "m2")  # the same breaker: still open
    assert await _state(keeper, leading) == ("open", None)
    await q.kind_declare_many(conn, [_flaky(failures=5)], "m2")  # another: still open
    assert await _state(keeper, leading) == ("open", None)
    await q.kind_declare_many(conn, [_flaky(breaker=False)], "m3")
    assert await keeper.step(leading) == []
    assert not await q.queue_flow_get(conn, "q")
    assert metrics.REGISTRY.get_sample_value("pgjobd_kind_breaker_state", {"kind": "flaky"}) is None
    assert len(await q.job_claim(conn, "q", 10, "m", LEASE)) == 9


async def test_a_lost_lease_is_not_the_kind_s_failure(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    db_now: datetime = await conn.fetchval("SELECT now()")
    keeper = BreakerKeeper(clock=FakeClock(db_now - timedelta(hours=1)))
    await _setup(conn, schema)
    jobs = await _claim_flow(conn, q, 3)
    await conn.execute(
        f"UPDATE {schema}.job SET lease_expires_at = now() - interval '1 s' WHERE owner = 'm'"
    )
    reaped = await q.job_reap_expired(conn, leading.term, timedelta(0), 100, [], 3)
    assert reaped.rescued == len(jobs)
    assert await _state(keeper, leading) == ("closed", None)


async def test_status_shows_each_breaker_and_its_state(
    dsn: str, conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    await q.kind_declare_many(conn, [KindDeclared("calm", "q", 0, 5, 60.0, None, None, None,
                                                  "[]", 5, timedelta(minutes=1), COOLDOWN)],
                              "m")  # fmt: skip
    await _open(conn, schema, leading)
    status = await admin.status(conn, schema)
    assert {k: (b.state, b.circuit_breaker, b.cooldown_s, b.probe)
            for k, b in status.breakers.items()} == {
        "calm": ("closed", "5/1m", 30.0, None),
        "flaky": ("open", "3/1m", 30.0, None),
    }  # fmt: skip
    assert status.breakers["calm"].since is None and status.breakers["flaky"].since is not None
    as_json = await pgjobd_json(dsn, schema, "status")
    assert as_json["breakers"]["flaky"]["state"] == "open"
    plain = await pgjobd(dsn, schema, "status")
    assert "circuit breakers: 2, 1 not closed" in plain.stdout
    lines = [line.split()[:2] for line in plain.stdout.splitlines()
             if line.startswith(("calm", "flaky"))]  # fmt: skip
    assert lines == [["calm", "CLOSED"], ["flaky", "OPEN"]]


async def test_a_deposed_leader_changes_no_breaker(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    db_now: datetime = await conn.fetchval("SELECT now()")
    keeper = BreakerKeeper(clock=FakeClock(db_now - timedelta(hours=1)))
    await _setup(conn, schema)
    await _fail(conn, q, await _claim_flow(conn, q, 3))
    await conn.execute(f"UPDATE {schema}.leader SET resigned_at = now() WHERE term = $1",
                       leading.term)  # fmt: skip
    with pytest.raises(Deposed):
        await keeper.step(leading)
    assert await conn.fetchval(
        f"SELECT breaker_limit FROM {schema}.kind WHERE name = 'flaky'"
    ) is None  # fmt: skip


async def test_a_probe_whose_member_died_is_no_verdict(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    keeper, probes = await _half_open_and_claim(conn, schema, leading)
    [(probe, _)] = probes
    await conn.execute(
        f"UPDATE {schema}.job SET lease_expires_at = now() - interval '1 s' WHERE id = $1",
        probe,
    )
    reaped = await q.job_reap_expired(conn, leading.term, timedelta(0), 100, [], 3)
    assert reaped.rescued == 1
    assert await _state(keeper, leading) == ("half_open", "half_open")
    assert len(await _claim_flow(conn, q)) == 1
