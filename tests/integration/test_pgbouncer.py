"""pgjobd through a stock PgBouncer in transaction mode (issue 18): what it sends at
startup is accepted, the client's COPY path keeps everything it needs inside one
transaction, statements stay bounded, and the CLI works on a pooled config."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import Client, db
from pgjobd.config import Config, DatabaseConfig, Duration
from pgjobd.pgbouncer import PgBouncer, PgBouncerError, find_program
from tests.e2e.conftest import wait_until

pytestmark = pytest.mark.anyio


def pooled_config(bouncer: PgBouncer, dsn: str, schema: str, **database: object) -> Config:
    return Config(
        database=DatabaseConfig(
            schema=schema,
            pooler="transaction",
            leader_dsn=dsn,
            **database,  # type: ignore[arg-type]
        ),
        dsn=bouncer.dsn(),
    )


async def test_a_stock_pgbouncer_refuses_the_direct_settings_and_takes_the_pooled_ones(
    stock_pgbouncer: PgBouncer, dsn: str, schema: str, conn: asyncpg.Connection
) -> None:
    direct = Config(database=DatabaseConfig(schema=schema), dsn=stock_pgbouncer.dsn())
    with pytest.raises(asyncpg.ProtocolViolationError, match="unsupported startup parameter"):
        await db.create_pool(direct)

    pool = await db.create_pool(pooled_config(stock_pgbouncer, dsn, schema))
    try:
        async with db.acquire(pool) as pooled:
            name = await pooled.fetchval("SELECT current_setting('application_name')")
            through = await pooled.fetchval("SELECT inet_server_port()")
    finally:
        await pool.close()
    assert name == "pgjobd"  # the one setting PgBouncer passes on
    assert through == await conn.fetchval("SELECT inet_server_port()")

    session = await db.connect_session(pooled_config(stock_pgbouncer, dsn, schema), "pgjobd x")
    try:  # the leader's and the listener's sessions: direct, with every setting
        assert await session.fetchval("SHOW statement_timeout") == "30s"
        assert await session.fetchval("SHOW idle_in_transaction_session_timeout") == "1min"
    finally:
        await session.close()


async def test_copy_batches_through_a_transaction_pooler_keep_their_own_jobs(
    stock_pgbouncer: PgBouncer, schema: str, conn: asyncpg.Connection
) -> None:
    """More client connections than PgBouncer's default pool of 20 server connections:
    COPY batches of different clients run on the same server connection (the COPY path
    once staged rows in a temporary table there, which outlived each transaction). Each
    batch gets its own jobs, in order, with the SQL functions' defaults."""
    await conn.execute(
        f"INSERT INTO {schema}.kind (name, queue, priority, max_attempts) "
        "VALUES ('mail', 'outbox', 3, 4)"
    )
    clients = [
        await Client.connect(stock_pgbouncer.dsn(), schema=schema, pooler="transaction",
                             min_size=8, max_size=8)
        for _ in range(4)
    ]  # fmt: skip
    batches: dict[tuple[int, int], list[int]] = {}
    try:

        async def enqueue_batches(index: int, client: Client) -> None:
            for round_ in range(6):
                size = 1 + (index * 7 + round_ * 3) % 40
                jobs = [("mail", {"client": index, "round": round_, "n": n}) for n in range(size)]
                batches[index, round_] = await client.enqueue_many(jobs)

        async with anyio.create_task_group() as tg:
            for index in range(32):
                tg.start_soon(enqueue_batches, index, clients[index % 4])
        # The caller's own transaction, through the pooler.
        async with clients[0].pool.acquire() as caller, caller.transaction():
            inside = await clients[0].enqueue_many([("mail", {"caller": True})] * 3, conn=caller)
            await caller.execute("SELECT 1")
    finally:
        for client in clients:
            await client.close()

    rows = await conn.fetch(
        f"SELECT id, args, queue, priority, max_attempts FROM {schema}.job ORDER BY id"
    )
    by_id = {r["id"]: r for r in rows}
    every_id = [i for ids in batches.values() for i in ids] + inside
    assert len(every_id) == len(set(every_id)) == len(rows)
    for (index, round_), ids in batches.items():
        assert ids == sorted(ids)
        for n, job_id in enumerate(ids):
            assert by_id[job_id]["args"] == f'{{"n": {n}, "round": {round_}, "client": {index}}}'
    assert {(r["queue"], r["priority"], r["max_attempts"]) for r in rows} == {("outbox", 3, 4)}


async def test_a_statement_through_the_pooler_is_bounded_by_statement_timeout(
    stock_pgbouncer: PgBouncer, dsn: str, schema: str, conn: asyncpg.Connection
) -> None:
    config = pooled_config(stock_pgbouncer, dsn, schema, statement_timeout=Duration(seconds=1))
    pool = await db.create_pool(config)
    try:
        with pytest.raises(TimeoutError):
            async with db.acquire(pool) as pooled:
                await pooled.execute(f"SELECT pg_sleep(600), '{schema}'")
    finally:
        await pool.close()

    async def cancelled_on_the_server() -> bool:
        running = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%' "
            "AND query LIKE $1 AND state = 'active'",
            f"%{schema}%",
        )
        return running == 0

    await wait_until(cancelled_on_the_server, what="the statement cancelled on the server")


async def test_the_cli_on_a_pooled_config_migrates_directly_and_enqueues_through_the_pooler(
    stock_pgbouncer: PgBouncer, dsn: str, schema_name: str, conn: asyncpg.Connection,
    tmp_path: Path,
) -> None:  # fmt: skip
    config = tmp_path / "pgjobd.toml"
    config.write_text(
        f'[database]\ndsn = "{stock_pgbouncer.dsn()}"\nleader_dsn = "{dsn}"\n'
        f'pooler = "transaction"\nschema = "{schema_name}"\n'
    )

    async def pgjobd(*args: str) -> str:
        done = await anyio.run_process(
            [sys.executable, "-m", "pgjobd", *args, "--config", str(config)], check=False
        )
        assert done.returncode == 0, done.stderr.decode()
        return done.stdout.decode()

    try:
        await pgjobd("migrate")
        ids = [int(await pgjobd("enqueue", "echo", f'{{"n": {n}}}')) for n in range(3)]
        await pgjobd("jobs", "cancel", str(ids[0]))
        assert "echo" in await pgjobd("jobs", "list")
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema_name} CASCADE")
    assert len(set(ids)) == 3


async def test_through_a_session_mode_pgbouncer_the_settings_are_set_once_connected(
    dsn: str, schema: str
) -> None:
    try:
        find_program()
    except PgBouncerError as e:
        pytest.skip(str(e))
    with PgBouncer.start(dsn, pool_mode="session") as bouncer:
        config = Config(
            database=DatabaseConfig(
                schema=schema, pooler="session", statement_timeout=Duration(seconds=7)
            ),
            dsn=bouncer.dsn(),
        )
        pool = await db.create_pool(config, max_size=2)
        try:
            async with db.acquire(pool) as pooled:
                assert await pooled.fetchval("SHOW statement_timeout") == "7s"
                assert await pooled.fetchval("SHOW application_name") == "pgjobd"
        finally:
            await pool.close()
        client = await Client.connect(
            bouncer.dsn(), schema=schema, pooler="session", tenant="acme",
            statement_timeout="9s",
        )  # fmt: skip
        try:
            async with client.pool.acquire() as conn:
                assert await conn.fetchval("SHOW statement_timeout") == "9s"
                assert await conn.fetchval("SELECT current_setting('pgjobd.tenant')") == "acme"
        finally:
            await client.close()


async def test_a_tenant_client_through_a_transaction_pooler_is_refused() -> None:
    with pytest.raises(ValueError, match="session setting, which a transaction pooler"):
        await Client.connect(
            "postgresql://nobody@127.0.0.1:1/none", pooler="transaction", tenant="acme"
        )
