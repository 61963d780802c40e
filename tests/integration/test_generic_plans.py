"""The member's pool plans each prepared statement once per session (issue 17):
PostgreSQL's default planned job_claim anew at every claim, for its LIMIT and cursor
values. Read back from the session itself: the setting, and the plans its claims got.
And it prepares the job path's statements on each connection it opens, before the first
claim there."""

from __future__ import annotations

from datetime import timedelta

import asyncpg
import pytest

from pgjobd import Client, db
from pgjobd.config import Config, DatabaseConfig
from pgjobd.daemon import create_member_pool
from pgjobd.queries import Queries, for_schema
from pgjobd.statements.job import ClaimKey

pytestmark = pytest.mark.anyio

CLAIMS = 8  # past the five custom plans a default session makes before it compares


async def _claims_plans(dsn: str, schema: str, *, generic_plans: bool) -> tuple[str, int, int]:
    """plan_cache_mode in a pool's session, and the generic and custom plans job_claim
    got there over CLAIMS claims that each move the cursor on."""
    client = await Client.connect(dsn, schema=schema, max_size=1)
    try:
        await client.enqueue_many([("k", {"i": i}) for i in range(CLAIMS * 3)])
    finally:
        await client.close()
    config = Config(database=DatabaseConfig(schema=schema), dsn=dsn)
    pool = await db.create_pool(config, max_size=1, generic_plans=generic_plans)
    q = for_schema(schema)
    try:
        async with db.acquire(pool) as conn:
            after: ClaimKey | None = None  # as the producer's cursor moves on
            for _ in range(CLAIMS):
                rows = await q.job_claim(
                    conn, "default", 3, "m", timedelta(minutes=1), *(after or (None,) * 3)
                )
                assert len(rows) == 3
                after = max(ClaimKey.of(row) for row in rows)
            mode = await conn.fetchval("SHOW plan_cache_mode")
            plans = await conn.fetchrow(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement = $1",
                q.sql("job_claim"),
            )
    finally:
        await pool.close()
    assert plans is not None, "job_claim was not a prepared statement of the session"
    return mode, plans["generic_plans"], plans["custom_plans"]


async def test_the_members_pool_plans_the_claim_once_for_any_parameters(
    dsn: str, schema: str
) -> None:
    mode, generic, custom = await _claims_plans(dsn, schema, generic_plans=True)
    assert mode == "force_generic_plan"
    assert (generic, custom) == (CLAIMS, 0)


async def test_other_pools_keep_postgresqls_default(dsn: str, schema: str) -> None:
    mode, generic, custom = await _claims_plans(dsn, schema, generic_plans=False)
    assert mode == "auto"
    # PostgreSQL's default: the first five executions are planned for their values.
    assert custom >= 5
    assert generic + custom == CLAIMS


# The statements a member's pool prepares on each connection before its first use
# (pgjobd.daemon.job_path_warmer).
WARMED = ("queue_claim_path_get", "job_claim", "job_available_behind", "job_complete_many")


async def _members_pool(dsn: str, schema: str) -> asyncpg.Pool:
    """A pool made as the member makes its own, opening two connections at once."""
    config = Config(database=DatabaseConfig(schema=schema, pool_min=2, pool_max=2), dsn=dsn)
    return await create_member_pool(config)


async def _prepared(conn: asyncpg.Connection, q: Queries) -> dict[str, tuple[int, int]]:
    """The warmed statements prepared in conn's session: their generic and custom plans."""
    rows = await conn.fetch(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
        "WHERE statement = ANY($1::text[])",
        [q.sql(name) for name in WARMED],
    )
    names = {q.sql(name): name for name in WARMED}
    return {names[row["statement"]]: (row["generic_plans"], row["custom_plans"]) for row in rows}


async def test_each_connection_of_the_members_pool_has_the_job_path_planned_before_its_first_use(
    dsn: str, schema: str
) -> None:
    client = await Client.connect(dsn, schema=schema, max_size=1)
    try:
        job_id = await client.enqueue("k", {})
    finally:
        await client.close()
    q = for_schema(schema)
    pool = await _members_pool(dsn, schema)
    try:
        async with db.acquire(pool) as first, db.acquire(pool) as second:
            assert first is not second
            for conn in (first, second):
                # Each run once, planned for any parameters, before anything used it.
                assert await _prepared(conn, q) == {name: (1, 0) for name in WARMED}
            # Run with arguments that match nothing: the job was not claimed.
            state = await first.fetchval(
                f"SELECT state::text FROM {schema}.job WHERE id = $1", job_id
            )
            assert state == "available"
    finally:
        await pool.close()


async def test_a_members_pool_on_a_schema_not_migrated_yet_opens_and_its_connections_work(
    dsn: str,
) -> None:
    """The warm-up's statements fail there: the pool opens all the same (the member's
    schema check then says what is wrong), its connections cold."""
    schema = "pgjobd_never_migrated"
    q = for_schema(schema)
    pool = await _members_pool(dsn, schema)
    try:
        async with db.acquire(pool) as conn:
            assert await conn.fetchval("SELECT 1") == 1
            assert await _prepared(conn, q) == {}
    finally:
        await pool.close()
