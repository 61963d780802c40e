"""A real member whose login holds only <schema>_worker runs everything, its leader's
maintenance included: expired partitions detached and dropped, an invalid index rebuilt
with REINDEX CONCURRENTLY and an interrupted rebuild's leftover dropped, all through the
<schema>_maintainer role or the SECURITY DEFINER functions, never "must be owner"."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest

from pgjobd import Client, migrate
from tests.logins import (
    LEFTOVER_INDEX,
    create_logins,
    drop_roles,
    login_dsn,
    make_maintenance_work,
    mark_invalid,
)

from .conftest import MemberProcess, wait_all_final, wait_until
from .events import JSON_LOG, events, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]


@pytest.fixture
async def worker_login(conn: asyncpg.Connection, schema: str) -> AsyncIterator[dict[str, str]]:
    await migrate.migrate(conn, schema, roles=True)
    try:
        yield await create_logins(conn, schema)
    finally:
        await drop_roles(conn, schema)


async def test_a_member_with_only_the_worker_role_runs_jobs_and_the_leaders_maintenance(
    dsn: str,
    conn: asyncpg.Connection,
    schema: str,
    worker_login: dict[str, str],
    start_member: StartMember,
) -> None:
    expired = await make_maintenance_work(conn, schema)
    # And an index the planner cannot use: rebuilt whatever its size.
    await mark_invalid(conn, schema, "job_due_idx")

    member = await start_member(daemon=JSON_LOG, server_dsn=login_dsn(dsn, worker_login["worker"]))
    await wait_for_event(member, "reindexer.rebuilt", timeout_s=60, index="job_due_idx")
    await wait_for_event(member, "reindexer.leftover_dropped", timeout_s=60)
    for name in expired:
        await wait_for_event(member, "partitions.dropped", timeout_s=60, partition=name)
    async with await Client.connect(
        login_dsn(dsn, worker_login["producer"]), schema=schema
    ) as client:
        ids = await client.enqueue_many([("echo", {"n": n}) for n in range(5)])
    records = await wait_all_final(conn, schema, len(ids))
    assert all(records[i]["state"] == "completed" for i in ids)

    assert await conn.fetchval(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = $1::regclass", f"{schema}.job_due_idx"
    )
    assert await conn.fetchval("SELECT to_regclass($1)", f"{schema}.{LEFTOVER_INDEX}") is None
    assert not events(member, "role.failed"), member.log[-3000:]
    assert "must be owner" not in member.log
    # The member's sessions ran as the worker login all along.
    logins = await wait_until(
        lambda: conn.fetch(
            "SELECT DISTINCT usename FROM pg_stat_activity WHERE pid IN "
            f"(SELECT backend_pid FROM {schema}.leader WHERE resigned_at IS NULL)"
        ),
        what="the leader's session",
    )
    assert [r["usename"] for r in logins] == [worker_login["worker"]]
    assert await member.stop() == 0
