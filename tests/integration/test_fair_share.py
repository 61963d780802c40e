"""Per-tenant flow control on a real PostgreSQL (contract §9): `tenant_concurrency` held
by racing claimers and across a crash, and `fair = true` shares (stride scheduling in
job_claim_flow, migration 0014) measured in starts: by weight over a window, and the
bound on a newly waiting tenant's wait stated in docs/decisions.md."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from datetime import timedelta

import anyio
import asyncpg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from prometheus_client.parser import text_string_to_metric_families

from pgjobd import metrics
from pgjobd.config import QueueConfig
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.member.generations import write_queue_limits
from pgjobd.queries import Queries, for_schema
from pgjobd.roles import RoleContext
from pgjobd.roles.queue_stats import QueueStats
from pgjobd.statements.member import KindDeclared
from tests.captured_events import records_of
from tests.integration.test_flow_control import Fleet, _none_left, most_at_once

pytestmark = pytest.mark.anyio
LEASE = timedelta(seconds=30)


@pytest.fixture
def fleet(dsn: str, schema: str) -> Fleet:
    return Fleet(dsn, schema, for_schema(schema))


# The two ways a fair queue claims: by its jobs' tags, without the queue's lock, when
# fair is its only limit (migration 0024); by stride scheduling under the lock when it
# has another (here a tenant_concurrency that never binds).
FAIR_PATHS = {
    "tags": QueueConfig(fair=True),
    "strides": QueueConfig(fair=True, tenant_concurrency=1_000_000),
}


@pytest.fixture(params=sorted(FAIR_PATHS))
def fair(request: pytest.FixtureRequest) -> QueueConfig:
    config: QueueConfig = FAIR_PATHS[request.param]
    return config


async def _enqueue_many(
    conn: asyncpg.Connection, schema: str, queue: str, tenant: str | None, n: int,
    kind: str = "work", group: str | None = None,
) -> list[int]:  # fmt: skip
    rows = await conn.fetch(
        f"SELECT e.id FROM {schema}.enqueue_many("
        "kinds => array_fill($1::text, ARRAY[$4::integer]),"
        "args => array_fill('{}'::jsonb, ARRAY[$4::integer]),"
        "queues => array_fill($2::text, ARRAY[$4::integer]),"
        "tenants => array_fill($3::text, ARRAY[$4::integer]),"
        "group_keys => CASE WHEN $5::text IS NULL THEN NULL"
        "              ELSE array_fill($5::text, ARRAY[$4::integer]) END) AS e ORDER BY e.ord",
        kind, queue, tenant, n, group,
    )  # fmt: skip
    return [row["id"] for row in rows]


async def _claim(conn: asyncpg.Connection, q: Queries, queue: str, n: int) -> list[asyncpg.Record]:
    rows = await conn.fetch(q.sql("job_claim_flow"), queue, n, "m", LEASE, [])
    return [row for row in rows if row["id"] is not None]


async def _complete(conn: asyncpg.Connection, q: Queries, rows: list[asyncpg.Record]) -> None:
    if rows:
        await conn.fetch(
            q.sql("job_complete_many"), [r["id"] for r in rows], [r["fence"] for r in rows],
            [None] * len(rows), [True] * len(rows),
        )  # fmt: skip


def _tenant(row: asyncpg.Record) -> str:
    return row["tenant"] or ""


async def _starts_until(
    conn: asyncpg.Connection, q: Queries, job_id: int, *, within_s: float | None = None,
    pause_s: float = 0.0,
) -> list[int]:  # fmt: skip
    """Claims (and completes) queue f's jobs one at a time until `job_id` has started:
    the ids started, in order. `within_s`: fail if that takes longer."""
    began = anyio.current_time()
    started: list[int] = []
    while job_id not in started:
        if within_s is not None:
            assert anyio.current_time() - began < within_s, f"job {job_id} did not start"
        rows = await _claim(conn, q, "f", 1)
        started += [r["id"] for r in rows]
        await _complete(conn, q, rows)
        await anyio.sleep(pause_s)
    return started


async def test_tenant_concurrency_is_never_exceeded_by_racing_claimers(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    await write_queue_limits(conn, fleet.q, {"t": QueueConfig(tenant_concurrency=2)}, "m")
    tenant_of: dict[int, str] = {}
    for tenant in ("a", "b", None):
        for job_id in await _enqueue_many(conn, schema, "t", tenant, 25):
            tenant_of[job_id] = tenant or ""
    done = _none_left(conn, schema)
    async with anyio.create_task_group() as tg:
        for n in range(5):
            tg.start_soon(fleet.claim_and_finish, "t", f"member-{n}", done)
    assert len(fleet.runs) == 75
    by_tenant = defaultdict(list)
    for run in fleet.runs:
        by_tenant[tenant_of[run.id]].append(run)
    assert {t: most_at_once(runs) for t, runs in by_tenant.items()} == {"a": 2, "b": 2, "": 2}
    assert most_at_once(fleet.runs) > 2  # tenants are independent
    assert fleet.throttled > 0


async def test_a_crashed_claimers_jobs_count_against_their_tenant_until_reaped(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"t": QueueConfig(tenant_concurrency=2)}, "m")
    await _enqueue_many(conn, schema, "t", "a", 4)
    other = await _enqueue_many(conn, schema, "t", "b", 1)
    rows = await conn.fetch(q.sql("job_claim_flow"), "t", 10, "dead-member", LEASE, [])
    assert Counter(_tenant(r) for r in rows if r["id"]) == {"a": 2, "b": 1}
    assert [r["held_by"] for r in rows if r["id"] is None] == ["tenant_concurrency"]
    await conn.execute(
        f"UPDATE {schema}.job SET lease_expires_at = now() - interval '1s' WHERE state = 'running'"
    )
    rows = await conn.fetch(q.sql("job_claim_flow"), "t", 10, "live-member", LEASE, [])
    assert [r["held_by"] for r in rows] == ["tenant_concurrency"]
    leader = await asyncpg.connect(dsn)
    try:
        assert await leader.fetchval(
            "SELECT pg_try_advisory_lock($1, $2)", *lock_key(LEADER, schema)
        )
        term = await leader.fetchval(q.sql("leader_term_begin"), "test")
        reaped = await conn.fetchrow(
            q.sql("job_reap_expired"), term, timedelta(0), 10, [], [], 100, None
        )
    finally:
        await leader.close()
    assert reaped["rescued"] == 3
    rows = await _claim(conn, q, "t", 10)
    # The rescued jobs are back in line; at most 2 of a's run again.
    assert Counter(_tenant(r) for r in rows)["a"] == 2
    assert other[0] in [r["id"] for r in rows]


async def test_fair_shares_follow_the_weights_whatever_the_backlogs(
    conn: asyncpg.Connection, schema: str, fair: QueueConfig
) -> None:
    q = for_schema(schema)
    await write_queue_limits(
        conn, q, {"f": fair}, "m", tenants={"acme": 3}
    )  # fmt: skip
    await _enqueue_many(conn, schema, "f", "acme", 400)
    await _enqueue_many(conn, schema, "f", "beta", 2000)
    await _enqueue_many(conn, schema, "f", None, 150)
    starts: Counter[str] = Counter()
    for batch in [1, 7, 3, 10, 4] * 10:  # 250 starts
        rows = await _claim(conn, q, "f", batch)
        assert len(rows) == batch
        starts.update(_tenant(r) for r in rows)
        await _complete(conn, q, rows)
    total = sum(starts.values())
    shares = {t: n / total for t, n in starts.items()}
    assert shares["acme"] == pytest.approx(0.6, abs=0.02), shares
    assert shares["beta"] == pytest.approx(0.2, abs=0.02), shares
    assert shares[""] == pytest.approx(0.2, abs=0.02), shares


async def test_a_new_tenant_behind_a_big_backlog_starts_within_the_bound(
    conn: asyncpg.Connection, schema: str, fair: QueueConfig
) -> None:
    """docs/decisions.md: a tenant that starts waiting joins at the lowest pass, so its
    first job starts within T starts of the queue, T the number of waiting tenants."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": fair}, "m", tenants={"big": 5})
    await _enqueue_many(conn, schema, "f", "big", 10_000)
    for _ in range(20):
        await _complete(conn, q, await _claim(conn, q, "f", 3))
    (late,) = await _enqueue_many(conn, schema, "f", "late", 1)
    started = await _starts_until(conn, q, late)
    assert len(started) <= 2  # T = 2 waiting tenants
    # A third tenant, joining while both others wait: within T = 3 starts.
    (third,) = await _enqueue_many(conn, schema, "f", "third", 1)
    await _enqueue_many(conn, schema, "f", "late", 50)
    started = await _starts_until(conn, q, third)
    assert len(started) <= 3


async def _rescue(dsn: str, conn: asyncpg.Connection, q: Queries, job_id: int) -> None:
    """The reaper's rescue of `job_id`, its lease made to have expired."""
    await conn.execute(
        f"UPDATE {q.schema}.job SET lease_expires_at = now() - interval '1s' WHERE id = $1",
        job_id,
    )
    leader = await asyncpg.connect(dsn)
    try:
        assert await leader.fetchval(
            "SELECT pg_try_advisory_lock($1, $2)", *lock_key(LEADER, q.schema)
        )
        term = await leader.fetchval(q.sql("leader_term_begin"), "test")
        reaped = await conn.fetchrow(
            q.sql("job_reap_expired"), term, timedelta(0), 10, [], [], 100, None
        )
    finally:
        await leader.close()
    assert reaped["rescued"] == 1


async def test_a_tenant_whose_job_comes_back_rejoins_within_a_second(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """Migration 0022 (stride scheduling): the queue keeps the tenants its last claim
    left waiting, and a claim adds those whose new jobs it marks; a tenant dropped when
    it ran out, whose job then comes back by another path (here the reaper's rescue), is
    found by the scan that runs once the kept list is a second old: its job starts
    within about a second, while another tenant's backlog runs."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["strides"]}, "m")
    await _enqueue_many(conn, schema, "f", "a", 500)
    (returning,) = await _enqueue_many(conn, schema, "f", "b", 1)
    rows = await conn.fetch(q.sql("job_claim_flow"), "f", 4, "dead-member", LEASE, [])
    claimed = [r for r in rows if r["id"] is not None]
    assert returning in [r["id"] for r in claimed]
    await _complete(conn, q, [r for r in claimed if r["id"] != returning])
    # b ran out of available jobs: it is no longer kept as waiting.
    assert await conn.fetchval(f"SELECT fair_tenants FROM {schema}.queue WHERE name = 'f'") == ["a"]
    await _rescue(dsn, conn, q, returning)
    started = await _starts_until(conn, q, returning, within_s=1.5, pause_s=0.02)
    assert len(started) < 500  # a's backlog did not run out first


async def test_a_tenant_whose_job_comes_back_is_tagged_at_its_return(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """Migration 0024 (tags): a claimed job loses its tag; when it comes back (here the
    reaper's rescue) the next claim tags it as an arrival of its tenant, at the queue's
    virtual time, so it starts within the bound (T = 2 waiting tenants) and not with
    the tag it had, nor after the other tenant's backlog."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m")
    await _enqueue_many(conn, schema, "f", "a", 500)
    (returning,) = await _enqueue_many(conn, schema, "f", "b", 1)
    claimed = await _claim(conn, q, "f", 4)
    assert returning in [r["id"] for r in claimed]
    tag = await conn.fetchval(f"SELECT fair_tag FROM {schema}.job WHERE id = $1", returning)
    assert tag is None
    await _complete(conn, q, [r for r in claimed if r["id"] != returning])
    for _ in range(20):
        await _complete(conn, q, await _claim(conn, q, "f", 5))
    await _rescue(dsn, conn, q, returning)
    started = await _starts_until(conn, q, returning)
    assert len(started) <= 2


async def test_a_tenants_jobs_start_in_priority_order_without_moving_its_share(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Migration 0024 (tags): tags are given in arrival order, yet a tenant's urgent job
    enqueued behind its backlog starts at the tenant's next start, and the tenants'
    shares stay even (the job passed over takes the urgent one's tag)."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m")
    await _enqueue_many(conn, schema, "f", "a", 300)
    await _enqueue_many(conn, schema, "f", "b", 300)
    await conn.execute(f"UPDATE {schema}.job SET priority = 2")
    await _complete(conn, q, await _claim(conn, q, "f", 10))
    (urgent,) = await conn.fetchval(
        f"SELECT array_agg(id) FROM {schema}.enqueue_many(kinds => '{{work}}', "
        "args => '{\"{}\"}', queues => '{f}', tenants => '{a}', priorities => '{0}')"
    )
    first = await _claim(conn, q, "f", 2)
    assert Counter(_tenant(r) for r in first) == {"a": 1, "b": 1}
    assert urgent in [r["id"] for r in first]
    await _complete(conn, q, first)
    starts: Counter[str] = Counter()
    for _ in range(20):
        rows = await _claim(conn, q, "f", 5)
        starts.update(_tenant(r) for r in rows)
        await _complete(conn, q, rows)
    assert abs(starts["a"] - starts["b"]) <= 1, starts
    # Every job is still waiting once, and tagged: none was lost or doubled.
    waiting = await conn.fetch(
        f"SELECT fair_tenant, count(*) AS n, count(fair_tag) AS tagged, "
        f"count(DISTINCT fair_tag) AS tags FROM {schema}.job WHERE state = 'available' "
        "GROUP BY 1 ORDER BY 1"
    )
    assert [tuple(r) for r in waiting] == [("a", 245, 245, 245), ("b", 244, 244, 244)]


async def test_new_weights_apply_to_the_jobs_already_waiting(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Migration 0024 (tags): jobs are tagged as they arrive; a weight written while
    they wait re-spaces them, so the new shares hold from the next claims, not once the
    backlog tagged before has run."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m", tenants={})
    await _enqueue_many(conn, schema, "f", "a", 1000)
    await _enqueue_many(conn, schema, "f", "b", 1000)
    await _complete(conn, q, await _claim(conn, q, "f", 20))
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m", tenants={"a": 3})
    starts: Counter[str] = Counter()
    for _ in range(20):
        rows = await _claim(conn, q, "f", 5)
        starts.update(_tenant(r) for r in rows)
        await _complete(conn, q, rows)
    assert starts["a"] == pytest.approx(75, abs=2), starts


async def test_a_job_behind_a_burst_starts_once_the_fills_have_read_past_the_burst(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Migration 0024 (tags): a fill reads 2,000 new ids and tags at most 500 jobs of a
    tenant, the rest of its burst later from where it stopped; so a job enqueued just
    behind a burst of B jobs is tagged within B / 2,000 + 1 claims and then starts
    within the bound, while the burst's own jobs still start in their order."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m")
    burst = await _enqueue_many(conn, schema, "f", "big", 10_000)
    (late,) = await _enqueue_many(conn, schema, "f", "late", 1)
    started = await _starts_until(conn, q, late)
    assert len(started) <= 10_000 // 2_000 + 1 + 2
    for _ in range(250):
        rows = await _claim(conn, q, "f", 50)
        # (A claim's rows come back in no particular order.)
        started += sorted(r["id"] for r in rows if r["id"] != late)
        await _complete(conn, q, rows)
        if not rows:
            break
    assert [i for i in started if i != late] == burst  # every one, once, in order


async def test_a_burst_beyond_a_fills_share_keeps_its_order_and_the_shares_even(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Two tenants' bursts of 3,000, interleaved in id order with a third's: each is
    tagged across several fills, yet all 9,000 run once each, each tenant's in id order,
    and every 300 starts split evenly."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m")
    ids: dict[str, list[int]] = defaultdict(list)
    for _ in range(30):
        for tenant in ["a", "b", "c"]:
            ids[tenant] += await _enqueue_many(conn, schema, "f", tenant, 100)
    order: dict[str, list[int]] = defaultdict(list)
    window: Counter[str] = Counter()
    while True:
        rows = await _claim(conn, q, "f", 30)
        if not rows:
            break
        for row in sorted(rows, key=lambda r: r["id"]):
            order[_tenant(row)].append(row["id"])
            window[_tenant(row)] += 1
        if sum(window.values()) >= 300:
            assert max(window.values()) - min(window.values()) <= 3, window
            window.clear()
        await _complete(conn, q, rows)
    assert order == ids


async def test_a_job_the_look_back_missed_is_swept_up_within_a_second(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Migration 0024 (tags): a job whose id the fills passed before its transaction
    committed (here: the queue's marks moved past it) is neither marked nor tagged; the
    fill's once-a-second sweep of the queue's first available jobs tags it, so it runs
    (the claims by tag would never see it otherwise)."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m")
    await _enqueue_many(conn, schema, "f", "a", 200)
    (missed,) = await _enqueue_many(conn, schema, "f", "b", 1)
    await conn.execute(
        f"UPDATE {schema}.queue SET fair_scanned = $1, fair_settled = $1, "
        "fair_swept_at = now() WHERE name = 'f'",
        missed + 100_000,
    )
    # (The fill reads 2,000 ids back from the highest: beyond them.)
    await conn.execute(f"SELECT setval('{schema}.job_id_seq', $1)", missed + 200_000)
    await _enqueue_many(conn, schema, "f", "a", 1)
    swept_at = anyio.current_time()
    await _starts_until(conn, q, missed, within_s=2, pause_s=0.05)
    assert anyio.current_time() - swept_at > 0.9  # not before the sweep was due


async def test_a_stale_tag_is_passed_by_and_the_job_tagged_again(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """Migration 0024: a job back with a tag below the queue's clock (claimed by the
    stride path while the queue had another limit, and rescued after the queue went back
    to fair alone) is not claimed by that tag; the sweep tags it again, after its
    tenant's waiting jobs."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m")
    await _enqueue_many(conn, schema, "f", "a", 50)
    first = await _claim(conn, q, "f", 10)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["strides"]}, "m")
    (stale,) = [r["id"] for r in await _claim(conn, q, "f", 1)]
    tag = await conn.fetchval(f"SELECT fair_tag FROM {schema}.job WHERE id = $1", stale)
    assert tag is not None  # (the stride path leaves it)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m")
    await _complete(conn, q, first)
    await _complete(conn, q, await _claim(conn, q, "f", 5))
    assert await conn.fetchval(f"SELECT fair_clock FROM {schema}.queue") > tag
    await _rescue(dsn, conn, q, stale)
    await conn.execute(f"UPDATE {schema}.queue SET fair_swept_at = now()")
    assert stale not in [r["id"] for r in await _claim(conn, q, "f", 1)]
    await conn.execute(f"UPDATE {schema}.queue SET fair_swept_at = NULL")
    await _claim(conn, q, "f", 1)  # (its fill sweeps)
    retagged = await conn.fetchval(f"SELECT fair_tag FROM {schema}.job WHERE id = $1", stale)
    highest = await conn.fetchval(
        f"SELECT max(fair_tag) FROM {schema}.job WHERE id <> $1 AND state = 'available'", stale
    )
    assert retagged > highest


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@example(wanted=None, queue="\x00")  # (found by CI: a NUL is refused)
@given(
    wanted=st.none() | st.sampled_from([-(2**31), -1, 0, 1, 3, 2**31 - 1]),
    queue=st.sampled_from(["f", "", "unknown", "x" * 300]) | st.text(max_size=20),
)
async def test_a_fair_claim_takes_what_it_may_whatever_it_is_told(
    conn: asyncpg.Connection, schema: str, wanted: int | None, queue: str
) -> None:
    """job_claim_fair's inputs at their edges: a NULL, zero or negative limit takes
    nothing, a large one no more than is waiting; a queue that is not a fair-only one
    (unknown, empty, any text) gives nothing and tags nothing; a name PostgreSQL
    refuses (a NUL) is an error that claims nothing."""
    q = for_schema(schema)
    await conn.execute(f"TRUNCATE {schema}.job, {schema}.fair_finish")
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["tags"]}, "m")
    await _enqueue_many(conn, schema, "f", "a", 3)
    try:
        rows = await conn.fetch(q.sql("job_claim_fair"), queue, wanted, "m", LEASE)
    except asyncpg.CharacterNotInRepertoireError:
        assert "\x00" in queue  # PostgreSQL refuses a NUL in text: nothing claimed
        rows = []
    expected = min(wanted, 3) if queue == "f" and wanted is not None and wanted > 0 else 0
    assert len(rows) == expected
    running = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE state = 'running'")
    assert running == expected
    if queue != "f":
        assert not await conn.fetchval(
            f"SELECT count(*) FROM {schema}.job WHERE fair_tag IS NOT NULL"
        )


async def test_a_fair_claim_takes_every_job_it_has_room_for_when_a_tenant_runs_short(
    conn: asyncpg.Connection, schema: str, fair: QueueConfig
) -> None:
    """Regression (found by the state machine's CI run at 86ace00): after a tenant's
    backlog ran out (c, still listed as waiting), two tenants arrive with 1 and 2 jobs
    and a claim of 3 came back with 2 on the strides path, the third left for the next
    claim (migration 0027)."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": fair}, "m")
    await _enqueue_many(conn, schema, "f", "c", 2)
    for _ in range(2):
        await _complete(conn, q, await _claim(conn, q, "f", 1))
    await _enqueue_many(conn, schema, "f", "a", 1)
    await _enqueue_many(conn, schema, "f", "b", 2)
    # (The strides path keeps its list of waiting tenants for a second: as fresh as the
    # claims just made, however slow the machine.)
    await conn.execute(f"UPDATE {schema}.queue SET fair_tenants_at = now() WHERE name = 'f'")
    rows = await _claim(conn, q, "f", 3)
    assert Counter(_tenant(r) for r in rows) == {"a": 1, "b": 2}


async def test_a_fair_claim_passes_tenants_kept_waiting_that_have_no_jobs_left(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Migration 0027 (strides): tenants whose last job a claim took in full stay in the
    queue's list of waiting tenants for a second; three of them at the lowest pass used
    up a claim's 3 rounds, one each, and a claim of 1 with f's 2 jobs waiting came back
    empty. The last round gives the room to the tenants still waiting."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": FAIR_PATHS["strides"]}, "m")
    for tenant in ["c", "d", "e"]:
        await _enqueue_many(conn, schema, "f", tenant, 1)
    for _ in range(3):
        await _complete(conn, q, await _claim(conn, q, "f", 1))
    await _enqueue_many(conn, schema, "f", "f", 2)
    # (The list is kept for a second: as fresh as the claims just made.)
    await conn.execute(f"UPDATE {schema}.queue SET fair_tenants_at = now() WHERE name = 'f'")
    kept = await conn.fetchval(f"SELECT fair_tenants FROM {schema}.queue WHERE name = 'f'")
    assert kept == ["c", "d", "e"]
    rows = await _claim(conn, q, "f", 1)
    assert [_tenant(r) for r in rows] == ["f"]
    # The tenants that came up short are no longer kept (f is, as c was: it came up
    # short in no round); f was charged its starts from the pass it joined at.
    kept = await conn.fetchval(f"SELECT fair_tenants FROM {schema}.queue WHERE name = 'f'")
    assert kept == ["f"]
    passes = dict(await conn.fetch(f"SELECT tenant, pass FROM {schema}.fair_pass"))
    assert passes.get("f") == 2.0


async def test_a_queue_made_fair_on_an_empty_table_marks_new_jobs_at_once(
    conn: asyncpg.Connection, schema: str, fair: QueueConfig
) -> None:
    """Regression (issue 12, migration 0018): made fair while the job table was empty
    and ids were past 50,000, the claims marked from id 0 at 10,000 ids a claim; the
    jobs meanwhile ran unmarked in queue order, charged to their tenant (a: 50 of the
    first 50 starts, then none)."""
    q = for_schema(schema)
    await conn.execute(f"SELECT setval('{schema}.job_id_seq', 50000)")
    await write_queue_limits(conn, q, {"f": fair}, "m")
    for tenant in ["a", "b", "c", "d", "e"]:
        await _enqueue_many(conn, schema, "f", tenant, 100)
    starts: Counter[str] = Counter()
    for _ in range(10):
        rows = await _claim(conn, q, "f", 10)
        starts.update(_tenant(r) for r in rows)
        await _complete(conn, q, rows)
    assert starts == {t: 20 for t in "abcde"}


async def test_a_tenant_with_a_trickle_of_jobs_banks_no_share(
    conn: asyncpg.Connection, schema: str, fair: QueueConfig
) -> None:
    """Regression (issue 12, migration 0018): a tenant that ran out of jobs in each claim
    kept its pass while the rest of its share went to the others, and fair_vtime stayed
    at its pass; after 20 claims it was 120 starts behind and, once backlogged, took the
    next 60 starts alone. Idle time is not banked: it rejoins at the others' pass."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"f": fair}, "m")
    await _enqueue_many(conn, schema, "f", "x", 500)
    for _ in range(20):
        await _enqueue_many(conn, schema, "f", "y", 1)
        rows = await _claim(conn, q, "f", 8)
        assert Counter(_tenant(r) for r in rows) == {"x": 7, "y": 1}
        await _complete(conn, q, rows)
    await _enqueue_many(conn, schema, "f", "y", 500)
    starts: Counter[str] = Counter()
    for _ in range(6):
        rows = await _claim(conn, q, "f", 10)
        starts.update(_tenant(r) for r in rows)
        await _complete(conn, q, rows)
    assert abs(starts["x"] - starts["y"]) <= 2, starts


async def test_a_queue_that_becomes_fair_marks_its_jobs_and_unmarked_ones_still_run(
    conn: asyncpg.Connection, schema: str
) -> None:
    q = for_schema(schema)
    before = await _enqueue_many(conn, schema, "f", "a", 3)
    grouped = await _enqueue_many(conn, schema, "f", "a", 2, group="g")
    await write_queue_limits(conn, q, {"f": QueueConfig(fair=True)}, "m")
    marked = dict(await conn.fetch(f"SELECT id, fair_tenant FROM {schema}.job"))
    assert [marked[i] for i in before] == ["a"] * 3
    assert [marked[i] for i in grouped] == [None, None]  # groups keep their own order
    # A job the claims did not mark (a transaction that outlived their look-back) runs
    # once the fair picks leave room.
    (missed,) = await _enqueue_many(conn, schema, "f", "b", 1)
    await conn.execute(
        f"UPDATE {schema}.queue SET fair_scanned = $1, fair_settled = $1 WHERE name = 'f'",
        missed + 100_000,
    )
    rows = await _claim(conn, q, "f", 10)
    assert sorted(r["id"] for r in rows) == sorted([*before, grouped[0], missed])
    await _complete(conn, q, rows)
    assert [r["id"] for r in await _claim(conn, q, "f", 10)] == [grouped[1]]


async def test_groups_and_kind_limits_still_hold_in_a_fair_queue(
    conn: asyncpg.Connection, schema: str, fleet: Fleet
) -> None:
    q = fleet.q
    await q.kind_declare_many(
        conn, [KindDeclared("capped", "f", 0, 20, 60.0, 1, None, None, "[]")], "m"
    )
    await write_queue_limits(conn, q, {"f": QueueConfig(fair=True, tenant_concurrency=3)}, "m")
    group_ids = await _enqueue_many(conn, schema, "f", "a", 6, group="g")
    await _enqueue_many(conn, schema, "f", "a", 10, kind="capped")
    await _enqueue_many(conn, schema, "f", "b", 20)
    done = _none_left(conn, schema)
    async with anyio.create_task_group() as tg:
        for n in range(3):
            tg.start_soon(fleet.claim_and_finish, "f", f"member-{n}", done)
    assert len(fleet.runs) == 36
    grouped = sorted((r for r in fleet.runs if r.group == "g"), key=lambda r: r.start)
    assert [r.id for r in grouped] == group_ids and most_at_once(grouped) == 1
    assert most_at_once([r for r in fleet.runs if r.kind == "capped"]) == 1


async def test_weights_disagreeing_members_last_writer_wins_and_it_is_logged(
    conn: asyncpg.Connection, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    q = for_schema(schema)
    fair = {"f": QueueConfig(fair=True)}
    await write_queue_limits(conn, q, fair, "member-a", tenants={"acme": 3, "beta": 2})
    with caplog.at_level("WARNING"):
        await write_queue_limits(conn, q, fair, "member-b", tenants={"acme": 5})
    weights = dict(await conn.fetch(f"SELECT tenant, weight FROM {schema}.tenant_weight"))
    assert weights == {"acme": 5}
    events = records_of(caplog, "flow.weights_disagree")
    assert sorted(r.tenant for r in events) == ["acme", "beta"]  # type: ignore[attr-defined]
    # A member with neither [tenants] nor a fair queue leaves the weights alone.
    await write_queue_limits(conn, q, {"other": QueueConfig()}, "member-c")
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.tenant_weight") == 1


async def test_queue_jobs_breaks_down_by_tenant_only_where_fair_or_capped(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    """Issue 12 item 7: pgjobd_queue_jobs gains a tenant label in queues with fair or
    tenant_concurrency only, bounded to the TENANTS_SHOWN tenants with most live jobs
    and the rest summed as OTHER_TENANTS; read back from the exposition the leader's
    queue_stats role sets."""
    q = leading.queries
    await write_queue_limits(
        conn, q, {"f": QueueConfig(fair=True), "c": QueueConfig(tenant_concurrency=1),
                  "plain": QueueConfig()}, "m",
    )  # fmt: skip
    for n in range(25):  # t00 has 1 job ... t24 has 25
        await _enqueue_many(conn, schema, "f", f"t{n:02}", n + 1)
    await _enqueue_many(conn, schema, "f", None, 30)
    await _enqueue_many(conn, schema, "c", "a", 3)
    await _enqueue_many(conn, schema, "plain", "a", 4)
    running = await _claim(conn, q, "c", 5)  # a: 1 running (its cap), 2 available
    assert len(running) == 1
    await QueueStats().tick(leading)
    (family,) = [
        f for f in text_string_to_metric_families(metrics.exposition().decode())
        if f.name == "pgjobd_queue_jobs"
    ]  # fmt: skip
    series = {tuple(sorted(s.labels.items())): s.value for s in family.samples}

    def of(queue: str) -> dict[tuple[str | None, str], float]:
        return {
            (dict(k).get("tenant"), dict(k)["state"]): v
            for k, v in series.items() if dict(k)["queue"] == queue
        }  # fmt: skip

    plain = of("plain")
    assert plain[(None, "available")] == 4 and {t for t, _ in plain} == {None}
    assert of("c") == {
        **{("a", s): 0 for s in metrics.QUEUE_STATES}, ("a", "available"): 2,
        ("a", "running"): 1,
    }  # fmt: skip
    fair = of("f")
    assert {state for _, state in fair} == set(metrics.QUEUE_STATES)
    shown = {t for t, _ in fair} - {metrics.OTHER_TENANTS}
    assert len(shown) == metrics.TENANTS_SHOWN == 20
    # The most live jobs first: "" (30), t24 (25) ... t06 (7); t00..t05 are the rest.
    assert shown == {"", *(f"t{n:02}" for n in range(6, 25))}
    assert fair[("", "available")] == 30 and fair[("t24", "available")] == 25
    assert fair[(metrics.OTHER_TENANTS, "available")] == sum(range(1, 7))
    assert sum(v for (_, s), v in fair.items() if s == "available") == 30 + sum(range(1, 26))
    # The next reading replaces every series: a queue whose jobs are gone shows zeros.
    await conn.execute(f"DELETE FROM {schema}.job WHERE queue = 'c'")
    await QueueStats().tick(leading)
    assert metrics.REGISTRY.get_sample_value(
        "pgjobd_queue_jobs", {"queue": "c", "state": "available", "tenant": "a"}
    ) is None  # fmt: skip


class FairQueue(RuleBasedStateMachine):
    """Tenants arrive with jobs and leave (their jobs all run), weights change through the
    member's write, claims of random sizes start and complete jobs. No tenant that keeps
    waiting goes without a start for longer than the stride bound, however the others'
    backlogs and weights move."""

    dsn: str
    schema: str
    config: QueueConfig

    def __init__(self) -> None:
        super().__init__()
        self.q = for_schema(self.schema)
        self.conn: asyncpg.Connection = anyio.from_thread.run(asyncpg.connect, self.dsn)
        anyio.from_thread.run(self.conn.execute, f"DELETE FROM {self.schema}.job")
        anyio.from_thread.run(self.conn.execute, f"DELETE FROM {self.schema}.fair_pass")
        anyio.from_thread.run(self.conn.execute, f"DELETE FROM {self.schema}.queue")
        self.weights: dict[str, int] = {}
        anyio.from_thread.run(self._write_weights)
        self.waiting: Counter[str] = Counter()  # available jobs per tenant
        self.since_start: dict[str, int] = {}  # others' starts since it last started
        self.max_weight_seen = 1

    async def _write_weights(self) -> None:
        await write_queue_limits(self.conn, self.q, {"f": self.config}, "m", tenants=self.weights)

    def teardown(self) -> None:
        anyio.from_thread.run(self.conn.close)

    @rule(tenant=st.sampled_from(["a", "b", "c", "d", ""]), n=st.integers(1, 40))
    def arrive(self, tenant: str, n: int) -> None:
        anyio.from_thread.run(_enqueue_many, self.conn, self.schema, "f", tenant or None, n)
        if not self.waiting[tenant]:
            self.since_start[tenant] = 0
        self.waiting[tenant] += n

    @rule(weights=st.dictionaries(st.sampled_from(["a", "b", "c", "d", ""]), st.integers(1, 3)))
    def reweigh(self, weights: dict[str, int]) -> None:
        self.weights = weights
        self.max_weight_seen = max([self.max_weight_seen, *weights.values()])
        anyio.from_thread.run(self._write_weights)

    @rule(n=st.integers(1, 8))
    def claim(self, n: int) -> None:
        async def claim_and_complete() -> list[str]:
            rows = await _claim(self.conn, self.q, "f", n)
            await _complete(self.conn, self.q, rows)
            return [_tenant(r) for r in rows]

        tenants = anyio.from_thread.run(claim_and_complete)
        assert len(tenants) == min(n, sum(self.waiting.values()))
        # A claim's rows come back in no particular order: count in whole claims (a
        # tenant that started in this one, anywhere, has waited 0 starts).
        started = Counter(tenants)
        for tenant in tenants:
            self.waiting[tenant] -= 1
            assert self.waiting[tenant] >= 0
        for tenant in self.since_start:
            self.since_start[tenant] = (
                0 if started[tenant] else self.since_start[tenant] + len(tenants)
            )
        for tenant in [t for t in self.since_start if not self.waiting[t]]:
            del self.since_start[tenant]

    @rule()
    def window(self) -> None:
        """With every tenant backlogged, shares converge: the 60 starts after a margin of
        60 split by weight within a few starts each. (Before migration 0018 a history
        could leave one tenant's pass far from the others', and even the margin did not
        help: 4 or 20 of 60 starts for one of five equal tenants; see docs/decisions.md.
        Without the margin, 100 examples passed on 0018.)"""
        for tenant in ["a", "b", "c", "d", ""]:
            if self.waiting[tenant] < 160:
                self.arrive(tenant, 160 - self.waiting[tenant])
        for n in [10, 10, 10, 10, 10, 10]:  # the margin
            self.claim(n)
        before = Counter({t: 0 for t in self.waiting})
        starts: Counter[str] = Counter()
        for n in [7, 3, 10, 8, 2, 10, 10, 10]:  # 60
            waiting = Counter(self.waiting)
            self.claim(n)
            starts.update(waiting - self.waiting)
        total_weight = sum(self.weights.get(t, 1) for t in before)
        for tenant in before:
            expected = 60 * self.weights.get(tenant, 1) / total_weight
            assert abs(starts[tenant] - expected) <= 5, (tenant, starts, self.weights)

    @invariant()
    def no_waiting_tenant_starves(self) -> None:
        # Each other tenant starts at most ceil(w_other / w_self) + 1 times between two
        # starts of a tenant that keeps waiting (weights 1..max_weight_seen, 5 tenants).
        bound = 4 * (self.max_weight_seen + 1)
        for tenant, others in self.since_start.items():
            assert others <= bound, (tenant, others, dict(self.waiting))


# Hypothesis shrinks a failing example for up to 300 s (its MAX_SHRINKING_SECONDS): the
# suite's 120 s stopped it mid-shrink in CI, without the example (86ace00).
@pytest.mark.timeout(480)
async def test_fair_share_state_machine(dsn: str, schema: str, fair: QueueConfig) -> None:
    FairQueue.dsn, FairQueue.schema, FairQueue.config = dsn, schema, fair
    FairQueue.TestCase.settings = settings(
        max_examples=int(os.environ.get("PGJOBD_FAIR_EXAMPLES", "15")),
        stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )  # fmt: skip
    await anyio.to_thread.run_sync(FairQueue.TestCase().runTest)


async def test_an_unfair_queue_claims_as_before_and_marks_nothing(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Regression guard: only a fair queue's claims mark jobs or keep passes; a queue
    with limits but no fair keeps 0013's order (priority, run_at, id) across tenants."""
    q = for_schema(schema)
    await write_queue_limits(conn, q, {"l": QueueConfig(global_concurrency=50)}, "m")
    first = await _enqueue_many(conn, schema, "l", "a", 5)
    second = await _enqueue_many(conn, schema, "l", "b", 5)
    free = await _enqueue_many(conn, schema, "free", "a", 3)
    assert [r["id"] for r in await _claim(conn, q, "l", 7)] == [*first, *second[:2]]
    assert [r.id for r in await q.job_claim(conn, "free", 10, "m", LEASE)] == free
    assert not await conn.fetchval(
        f"SELECT count(*) FROM {schema}.job WHERE fair_tenant IS NOT NULL"
    )
    assert not await conn.fetchval(f"SELECT count(*) FROM {schema}.fair_pass")
