"""The upgrade rehearsal: a fleet of the previous release (v0.1.0, in a virtualenv of its
own) is upgraded one member at a time. Its schema is migrated to this release's while
its members run, new members join beside them, the old ones are killed with SIGKILL,
and every job ends once, completed, with the attempts it took. And the reverse: a member
or client of this release is refused an older schema, with the pending migrations
named, and `migrate --status` lists them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import Client, migrate
from pgjobd.errors import SchemaError

from .conftest import MemberProcess, wait_until
from .previous_release import Unavailable, install_previous_release

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(600)]
HANDLERS = Path(__file__).parent / "upgrade_handlers"


@pytest.fixture(scope="session")
def old_pgjobd() -> Path:
    try:
        return install_previous_release()
    except Unavailable as e:
        pytest.skip(f"upgrade rehearsal: {e}")


@pytest.fixture
async def old_schema(
    dsn: str, conn: asyncpg.Connection, schema_name: str, old_pgjobd: Path
) -> AsyncIterator[str]:
    """The test's schema, created by the previous release's `pgjobd migrate`."""
    try:
        await _run([str(old_pgjobd), "migrate", "--dsn", dsn, "--schema", schema_name])
        yield schema_name
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema_name} CASCADE")


async def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    done = await anyio.run_process(argv, env=env, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{argv} exited {done.returncode}:\n{done.stderr.decode()}")
    return done


def _config(tmp_path: Path, schema: str) -> Path:
    path = tmp_path / "member.toml"
    path.write_text(
        f'[database]\nschema = "{schema}"\n\n'
        f'[daemon]\nhandlers = ["{HANDLERS}"]\nlease = "2s"\ndrain_timeout = "5s"\n'
        'metrics_listen = ""\nlog_format = "json"\n\n'
        '[queues.default]\nconcurrency = 4\nprocesses = 1\nbackoff_base = "0s"\n'
        'backoff_max = "10ms"\n'
    )
    return path


async def _start(executable: list[str], config: Path, dsn: str, log: Path) -> MemberProcess:
    env = {**os.environ, "PGJOBD_DSN": dsn}
    env.pop("DATABASE_URL", None)
    with log.open("wb") as out:
        process = await anyio.open_process(
            [*executable, "run", "--config", str(config)], stdout=out, stderr=out, env=env
        )
    return MemberProcess(process, log)


async def _member_id(conn: asyncpg.Connection, schema: str, member: MemberProcess) -> str:
    async def joined() -> str | None:
        if member.process.returncode is not None:
            raise AssertionError(f"member exited:\n{member.log[-3000:]}")
        found: str | None = await conn.fetchval(
            f"SELECT id FROM {schema}.member WHERE pid = $1", member.process.pid
        )
        return found

    member_id: str = await wait_until(joined, timeout_s=60, what="member joined")
    return member_id


async def _enqueue(conn: asyncpg.Connection, schema: str, kind: str, count: int) -> list[int]:
    rows = await conn.fetch(
        f"SELECT {schema}.enqueue($1, jsonb_build_object('n', g)) AS id "
        "FROM generate_series(1, $2) AS g",
        kind,
        count,
    )
    return [r["id"] for r in rows]


async def test_a_fleet_of_the_previous_release_upgrades_one_member_at_a_time(
    dsn: str, conn: asyncpg.Connection, old_schema: str, old_pgjobd: Path, tmp_path: Path
) -> None:
    schema = old_schema
    config = _config(tmp_path, schema)
    old = [await _start([str(old_pgjobd)], config, dsn, tmp_path / f"old{i}.log") for i in (0, 1)]
    new: list[MemberProcess] = []
    try:
        old_ids = [await _member_id(conn, schema, m) for m in old]
        before = await _enqueue(conn, schema, "steady", 40)
        before += await _enqueue(conn, schema, "fails_once", 10)

        applied = await migrate.migrate(conn, schema)  # while the old members run
        assert applied and max(applied) == migrate.code_version()
        during = await _enqueue(conn, schema, "steady", 20)

        async def old_ran_after_migrate() -> bool:
            return bool(await conn.fetchval(
                f"SELECT count(*) FROM {schema}.job_history "
                "WHERE id = ANY($1::bigint[]) AND owner = ANY($2::text[])", during, old_ids,
            ))  # fmt: skip

        await wait_until(old_ran_after_migrate, timeout_s=60, what="old members on the new schema")
        new = [await _start([sys.executable, "-m", "pgjobd"], config, dsn, tmp_path / "new.log")]
        await _member_id(conn, schema, new[0])
        after = await _enqueue(conn, schema, "steady", 20)
        for member in old:
            member.send_signal(signal.SIGKILL)
            await member.process.wait()
        async with await Client.connect(dsn, schema=schema) as client:
            after += await client.enqueue_many([("fails_once", {"n": n}) for n in range(10)])

        every = before + during + after

        async def all_final() -> bool:
            done = await conn.fetchval(
                f"SELECT count(DISTINCT id) FROM {schema}.job_history WHERE id = ANY($1::bigint[])",
                every,
            )
            return bool(done == len(every))

        await wait_until(all_final, timeout_s=90, what="every job final")
        records = await conn.fetch(
            f"SELECT h.id, h.kind, h.state::text AS state, h.attempt, "
            f"(SELECT count(*) FROM {schema}.job_attempt AS a WHERE a.job_id = h.id) AS failed "
            f"FROM {schema}.job_history AS h WHERE h.id = ANY($1::bigint[])",
            every,
        )
        assert len(records) == len(every), "a job has more than one final record"
        wrong = [dict(r) for r in records if r["state"] != "completed"]
        assert not wrong, wrong
        for r in records:
            # Every attempt before the last one failed and left its row: a retry, or a
            # lease lost with a killed member.
            assert r["attempt"] == r["failed"] + 1, dict(r)
            if r["kind"] == "fails_once":
                assert r["attempt"] >= 2, dict(r)
        assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0
        assert await new[0].stop() == 0
    finally:
        for member in old + new:
            if member.process.returncode is None:
                member.process.kill()
                await member.process.wait()


async def test_this_release_refuses_an_older_schema_naming_the_pending_migrations(
    dsn: str, conn: asyncpg.Connection, old_schema: str, tmp_path: Path
) -> None:
    schema = old_schema
    applied = await conn.fetchval(f"SELECT max(version) FROM {schema}.migration")
    pending = [f"{m.version:04d}_{m.name}" for m in migrate.available() if m.version > applied]
    assert pending

    status = await _run(
        [sys.executable, "-m", "pgjobd", "migrate", "--status", "--json", "--dsn", dsn,
         "--schema", schema],
    )  # fmt: skip
    listed = json.loads(status.stdout)
    assert [f"{p['version']:04d}_{p['name']}" for p in listed["pending"]] == pending
    assert [a["version"] for a in listed["applied"]] == list(range(1, applied + 1))

    member = await _start(
        [sys.executable, "-m", "pgjobd"], _config(tmp_path, schema), dsn, tmp_path / "new.log"
    )
    with anyio.fail_after(60):
        code = await member.process.wait()
    assert code == 1, member.log[-3000:]
    for name in pending:
        assert name in member.log, member.log[-3000:]
    with pytest.raises(SchemaError, match=pending[0]):
        await Client.connect(dsn, schema=schema)
    assert await conn.fetchval(f"SELECT max(version) FROM {schema}.migration") == applied
