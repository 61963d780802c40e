"""The database goes away under a running member: outcomes are held and recorded once
it is back, claiming pauses meanwhile, and no job is lost or recorded twice. Uses a
private cluster the test can stop and start."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import migrate
from pgjobd.embedded import KILL_SAFE_SETTINGS, Cluster

from .conftest import HANDLERS, run_member, wait_until
from .events import JSON_LOG, event_names, wait_for_event
from .test_metrics import free_port, get

pytestmark = pytest.mark.anyio
SCHEMA = "pgjobd"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path / "pg", settings=KILL_SAFE_SETTINGS) as running:
        yield running


async def test_outcomes_survive_a_database_restart(cluster: Cluster, tmp_path: Path) -> None:
    await cluster.ensure_database("outage")
    dsn = cluster.dsn("outage")
    conn = await asyncpg.connect(dsn)
    await migrate.migrate(conn, SCHEMA)
    ledger = tmp_path / "ledger"
    # The first job is quick, the rest hold on: when it is done, the others of its
    # claim are still running, so the database goes away with outcomes to come (with
    # every job alike, a whole claim could end and be recorded before the stop landed,
    # and the next claim fail, leaving nothing to hold back: seen on a loaded machine).
    await conn.execute(
        f"SELECT {SCHEMA}.enqueue('record', jsonb_build_object('path', $1::text, "
        "'hold_s', CASE WHEN g = 1 THEN 0.05 ELSE 1.5 END)) FROM generate_series(1, 40) AS g",
        str(ledger),
    )
    await conn.close()
    config = tmp_path / "pgjobd.toml"
    port = free_port()
    config.write_text(
        f'[daemon]\nhandlers = ["{HANDLERS}"]\nmetrics_listen = "127.0.0.1:{port}"\n'
        f"{JSON_LOG}"
        # A claim whose commit the outage hid is taken back after the lease.
        'lease = "3s"\n'
        "[queues.default]\nconcurrency = 8\nprocesses = 2\n"
    )
    member = await run_member(config, dsn, tmp_path / "member.log")
    try:
        # Jobs are running in the workers; take the database away under them.
        await wait_until(ledger.exists, what="first job done")
        assert (await get(port, "/readyz"))[0] == 200
        cluster.stop("fast")
        await wait_for_event(member, "completer.blocked", timeout_s=30)  # outcomes held

        async def unready() -> str | None:
            status, body = await get(port, "/readyz")
            return body if status == 503 else None

        body = await wait_until(unready, timeout_s=30, what="/readyz 503")
        assert "cannot record outcomes" in body, body
        assert (await get(port, "/healthz"))[0] == 200  # alive: waiting is the right thing
        cluster.start()

        conn = await asyncpg.connect(dsn)
        try:

            async def all_final() -> bool:
                return await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.job_history") == 40

            await wait_until(all_final, timeout_s=60, what="40 final records")
            assert await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.job") == 0
            states = await conn.fetch(
                f"SELECT state, count(*) FROM {SCHEMA}.job_history GROUP BY state"
            )
            assert [tuple(s) for s in states] == [("completed", 40)]
            distinct = await conn.fetchval(f"SELECT count(DISTINCT id) FROM {SCHEMA}.job_history")
            assert distinct == 40  # one final record per job
        finally:
            await conn.close()
        await wait_for_event(member, "completer.unblocked")  # recording outcomes again
        names = event_names(member)
        assert names.index("completer.blocked") < names.index("completer.unblocked")

        async def ready() -> bool:
            return (await get(port, "/readyz"))[0] == 200

        await wait_until(ready, timeout_s=60, what="/readyz 200 again")
        assert member.process.returncode is None  # the member rode out the outage
    finally:
        assert await member.stop() == 0, member.log[-3000:]


async def test_the_listen_session_is_back_soon_after_a_long_outage(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Found by the chaos scenario disk-full: the LISTEN session's reconnect delay
    doubled up to 30 s, so after an outage of 20 s it (and /readyz, which wants it)
    came back 15 s after the server did, while the member was working again."""
    await cluster.ensure_database("outage")
    dsn = cluster.dsn("outage")
    conn = await asyncpg.connect(dsn)
    await migrate.migrate(conn, SCHEMA)
    await conn.close()
    config = tmp_path / "pgjobd.toml"
    port = free_port()
    config.write_text(
        f'[daemon]\nhandlers = ["{HANDLERS}"]\nmetrics_listen = "127.0.0.1:{port}"\n'
        f"{JSON_LOG}[queues.default]\nconcurrency = 2\nprocesses = 1\n"
    )
    member = await run_member(config, dsn, tmp_path / "member.log")

    async def ready() -> bool:
        try:
            return (await get(port, "/readyz"))[0] == 200
        except OSError:  # not serving yet
            return False

    try:
        await wait_until(ready, timeout_s=30, what="/readyz 200")
        cluster.stop("fast")
        await wait_for_event(member, "listener.down", timeout_s=30)
        # Long enough for four failed reconnects: delays of 0.4, 2, 4 and 8 s before.
        await anyio.sleep(18)
        cluster.start()
        back = time.monotonic()
        await wait_until(ready, timeout_s=60, what="/readyz 200 again")
        took = time.monotonic() - back
        assert took < 5, f"ready again only {took:.1f} s after the server was back"
        assert member.process.returncode is None
    finally:
        assert await member.stop() == 0, member.log[-3000:]


async def test_a_database_that_refuses_writes_for_a_while_takes_no_member_down(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The server up but refusing every write (read-only here; a full data volume
    refuses writes that need room, with SQLSTATE 53100): members hold on and carry on
    once it takes writes again."""
    await cluster.ensure_database("outage")
    dsn = cluster.dsn("outage")
    conn = await asyncpg.connect(dsn)
    await conn.execute("SET default_transaction_read_only = off")  # this session writes
    await migrate.migrate(conn, SCHEMA)
    ledger = tmp_path / "ledger"
    config = tmp_path / "pgjobd.toml"
    config.write_text(
        f'[daemon]\nhandlers = ["{HANDLERS}"]\n{JSON_LOG}lease = "3s"\n'
        "[queues.default]\nconcurrency = 4\nprocesses = 1\n"
    )
    member = await run_member(config, dsn, tmp_path / "member.log")
    try:
        await conn.execute(
            f"SELECT {SCHEMA}.enqueue('record', jsonb_build_object('path', $1::text, "
            "'hold_s', 0.2)) FROM generate_series(1, 20)",
            str(ledger),
        )
        await wait_until(ledger.exists, what="first job done")
        await conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        await conn.execute("SELECT pg_reload_conf()")
        await anyio.sleep(8)  # past the heartbeat, lease renewals, claims and role ticks
        await conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
        await conn.execute("SELECT pg_reload_conf()")

        async def all_final() -> bool:
            return await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.job_history") == 20

        await wait_until(all_final, timeout_s=60, what="20 final records")
        assert member.process.returncode is None, member.log[-3000:]
    finally:
        await conn.close()
        assert await member.stop() == 0, member.log[-3000:]
