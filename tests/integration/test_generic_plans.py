"""The member's pool plans each prepared statement once per session (issue 17):
PostgreSQL's default planned job_claim anew at every claim, for its LIMIT and cursor
values. Read back from the session itself: the setting, and the plans its claims got."""

from __future__ import annotations

from datetime import timedelta

import pytest

from pgjobd import Client, db
from pgjobd.config import Config, DatabaseConfig
from pgjobd.queries import for_schema
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
