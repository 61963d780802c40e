"""The reaper against completions, in every order hypothesis can think of: whatever the
interleaving, a job ends with exactly one final record, written by the holder of the
current fence; a stale completion or failure changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd import fingerprint
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.queries import Queries, for_schema
from pgjobd.statements.job import CompleteRow, FailRow

pytestmark = pytest.mark.anyio
LEASE = timedelta(seconds=30)
STEPS = ["complete_a", "fail_a", "expire_and_reap", "claim_b", "complete_b", "reap"]


class World:
    def __init__(self, conn: asyncpg.Connection, q: Queries, term: int):
        self.conn, self.q, self.term = conn, q, term

    async def claim(self, member: str) -> int | None:
        rows = await self.q.job_claim(self.conn, "races", 1, member, LEASE)
        return rows[0].fence if rows else None

    async def complete(self, job_id: int, fence: int | None) -> bool:
        if fence is None:
            return False
        rows = await self.q.job_complete_many(self.conn, [CompleteRow(job_id, fence, "1", True)])
        return bool(rows)

    async def fail(self, job_id: int, fence: int | None) -> bool:
        if fence is None:
            return False
        row = FailRow(job_id, fence, "failed", 100, timedelta(0), "E", "boom", None, 0.1, True)
        return bool(await self.q.job_fail_many(self.conn, [row], "member-a"))

    async def reap(self, expire: bool, job_id: int) -> int:
        if expire:
            await self.conn.execute(
                f"UPDATE {self.q.schema}.job SET lease_expires_at = now() - interval '1 second' "
                "WHERE id = $1 AND state = 'running'",
                job_id,
            )
        # lease 0: the term has lasted long enough to reap
        reaped = await self.q.job_reap_expired(self.conn, self.term, timedelta(0), 10, [], 100)
        return reaped.rescued + reaped.died


@pytest.fixture
async def world(dsn: str, conn: asyncpg.Connection, schema: str) -> AsyncIterator[World]:
    session = await asyncpg.connect(dsn)
    key = lock_key(LEADER, schema)
    assert await session.fetchval("SELECT pg_try_advisory_lock($1, $2)", *key)
    q = for_schema(schema)
    try:
        yield World(conn, q, await q.leader_term_begin(session, "test"))
    finally:
        await session.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(order=st.permutations(STEPS))
async def test_any_interleaving_leaves_exactly_one_final_record(
    world: World, schema: str, order: list[str]
) -> None:
    conn = world.conn
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('k', queue => 'races')")
    fence_a = await world.claim("member-a")
    fence_b: int | None = None
    finished_by: str | None = None

    for step in order:
        current = await conn.fetchval(f"SELECT fence FROM {schema}.job WHERE id = $1", job_id)
        if step == "complete_a":
            done = await world.complete(job_id, fence_a)
            assert done == (fence_a is not None and fence_a == current)
            finished_by = finished_by or ("member-a" if done else None)
        elif step == "fail_a":
            failed = await world.fail(job_id, fence_a)
            assert failed == (fence_a is not None and fence_a == current)
        elif step in ("expire_and_reap", "reap"):
            await world.reap(step == "expire_and_reap", job_id)
        elif step == "claim_b":
            fence_b = await world.claim("member-b")
        elif step == "complete_b":
            done = await world.complete(job_id, fence_b)
            assert done == (fence_b is not None and fence_b == current)
            finished_by = finished_by or ("member-b" if done else None)

    live = await conn.fetchval(f"SELECT count(*) FROM {schema}.job WHERE id = $1", job_id)
    final = await conn.fetch(f"SELECT owner FROM {schema}.job_history WHERE id = $1", job_id)
    assert live + len(final) == 1  # a job is live or has one final record, never both
    if final:
        assert final[0]["owner"] == finished_by
    await conn.execute(f"DELETE FROM {schema}.job WHERE id = $1", job_id)


async def test_lost_leases_of_different_members_share_one_fingerprint(
    world: World, schema: str
) -> None:
    """Regression: through 8d5da03 the reaper's lease_expired attempts had no
    fingerprint, so `dlq list` grouped every job that died of lost leases under none."""
    conn = world.conn
    ids = [await conn.fetchval(f"SELECT {schema}.enqueue('k', queue => 'races', "
                               "max_attempts => 1)") for _ in range(2)]  # fmt: skip
    for member in ("member-a", "host-b:4242"):
        assert await world.claim(member) is not None
    for job_id in ids:
        assert await world.reap(True, job_id) == 1
    rows = await conn.fetch(
        f"SELECT member, fingerprint FROM {schema}.job_attempt WHERE outcome = 'lease_expired'"
    )
    assert {r["member"] for r in rows} == {"member-a", "host-b:4242"}
    assert {r["fingerprint"] for r in rows} == {fingerprint.LEASE_EXPIRED}
    [group] = await world.q.admin_dlq_groups(conn, None, None, None)
    assert (group.fingerprint, group.jobs) == (fingerprint.LEASE_EXPIRED, 2)
    # ...kept on the final records (migration 0019), which `dlq list` groups by.
    kept = await conn.fetch(f"SELECT fingerprint FROM {schema}.job_history WHERE state = 'dead'")
    assert [r["fingerprint"] for r in kept] == [fingerprint.LEASE_EXPIRED] * 2
