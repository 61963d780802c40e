"""Private clusters on this machine: start, adopt, crash, restart, stop."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from pgjobd.embedded import (
    KILL_SAFE_SETTINGS,
    ChildIdentity,
    Cluster,
    server_processes,
)

pytestmark = pytest.mark.anyio


def postmasters(data_dir: Path) -> list[int]:
    """Processes started as `postgres -D data_dir`, not the backends they fork."""
    return [
        pid
        for pid in server_processes(data_dir)
        if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:2] == [b"-D"]
    ]


@pytest.fixture
def bystander() -> Iterator[int]:
    """The pid of a live process that is no postmaster."""
    process = subprocess.Popen(["sleep", "30"])
    yield process.pid
    process.send_signal(signal.SIGKILL)
    process.wait()


@pytest.fixture
def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


async def query(dsn: str, sql: str) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def test_throwaway_cluster_starts_and_vanishes() -> None:
    with Cluster.throwaway() as cluster:
        data_dir = cluster.data_dir
        assert await query(cluster.dsn(), "SELECT current_user") == "postgres"
        assert await query(cluster.dsn(), "SHOW fsync") == "off"
    assert not data_dir.exists()
    assert server_processes(data_dir) == []


async def test_throwaway_cluster_as_nobody() -> None:
    """The fallback for where unshare is forbidden (Docker's default seccomp profile)."""
    if os.geteuid() != 0:
        pytest.skip("only root switches user")
    nobody = pwd.getpwnam("nobody")
    identity = ChildIdentity("unprivileged-user", nobody.pw_uid, nobody.pw_gid)
    with Cluster.throwaway(identity=identity) as cluster:
        assert cluster.data_dir.stat().st_uid == nobody.pw_uid
        assert await query(cluster.dsn(), "SELECT 1") == 1


async def test_ensure_database(tmp_path: Path) -> None:
    with Cluster.throwaway() as cluster:
        assert await cluster.ensure_database("pgjobd")
        assert not await cluster.ensure_database("pgjobd")
        assert await query(cluster.dsn("pgjobd"), "SELECT current_database()") == "pgjobd"


async def test_persistent_cluster_keeps_data_and_port(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "data")
    with cluster:
        port = cluster.port
        await query(cluster.dsn(), "CREATE TABLE kept AS SELECT 42 AS answer")
        assert await query(cluster.dsn(), "SHOW synchronous_commit") == "on"
    assert server_processes(cluster.data_dir) == []
    with cluster:
        assert cluster.port == port
        assert await query(cluster.dsn(), "SELECT answer FROM kept") == 42


async def test_adopts_a_server_left_behind(tmp_path: Path) -> None:
    first = Cluster(tmp_path / "data")
    first.start()
    postmaster = first.pid
    # A second Cluster knows nothing of the first: as after a kill -9 of `pgjobd dev`.
    second = Cluster(tmp_path / "data")
    second.start()
    try:
        assert second.adopted
        assert second.pid == postmaster
        assert second.port == first.port
        assert await query(second.dsn(), "SELECT pg_backend_pid() > 0")
        assert postmasters(second.data_dir) == [postmaster]
    finally:
        second.stop()
    assert server_processes(second.data_dir) == []
    first.stop()  # reaps the child; the server is already gone


async def test_crash_and_restart_keeps_committed_rows(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "data", settings=KILL_SAFE_SETTINGS)
    cluster.start()
    try:
        await query(cluster.dsn(), "CREATE TABLE t AS SELECT g FROM generate_series(1, 100) g")
        conn = await asyncpg.connect(cluster.dsn())
        await conn.execute("INSERT INTO t VALUES (101)")
        cluster.kill()
        assert server_processes(cluster.data_dir) == []
        assert (cluster.data_dir / "postmaster.pid").exists()  # stale now
        with pytest.raises((OSError, asyncpg.PostgresError, asyncpg.InterfaceError)):
            await conn.fetchval("SELECT 1")
        conn.terminate()
        cluster.start()
        assert not cluster.adopted
        assert await query(cluster.dsn(), "SELECT count(*) FROM t") == 101
    finally:
        cluster.stop()


async def test_stale_pid_file_of_a_dead_process(tmp_path: Path, dead_pid: int) -> None:
    cluster = Cluster(tmp_path / "data")
    cluster.init()
    (cluster.data_dir / "postmaster.pid").write_text(
        f"{dead_pid}\n{cluster.data_dir}\n0\n54329\n\n127.0.0.1\n0 0\nready\n"
    )
    with cluster:
        assert not cluster.adopted
        assert await query(cluster.dsn(), "SELECT 1") == 1


async def test_stale_pid_file_of_a_reused_pid(tmp_path: Path, bystander: int) -> None:
    """postmaster.pid naming a live process that is no postmaster does not block start."""
    cluster = Cluster(tmp_path / "data")
    cluster.init()
    (cluster.data_dir / "postmaster.pid").write_text(
        f"{bystander}\n{cluster.data_dir}\n0\n54329\n\n127.0.0.1\n0 0\nready\n"
    )
    with cluster:
        assert not cluster.adopted
        assert cluster.pid != bystander
        assert await query(cluster.dsn(), "SELECT 1") == 1


async def test_immediate_stop_leaves_nothing(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "data")
    cluster.start()
    conn = await asyncpg.connect(cluster.dsn())
    cluster.stop("immediate")
    conn.terminate()
    assert server_processes(cluster.data_dir) == []
    assert cluster.pid is None


async def test_schema_fixture_migrates_a_schema_of_its_own(
    conn: asyncpg.Connection, schema: str, schema_name: str
) -> None:
    assert schema == schema_name
    assert schema.startswith("t_")
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('hello', '{{}}'::jsonb)")
    assert await conn.fetchval(f"SELECT kind FROM {schema}.job WHERE id = $1", job_id) == "hello"
