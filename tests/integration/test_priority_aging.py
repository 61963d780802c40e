"""Priority aging (roles/priority_ager.py, job_priorities_age): a steady stream of urgent
jobs delays the others but never starves them; each step moves only the oldest few of
each priority below the top, never past the top, and never a job of an ordered group."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd.config import Config, ConfigError, DatabaseConfig, Duration, QueueConfig, loads
from pgjobd.queries import for_schema
from pgjobd.roles import RoleContext
from pgjobd.roles.priority_ager import PriorityAger

pytestmark = pytest.mark.anyio
LEASE = timedelta(seconds=30)


async def _enqueue(conn: asyncpg.Connection, schema: str, priority: int, *,
                   group: str | None = None, waited_s: float = 0.0) -> int:  # fmt: skip
    job_id: int = await conn.fetchval(
        f"SELECT {schema}.enqueue('work', '{{}}', queue => 'q', priority => $1::integer, "
        "group_key => $2::text)",
        priority, group,
    )  # fmt: skip
    if waited_s:
        await conn.execute(
            f"UPDATE {schema}.job SET run_at = now() - make_interval(secs => $2) WHERE id = $1",
            job_id, waited_s,
        )  # fmt: skip
    return job_id


def _aging(ctx: RoleContext, every: str) -> RoleContext:
    config = Config(database=DatabaseConfig(schema=ctx.config.database.schema),
                    queues={"q": QueueConfig(priority_aging=Duration.parse(every))})  # fmt: skip
    return dataclasses.replace(ctx, config=config)


async def _drain_rounds(
    conn: asyncpg.Connection, schema: str, waiting: int, rounds: int, ager: PriorityAger | None,
    ctx: RoleContext,
) -> int | None:  # fmt: skip
    """Each round: 3 new urgent jobs arrive, an aging step (if any), a claim of 3. The
    round in which `waiting` was claimed, or None."""
    q = for_schema(schema)
    for round_no in range(1, rounds + 1):
        for _ in range(3):
            await _enqueue(conn, schema, 0)
        if ager is not None:
            ager._aged_at.clear()  # each round stands for one aging interval
            await ager.tick(ctx)
        claimed = await q.job_claim(conn, "q", 3, "m", LEASE)
        if waiting in {job.id for job in claimed}:
            return round_no
    return None


async def test_a_steady_stream_of_urgent_jobs_starves_a_low_one_without_aging_but_not_with_it(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    low = await _enqueue(conn, schema, 3, waited_s=5)
    assert await _drain_rounds(conn, schema, low, 10, None, leading) is None
    # With aging every 1s (each round moves it up one step): 3 steps to the top, where
    # it is the oldest, so it starts in the round that brings it there.
    ctx = _aging(leading, "1s")
    assert await _drain_rounds(conn, schema, low, 10, PriorityAger(), ctx) == 3


async def test_aging_moves_the_oldest_of_each_priority_below_the_top_one_step(
    conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    q = for_schema(schema)
    top = await _enqueue(conn, schema, -5, waited_s=60)
    old = [await _enqueue(conn, schema, 2, waited_s=60 - n) for n in range(4)]
    fresh = await _enqueue(conn, schema, 2)
    grouped = await _enqueue(conn, schema, 7, group="g", waited_s=60)
    async with leading.pool.acquire() as session:
        moved = await q.job_priorities_age(session, "q", timedelta(seconds=30), 3)
    assert moved == 3
    priorities = dict(await conn.fetch(f"SELECT id, priority FROM {schema}.job"))
    assert [priorities[i] for i in old] == [1, 1, 1, 2]  # the 3 oldest
    assert priorities[fresh] == 2  # has not waited 30 s
    assert priorities[top] == -5 and priorities[grouped] == 7


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    jobs=st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 120), st.booleans()),
                  min_size=1, max_size=25),
    per_priority=st.integers(1, 4),
)  # fmt: skip
async def test_one_aging_step_matches_its_rule(
    conn: asyncpg.Connection, schema: str, leading: RoleContext,
    jobs: list[tuple[int, int, bool]], per_priority: int,
) -> None:  # fmt: skip
    """Whatever the jobs: the top priority and grouped jobs stay; of each other priority,
    the `per_priority` oldest that waited 60 s move up exactly one step."""
    await conn.execute(f"DELETE FROM {schema}.job")
    ids = {}
    for n, (priority, waited_s, grouped) in enumerate(jobs):
        group = f"g{n}" if grouped else None
        ids[await _enqueue(conn, schema, priority, group=group, waited_s=waited_s)] = (
            priority, waited_s, grouped,
        )  # fmt: skip
    rows = await conn.fetch(f"SELECT id, priority, run_at FROM {schema}.job ORDER BY id")
    top = min(r["priority"] for r in rows)
    expected = {r["id"]: r["priority"] for r in rows}
    for level in {r["priority"] for r in rows} - {top}:
        eligible = sorted(
            (r for r in rows if r["priority"] == level and not ids[r["id"]][2]
             and ids[r["id"]][1] >= 60),
            key=lambda r: (r["run_at"], r["id"]),
        )  # fmt: skip
        for r in eligible[:per_priority]:
            expected[r["id"]] = level - 1
    async with leading.pool.acquire() as session:
        # 59.5 s: jobs enqueued "now" took a moment; only those set back 60 s or more
        # are old enough.
        await for_schema(schema).job_priorities_age(
            session, "q", timedelta(seconds=59.5), per_priority
        )
    assert dict(await conn.fetch(f"SELECT id, priority FROM {schema}.job")) == expected


@pytest.mark.parametrize("value", ['"0s"', '"500ms"', '"2d"', '"-1s"', '"soon"', "5"])
def test_priority_aging_out_of_range_or_malformed_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ConfigError, match="priority_aging"):
        loads(f"[queues.q]\npriority_aging = {value}\n", Path("pgjobd.toml"))
