"""Enqueueing from plain SQL: the function's options, its errors (own SQLSTATEs, nothing
written), and a least-privilege producer role that may enqueue and nothing else."""

from __future__ import annotations

from datetime import timedelta

import asyncpg
import pytest

from pgjobd import Client

pytestmark = pytest.mark.anyio


async def test_enqueue_with_named_options(conn: asyncpg.Connection, schema: str) -> None:
    job_id = await conn.fetchval(
        f"SELECT {schema}.enqueue('send_welcome', '{{\"user_id\": 7}}'::jsonb, "
        "queue => 'email', run_at => now() + interval '10 minutes', tenant => 't1', "
        "unique_key => 'welcome-7', priority => 3, max_attempts => 2)"
    )

    row = await conn.fetchrow(
        f"SELECT state, queue, priority, max_attempts, tenant, unique_key, "
        f"run_at - enqueued_at AS wait FROM {schema}.job WHERE id = $1",
        job_id,
    )
    assert dict(row) == {
        "state": "scheduled", "queue": "email", "priority": 3, "max_attempts": 2,
        "tenant": "t1", "unique_key": "welcome-7", "wait": timedelta(minutes=10),
    }  # fmt: skip
    again = await conn.fetchval(
        f"SELECT {schema}.enqueue('send_welcome', '{{}}'::jsonb, unique_key => 'welcome-7')"
    )
    assert again == job_id


async def test_sql_enqueue_uses_the_kinds_declared_defaults(
    conn: asyncpg.Connection, schema: str
) -> None:
    await conn.execute(
        f"INSERT INTO {schema}.kind (name, queue, priority, max_attempts) "
        "VALUES ('build_report', 'reports', 5, 3)"
    )

    declared = await conn.fetchval(f"SELECT {schema}.enqueue('build_report')")
    undeclared = await conn.fetchval(f"SELECT {schema}.enqueue('nobody_declared_me')")

    rows = await conn.fetch(
        f"SELECT id, queue, priority, max_attempts FROM {schema}.job ORDER BY id"
    )
    assert [tuple(r) for r in rows] == [
        (declared, "reports", 5, 3), (undeclared, "default", 0, 20),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "sqlstate", "message"),
    [
        ("enqueue('k', '[1]')", "PJ002", "args must be a JSON object, not array"),
        ("enqueue('k', 'null')", "PJ002", "args must be a JSON object"),
        (
            "enqueue('k', jsonb_build_object('p', repeat('x', 65536)))",
            "PJ001",
            "over the 65536-byte limit",
        ),
        ("enqueue('k', '{}', queue => 'a b')", "PJ003", "invalid queue name 'a b'"),
        ("enqueue('k', '{}', delay => '-1 minute')", "PJ004", "delay must not be negative"),
        ("enqueue('k', '{}', max_attempts => 0)", "PJ004", "max_attempts must be at least 1"),
        ("enqueue('no spaces please', '{}')", "PJ004", "invalid job kind"),
        ("enqueue('k', '{}', on_conflict => 'skip')", "PJ004", "on_conflict"),
        (
            "enqueue_many(ARRAY['a', 'b'], ARRAY['{}', '7']::jsonb[])",
            "PJ002",
            "job 2 of 2: args must be a JSON object, not number",
        ),
        ("enqueue_many(ARRAY['a', 'b'], ARRAY['{}']::jsonb[])", "PJ004", "differ in length"),
    ],
)
async def test_bad_calls_raise_their_sqlstate_and_write_nothing(
    conn: asyncpg.Connection, schema: str, call: str, sqlstate: str, message: str
) -> None:
    await conn.execute(f"SELECT {schema}.enqueue('k', '{{}}', unique_key => 'held')")

    with pytest.raises(asyncpg.PostgresError) as rejected:
        await conn.execute(f"SELECT * FROM {schema}.{call}")

    assert rejected.value.sqlstate == sqlstate
    assert message in str(rejected.value)
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 1


async def test_duplicate_with_raise_names_the_existing_job(
    conn: asyncpg.Connection, schema: str
) -> None:
    first = await conn.fetchval(f"SELECT {schema}.enqueue('k', '{{}}', unique_key => 'u')")

    with pytest.raises(asyncpg.PostgresError) as duplicate:
        await conn.execute(
            f"SELECT {schema}.enqueue('k', '{{}}', unique_key => 'u', on_conflict => 'raise')"
        )

    assert duplicate.value.sqlstate == "PJ005"
    assert duplicate.value.detail == str(first)


async def test_a_rejected_job_in_a_batch_rolls_back_the_whole_batch(
    conn: asyncpg.Connection, schema: str
) -> None:
    with pytest.raises(asyncpg.PostgresError, match="job 3 of 3"):
        await conn.execute(
            f"SELECT * FROM {schema}.enqueue_many(ARRAY['a', 'b', 'c'], "
            "ARRAY['{}', '{}', '{}']::jsonb[], queues => ARRAY['q', 'q', 'bad queue'])"
        )
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0


async def test_a_producer_role_can_enqueue_and_do_nothing_else(
    conn: asyncpg.Connection, schema: str, producer_login: str
) -> None:
    await conn.execute(f"SET ROLE {producer_login}")
    try:
        job_id = await conn.fetchval(f"SELECT {schema}.enqueue('k', '{{\"a\": 1}}')")
        many = await conn.fetch(
            f"SELECT id FROM {schema}.enqueue_many(ARRAY['k'], ARRAY['{{}}']::jsonb[])"
        )
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetch(f"SELECT * FROM {schema}.member")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(f"DELETE FROM {schema}.job")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute(f"UPDATE {schema}.kind SET queue = 'x'")
    finally:
        await conn.execute("RESET ROLE")

    assert job_id > 0 and len(many) == 1
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 2


async def test_the_python_client_works_as_a_producer(
    dsn: str, conn: asyncpg.Connection, schema: str, producer_login: str
) -> None:
    async def as_producer(connection: asyncpg.Connection) -> None:
        await connection.execute(f"SET ROLE {producer_login}")

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1, init=as_producer)
    try:
        client = Client(pool, schema=schema)
        single = await client.enqueue("k", {"n": 1})
        bulk = await client.enqueue_many([("k", {"n": 2}), ("k", {"n": 3})])
        keyed = await client.enqueue_many([("k", {})], unique_key="once")
    finally:
        await pool.close()

    assert len({single, *bulk, *keyed}) == 4
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 4


@pytest.mark.parametrize(
    "call",
    [
        "enqueue('k', '{}')",
        "enqueue('k', '{}', delay => interval '1 minute', ttl => interval '1 hour')",
        "enqueue('k', '{}', unique_key => 'u', unique_for => interval '1 minute', "
        "on_conflict => 'raise')",
        "enqueue('k', '{}', group_key => 'g')",
        "enqueue_many(ARRAY['k', 'k'], ARRAY['{}', '{\"a\": 1}']::jsonb[], "
        "ttls => ARRAY[interval '1 hour', NULL])",
    ],
)
async def test_an_enqueue_calls_no_sql_function_that_is_planned_again_in_each_transaction(
    conn: asyncpg.Connection, schema: str, call: str
) -> None:
    """A SQL-language function its caller does not inline keeps its plan only for the
    query that calls it: before PostgreSQL 18, one called from plpgsql is planned again
    in every transaction, and an enqueue is a transaction of its own (migration 0028:
    two such helpers were a third of an enqueue's server time)."""
    await conn.execute("SET track_functions = 'all'")
    async with conn.transaction():
        await conn.execute(f"SELECT {schema}.{call}")
        called = await conn.fetch(
            "SELECT f.funcname, l.lanname FROM pg_stat_xact_user_functions AS f "
            "JOIN pg_proc AS p ON p.oid = f.funcid "
            "JOIN pg_language AS l ON l.oid = p.prolang "
            "WHERE f.schemaname = $1",
            schema,
        )

    languages = {row["funcname"]: row["lanname"] for row in called}
    assert languages.get(call.partition("(")[0]) == "plpgsql"  # (counted: the view works)
    assert [name for name, language in languages.items() if language == "sql"] == []
