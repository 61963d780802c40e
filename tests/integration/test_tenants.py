"""Row-level security by tenant (`migrate --rls`), against real login roles: a producer
or readonly session that sets pgjobd.tenant sees and enqueues only that tenant's jobs,
on every read path (Client.job, status, jobs list/show, dlq list, the tables
themselves); the worker role sees every tenant's."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator

import anyio
import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd import Client, JobSpec, admin, migrate
from pgjobd.errors import EnqueueError
from tests.logins import create_logins, drop_roles, login_dsn

pytestmark = pytest.mark.anyio


@pytest.fixture
async def tenants(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> AsyncIterator[dict[str, object]]:
    """Under --rls: acme's and globex's jobs, live and final (one dead, with an attempt),
    and one without a tenant. Yields the logins and each tenant's job ids."""
    await migrate.migrate(conn, schema, rls=True)
    try:
        made = await create_logins(conn, schema)
        ids: dict[str | None, list[int]] = {}
        for tenant in ("acme", "globex"):
            async with await Client.connect(
                login_dsn(dsn, made["producer"]), schema=schema, tenant=tenant
            ) as client:
                live = await client.enqueue("k", {"who": tenant})
                batch = await client.enqueue_many([("k", {"n": 1}), ("k", {"n": 2})])
                dead = await client.enqueue("k", {"secret": tenant}, queue="q")
            ids[tenant] = [live, *batch, dead]
        ids[None] = [await conn.fetchval(f"SELECT {schema}.enqueue('k')")]
        # Two of each tenant's jobs finish: one completed, one dead with an attempt.
        for tenant in ("acme", "globex"):
            done, dead = ids[tenant][1], ids[tenant][3]
            await conn.execute(
                f"SELECT count(*) FROM {schema}.job_move($1::bigint[], NULL, "
                "ARRAY[NULL, 'attempts_exhausted'])",
                [done, dead],
            )
            await conn.execute(
                f"INSERT INTO {schema}.job_attempt (job_id, attempt, queue, kind, outcome, "
                "error_class, error_message) VALUES ($1, 1, 'q', 'k', 'failed', 'E', $2)",
                dead,
                f"{tenant} failed",
            )
        yield {"logins": made, "ids": ids}
    finally:
        await drop_roles(conn, schema)


def _acme_dsn(dsn: str, login: str) -> str:
    return login_dsn(dsn, login) + "?pgjobd.tenant=acme"


async def test_every_read_path_of_a_tenant_sees_none_of_another_tenants_jobs(
    dsn: str, conn: asyncpg.Connection, schema: str, tenants: dict[str, object]
) -> None:
    logins: dict[str, str] = tenants["logins"]  # type: ignore[assignment]
    ids: dict[str | None, list[int]] = tenants["ids"]  # type: ignore[assignment]
    acme, globex = set(ids["acme"]), set(ids["globex"])
    every = acme | globex | set(ids[None])
    for group in ("producer", "readonly"):
        async with await Client.connect(
            login_dsn(dsn, logins[group]), schema=schema, tenant="acme"
        ) as client:
            for job_id in acme:
                info = await client.job(job_id)
                assert info is not None and info.tenant == "acme"
            for job_id in globex | set(ids[None]):
                assert await client.job(job_id) is None, (group, job_id)
            dead = await client.job(ids["acme"][3])
            assert dead is not None and [e.error for e in dead.errors] == ["E: acme failed"]
            # wait: its own final job at once; another tenant's is unknown, not awaited.
            waited = await client.wait(ids["acme"][3], timeout=10)
            assert waited.id == ids["acme"][3] and waited.state == "dead"
            for job_id in globex | set(ids[None]):
                with pytest.raises(admin.UnknownJobs):
                    await client.wait(job_id, timeout=10)
            async with client.pool.acquire() as session:
                seen = {r["id"] for r in await session.fetch(f"SELECT id FROM {schema}.job")}
                seen |= {
                    r["id"] for r in await session.fetch(f"SELECT id FROM {schema}.job_history")
                }
                attempts = await session.fetch(f"SELECT job_id FROM {schema}.job_attempt")
            assert seen == acme, group
            assert [r["job_id"] for r in attempts] == [ids["acme"][3]]
            if group == "readonly":
                status = await admin.status(client.pool, schema)
                counted = sum(q.available for q in status.queues.values())
                assert counted == 2  # acme's live one and the last of its batch
                assert status.queues["q"].dead_last_hour == 1
                listed = {j.id for j in await admin.list_jobs(client.pool, schema)}
                assert listed == acme
                assert [j.id for j in await admin.list_dead(client.pool, schema)] == [
                    ids["acme"][3]
                ]
    # The CLI's read commands, as a readonly login whose DSN names the tenant.
    reader = _acme_dsn(dsn, logins["readonly"])
    common = ["--dsn", reader, "--schema", schema, "--json"]
    listed = await _cli(["jobs", "list", *common])
    assert {j["id"] for j in json.loads(listed)["jobs"]} == acme
    dead = await _cli(["dlq", "list", *common])
    assert [j["id"] for j in json.loads(dead)["jobs"]] == [ids["acme"][3]]
    shown = await _cli(["jobs", "show", str(ids["acme"][0]), *common])
    assert json.loads(shown)["tenant"] == "acme"
    hidden = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "jobs", "show", str(ids["globex"][0]), *common],
        check=False,
    )
    assert hidden.returncode == 1 and b"no such job" in hidden.stderr
    status = json.loads(await _cli(["status", *common]))
    assert sum(q["available"] for q in status["queues"].values()) == 2
    # The worker (and so the daemon) sees every tenant's jobs.
    worker = await asyncpg.connect(_acme_dsn(dsn, logins["worker"]))
    try:
        seen = {r["id"] for r in await worker.fetch(f"SELECT id FROM {schema}.job")}
        seen |= {r["id"] for r in await worker.fetch(f"SELECT id FROM {schema}.job_history")}
        assert seen == every
    finally:
        await worker.close()


async def _cli(argv: list[str]) -> str:
    done = await anyio.run_process([sys.executable, "-m", "pgjobd", *argv], check=False)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


async def test_a_tenants_session_enqueues_only_for_its_tenant(
    dsn: str, conn: asyncpg.Connection, schema: str, tenants: dict[str, object]
) -> None:
    logins: dict[str, str] = tenants["logins"]  # type: ignore[assignment]
    async with await Client.connect(
        login_dsn(dsn, logins["producer"]), schema=schema, tenant="acme"
    ) as client:
        own = await client.enqueue("k", tenant="acme")
        defaulted = await client.enqueue("k")
        with pytest.raises(EnqueueError, match="tenant 'acme', not 'globex'"):
            await client.enqueue("k", tenant="globex")
        with pytest.raises(EnqueueError, match="tenant 'acme', not 'globex'"):
            await client.enqueue_many([("k", {})], tenant="globex")  # the COPY path
        with pytest.raises(EnqueueError, match="tenant 'acme', not 'globex'"):
            await client.enqueue_many([("k", {})], tenant="globex", unique_key="u")
    rows = await conn.fetch(
        f"SELECT tenant FROM {schema}.job WHERE id = ANY($1::bigint[])", [own, defaulted]
    )
    assert [r["tenant"] for r in rows] == ["acme", "acme"]
    # From SQL, with the setting, likewise; without it, a producer sees only jobs without
    # a tenant: it fails closed.
    producer = await asyncpg.connect(login_dsn(dsn, logins["producer"]))
    try:
        await producer.execute("SET pgjobd.tenant = 'globex'")
        job_id = await producer.fetchval(f"SELECT {schema}.enqueue('k')")
        assert await conn.fetchval(f"SELECT tenant FROM {schema}.job WHERE id = $1", job_id) == (
            "globex"
        )
        with pytest.raises(asyncpg.PostgresError, match="not 'acme'"):
            await producer.fetchval(f"SELECT {schema}.enqueue('k', tenant => 'acme')")
        await producer.execute("RESET pgjobd.tenant")
        tenants_seen = {
            r["tenant"] for r in await producer.fetch(f"SELECT tenant FROM {schema}.job")
        }
        assert tenants_seen == {None}
    finally:
        await producer.close()


async def test_a_tenants_batch_under_row_security_is_inserted_without_copy(
    dsn: str, conn: asyncpg.Connection, schema: str, tenants: dict[str, object]
) -> None:
    """PostgreSQL refuses COPY FROM where row security applies: a tenant producer's
    plain batch goes in by one statement instead, with the same defaults and order."""
    logins: dict[str, str] = tenants["logins"]  # type: ignore[assignment]
    await conn.execute(
        f"INSERT INTO {schema}.kind (name, queue, priority, max_attempts) "
        "VALUES ('declared', 'outbox', 3, 4)"
    )
    async with await Client.connect(
        login_dsn(dsn, logins["producer"]), schema=schema, tenant="acme"
    ) as client:
        ids = await client.enqueue_many(
            [("declared", {"n": 1}), JobSpec("k", {"n": 2}, delay="1h", group="g"),
             ("declared", {"n": 3})]
        )  # fmt: skip
    rows = await conn.fetch(
        f"SELECT id, tenant, queue, priority, max_attempts, state::text, group_key "
        f"FROM {schema}.job WHERE id = ANY($1::bigint[]) ORDER BY id",
        ids,
    )
    assert [r["id"] for r in rows] == ids == sorted(ids)
    assert [tuple(r)[1:] for r in rows] == [
        ("acme", "outbox", 3, 4, "available", None),
        ("acme", "default", 0, 20, "scheduled", "g"),
        ("acme", "outbox", 3, 4, "available", None),
    ]


async def test_rls_is_renewed_by_later_migrates_and_leaves_the_schema_check_clean(
    conn: asyncpg.Connection, schema: str, tenants: dict[str, object]
) -> None:
    await migrate.migrate(conn, schema)
    assert await migrate.rls_enabled(conn, schema)
    found = await migrate.verify(conn, schema)
    assert not found.broken and not found.foreign


EDGE_TENANTS = st.one_of(
    st.sampled_from(["", " ", "\x00", "a\x00b", "\ud800", "t" * 256, "t" * 257, "x" * 100_000,
                     "ünï", "'; DROP TABLE job; --", "acme"]),
    st.text(max_size=12),
)  # fmt: skip


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tenant=EDGE_TENANTS)
async def test_a_tenant_at_the_edges_is_refused_by_name_or_stored_and_the_fleet_reads_it(
    dsn: str, conn: asyncpg.Connection, schema: str, tenants: dict[str, object], tenant: str
) -> None:
    logins: dict[str, str] = tenants["logins"]  # type: ignore[assignment]
    before = await conn.fetchval(f"SELECT count(*) FROM {schema}.job")
    # Through the client: refused at connect, naming the tenant, or its jobs are its own.
    try:
        client = await Client.connect(
            login_dsn(dsn, logins["producer"]), schema=schema, tenant=tenant, max_size=1
        )
    except ValueError as e:
        assert str(e).startswith("tenant"), str(e)
    else:
        async with client:
            job_id = await client.enqueue("k")
            info = await client.job(job_id)
            assert info is not None and info.tenant == tenant
    # From SQL, with the session setting: a clear error and nothing written, or stored.
    producer = await asyncpg.connect(login_dsn(dsn, logins["producer"]))
    try:
        written = None
        try:
            await producer.execute("SELECT set_config('pgjobd.tenant', $1, false)", tenant)
            written = await producer.fetchval(f"SELECT {schema}.enqueue('k')")
        except (asyncpg.PostgresError, UnicodeEncodeError):
            pass
        if written is not None:
            stored = await conn.fetchval(f"SELECT tenant FROM {schema}.job WHERE id = $1", written)
            assert stored in (tenant, None), (tenant, stored)  # "" is no tenant
    finally:
        await producer.close()
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") >= before
    # The fleet's readers keep working whatever was stored.
    await admin.status(conn, schema)
    await admin.list_jobs(conn, schema)
