"""Outcomes held while the database is away, at the edges: a SIGTERM that arrives while
it is still away, and an outage longer than the lease. A private cluster the test can
stop and start (as in test_outage)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import migrate
from pgjobd.completer import FINAL_FLUSH_S, RETRY_MAX_S
from pgjobd.embedded import KILL_SAFE_SETTINGS, Cluster

from .conftest import HANDLERS, MemberProcess, run_member, wait_until

pytestmark = pytest.mark.anyio
SCHEMA = "pgjobd"
DRAIN_S = 3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path / "pg", settings=KILL_SAFE_SETTINGS) as running:
        yield running


async def _start(cluster: Cluster, tmp_path: Path, jobs: int, lease: str) -> MemberProcess:
    await cluster.ensure_database("outage")
    dsn = cluster.dsn("outage")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate.migrate(conn, SCHEMA)
        await conn.execute(
            f"SELECT {SCHEMA}.enqueue('record', jsonb_build_object('path', $1::text, "
            "'hold_s', 1.0), max_attempts => 1) FROM generate_series(1, $2)",
            str(tmp_path / "ledger"), jobs,
        )  # fmt: skip
    finally:
        await conn.close()
    config = tmp_path / "pgjobd.toml"
    config.write_text(
        f'[daemon]\nhandlers = ["{HANDLERS}"]\nmetrics_listen = ""\nlog_format = "text"\n'
        f'lease = "{lease}"\ndrain_timeout = "{DRAIN_S}s"\n'
        "[queues.default]\nconcurrency = 8\nprocesses = 1\n"
    )
    member = await run_member(config, dsn, tmp_path / "member.log")
    conn = await asyncpg.connect(dsn)
    try:

        async def running() -> bool:
            count = await conn.fetchval(
                f"SELECT count(*) FROM {SCHEMA}.job WHERE state = 'running'"
            )
            return bool(count == jobs)

        await wait_until(running, timeout_s=60, what="every job running")
    finally:
        await conn.close()
    return member


async def test_sigterm_while_the_database_is_down_exits_and_says_what_is_left(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Regression (item 7a of issue 10): at d1c1ca0 the completer's retries were shielded
    # and endless, so the member never exited.
    member = await _start(cluster, tmp_path, jobs=4, lease="30s")
    try:
        cluster.stop("fast")
        # The jobs end in the workers; their outcomes cannot be written.
        await wait_until(lambda: "holding them" in member.log, timeout_s=30, what="held")
        started = time.monotonic()
        # stop() fails the test if the member has not exited by then.
        code = await member.stop(signal.SIGTERM, timeout_s=DRAIN_S + FINAL_FLUSH_S + 10)
        took = time.monotonic() - started
        assert code == 0, member.log[-3000:]
        assert "4 outcomes not recorded" in member.log, member.log[-3000:]
        assert "the reaper takes their jobs back" in member.log
        print(f"exited {took:.1f}s after SIGTERM")
    finally:
        if member.process.returncode is None:
            await member.stop(signal.SIGKILL)

    # The jobs are still the member's until their leases run out: none was lost.
    cluster.start()
    conn = await asyncpg.connect(cluster.dsn("outage"))
    try:
        rows = await conn.fetch(f"SELECT state::text FROM {SCHEMA}.job")
        assert [r["state"] for r in rows] == ["running"] * 4
    finally:
        await conn.close()


async def test_outcomes_held_longer_than_the_lease_complete_their_jobs(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Jobs on their last attempt (max_attempts 1) that finished while the database was
    # away for longer than their lease: held outcomes are tried at least every
    # RETRY_MAX_S, so they are written within about that of its return, before the
    # reaper (which waits a lease into a new term) takes anything back. None ends dead.
    lease_s = 3
    assert lease_s / 2 > RETRY_MAX_S
    member = await _start(cluster, tmp_path, jobs=6, lease=f"{lease_s}s")
    try:
        cluster.stop("fast")
        await wait_until(lambda: "holding them" in member.log, timeout_s=30, what="held")
        await anyio.sleep(lease_s + 4)  # the leases run out; the retries space out
        cluster.start()
        conn = await asyncpg.connect(cluster.dsn("outage"))
        try:

            async def final() -> list[str]:
                rows = await conn.fetch(f"SELECT state::text FROM {SCHEMA}.job_history")
                return [r["state"] for r in rows] if len(rows) == 6 else []

            states = await wait_until(final, timeout_s=60, what="6 final records")
            assert states == ["completed"] * 6, member.log[-3000:]
        finally:
            await conn.close()
        assert "recording outcomes again" in member.log
        assert "lease_expired" not in member.log
        assert await member.stop() == 0, member.log[-3000:]
    finally:
        if member.process.returncode is None:
            await member.stop(signal.SIGKILL)
