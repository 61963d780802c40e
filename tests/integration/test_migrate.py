"""Migrations on a real server: idempotence, concurrency, refusal of newer schemas, and
the independence of two schemas in one database."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import date, timedelta
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import Client, migrate
from pgjobd.errors import SchemaError
from pgjobd.lock_keys import LEADER, MIGRATE, lock_key
from pgjobd.queries import for_schema
from pgjobd.statements.job import CompleteRow

pytestmark = pytest.mark.anyio


@pytest.fixture
async def scratch_schema(conn: asyncpg.Connection) -> AsyncIterator[str]:
    """A schema name that does not exist yet; dropped after the test."""
    name = f"m_{uuid.uuid4().hex[:12]}"
    yield name
    await conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


async def test_migrate_applies_every_version_once(
    conn: asyncpg.Connection, scratch_schema: str
) -> None:
    first = await migrate.migrate(conn, scratch_schema)
    second = await migrate.migrate(conn, scratch_schema)

    assert first == [m.version for m in migrate.available()]
    assert second == []
    rows = await conn.fetch(f"SELECT version FROM {scratch_schema}.migration ORDER BY 1")
    assert [r["version"] for r in rows] == first
    assert await migrate.check_schema(conn, scratch_schema) == migrate.code_version()


async def test_migrate_creates_today_and_the_next_days_partitions(
    conn: asyncpg.Connection, schema: str
) -> None:
    expected_days = await conn.fetch(
        "SELECT to_char(d, 'YYYYMMDD') AS day FROM generate_series("
        "(now() AT TIME ZONE 'UTC')::date, (now() AT TIME ZONE 'UTC')::date + $1::int, "
        "interval '1 day') AS d",
        migrate.PARTITION_DAYS_AHEAD,
    )
    for parent in ("job_history", "job_attempt"):
        partitions = await conn.fetch(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = $1::regclass",
            f"{schema}.{parent}",
        )
        names = {r["relname"] for r in partitions}
        for row in expected_days:
            assert f"{parent}_p{row['day']}" in names
        assert f"{parent}_default" not in names  # see docs/decisions.md


async def _pgjobd_migrate(dsn: str, schema: str, *extra: str) -> subprocess.CompletedProcess[bytes]:
    """`pgjobd migrate` as a real process, with no DSN in its environment but --dsn."""
    env = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    command = [sys.executable, "-m", "pgjobd", "migrate", "--dsn", dsn, "--schema", schema]
    return await anyio.run_process([*command, *extra], env=env, check=False)


async def test_three_processes_migrating_at_once_leave_one_schema(
    dsn: str, conn: asyncpg.Connection, scratch_schema: str
) -> None:
    results: list[subprocess.CompletedProcess[bytes]] = []

    async def run_one() -> None:
        results.append(await _pgjobd_migrate(dsn, scratch_schema))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(run_one)

    outputs = [(r.stdout.decode(), r.stderr.decode()) for r in results]
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    applied = [out for out, _ in outputs if "applied" in out]
    assert len(applied) == 1, outputs  # exactly one of them did the work
    rows = await conn.fetch(f"SELECT version FROM {scratch_schema}.migration ORDER BY 1")
    assert [r["version"] for r in rows] == [m.version for m in migrate.available()]


async def test_dry_run_prints_the_sql_and_changes_nothing(
    dsn: str, conn: asyncpg.Connection, scratch_schema: str
) -> None:
    result = await _pgjobd_migrate(dsn, scratch_schema, "--dry-run")

    assert result.returncode == 0, result.stderr
    script = result.stdout.decode()
    assert f"CREATE TABLE {scratch_schema}.job (" in script
    assert f"CREATE FUNCTION {scratch_schema}.enqueue(" in script
    assert "{{schema}}" not in script
    exists = await conn.fetchval(
        "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", scratch_schema
    )
    assert not exists


async def test_a_schema_newer_than_the_code_is_refused_by_migrate_but_used_by_clients(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    """Expand/contract: the next release's expansions leave this release working; only
    its migrate refuses (it cannot know what the newer migrations built)."""
    newer = migrate.code_version() + 7
    await conn.execute(
        f"INSERT INTO {schema}.migration (version, name, checksum) VALUES ($1, 'future', 'x')",
        newer,
    )

    assert await migrate.check_schema(conn, schema, deep=True) == newer
    async with await Client.connect(dsn, schema=schema) as client:
        assert await client.enqueue("k") > 0

    result = await _pgjobd_migrate(dsn, schema)
    assert result.returncode == 1
    assert f"version {newer}" in result.stderr.decode()
    assert f"up to {migrate.code_version()}" in result.stderr.decode()


async def test_a_newer_contract_migration_is_refused_by_clients_and_members(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    newer = migrate.code_version() + 2
    await conn.execute(
        f"INSERT INTO {schema}.migration (version, name, checksum) "
        "VALUES ($1, 'contract_drop_old_columns', 'x')",
        newer,
    )
    with pytest.raises(SchemaError) as refused:
        await migrate.check_schema(conn, schema)
    message = str(refused.value)
    assert f"version {newer}" in message and f"{newer:04d}_contract_drop_old_columns" in message
    with pytest.raises(SchemaError):
        await Client.connect(dsn, schema=schema)


async def test_a_missing_schema_is_reported_with_what_to_run(
    conn: asyncpg.Connection, scratch_schema: str
) -> None:
    with pytest.raises(SchemaError, match=r"does not exist.*pgjobd migrate"):
        await migrate.check_schema(conn, scratch_schema)


async def test_an_applied_migration_that_changed_is_refused(
    conn: asyncpg.Connection, schema: str
) -> None:
    await conn.execute(f"UPDATE {schema}.migration SET checksum = 'edited' WHERE version = 1")

    with pytest.raises(SchemaError, match="changed after it was applied"):
        await migrate.migrate(conn, schema)


async def test_hot_table_has_the_partial_claim_index_and_storage_parameters(
    conn: asyncpg.Connection, schema: str
) -> None:
    claim_index = await conn.fetchval(
        "SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i WHERE i.indexrelid = $1::regclass",
        f"{schema}.job_claim_idx",
    )
    assert "(queue, priority, run_at, id)" in claim_index
    assert "WHERE (state = 'available'" in claim_index

    options = await conn.fetchval(
        "SELECT reloptions FROM pg_class WHERE oid = $1::regclass", f"{schema}.job"
    )
    assert "fillfactor=70" in options
    assert "autovacuum_vacuum_scale_factor=0.0" in options


async def test_future_jobs_stay_out_of_the_claim_index(
    conn: asyncpg.Connection, schema: str
) -> None:
    await conn.execute(
        f"SELECT {schema}.enqueue('later', '{{}}', delay => interval '1 hour') "
        "FROM generate_series(1, 50)"
    )
    await conn.execute(f"SELECT {schema}.enqueue('now', '{{}}') FROM generate_series(1, 3)")
    await conn.execute(f"VACUUM ANALYZE {schema}.job")

    indexed = await conn.fetchval(
        f"SELECT count(*) FROM (SELECT id FROM {schema}.job WHERE state = 'available' "
        "AND queue = 'default' ORDER BY priority, run_at, id) AS claimable"
    )
    entries = await conn.fetchval(
        "SELECT reltuples FROM pg_class WHERE oid = $1::regclass", f"{schema}.job_claim_idx"
    )
    assert indexed == 3
    assert entries == 3


async def test_two_schemas_in_one_database_are_independent(
    dsn: str, conn: asyncpg.Connection, scratch_schema: str, schema: str
) -> None:
    other = scratch_schema
    await migrate.migrate(conn, other)
    assert lock_key(MIGRATE, schema) != lock_key(MIGRATE, other)
    assert lock_key(LEADER, schema) != lock_key(LEADER, other)

    heard: list[tuple[str, str]] = []
    listener = await asyncpg.connect(dsn)
    try:
        for name in (schema, other):
            channel = f"{name}.job_ready"
            await listener.add_listener(
                channel, lambda _c, _pid, ch, payload: heard.append((ch, payload))
            )
        await conn.execute(f"SELECT {schema}.enqueue('only_here', '{{}}', queue => 'mine')")
        await listener.execute("SELECT 1")  # notifications arrive before this answer
    finally:
        await listener.close()

    assert heard == [(f"{schema}.job_ready", "mine")]
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 1
    assert await conn.fetchval(f"SELECT count(*) FROM {other}.job") == 0
    await conn.execute(f"DROP SCHEMA {other} CASCADE")
    assert await migrate.check_schema(conn, schema) == migrate.code_version()


# -- a schema in a bad state: missing, altered and foreign objects ------------------------


async def _migrate_refused(conn: asyncpg.Connection, schema: str) -> str:
    with pytest.raises(SchemaError) as refused:
        await migrate.migrate(conn, schema)
    return str(refused.value)


async def test_a_freshly_migrated_schema_matches_its_migrations(
    conn: asyncpg.Connection, schema: str
) -> None:
    found = await migrate.verify(conn, schema)

    assert (found.missing, found.altered, found.foreign, found.skipped) == ([], [], [], None)
    assert await migrate.check_schema(conn, schema, deep=True) == migrate.code_version()


async def test_the_expected_catalog_comes_from_the_migration_files(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Whatever migrations exist: the scratch build of the last version is what a real
    migrate leaves, object for object (so no list of objects is kept by hand)."""
    latest = migrate.code_version()
    expected = await migrate.expected_catalogs(conn, schema, [0, latest])
    actual = await migrate.read_catalog(conn, schema)

    assert expected[latest] == actual
    assert ("relation", "migration") in expected[0]  # version 0: the bootstrap only
    assert all(obj.relation == "migration" for obj in expected[0].values())
    for name in ("job", "job_history", "job_attempt", "migration"):
        assert ("relation", name) in actual
    scratch_left = await conn.fetchval(
        "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'pgjobd_verify_%'"
    )
    assert scratch_left == 0  # rolled back


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("DROP TABLE {s}.job_attempt", "table {s}.job_attempt is missing"),
        (
            "ALTER TABLE {s}.job ALTER COLUMN fence TYPE text",
            "column {s}.job.fence has type text, expected bigint",
        ),
        (
            "ALTER TABLE {s}.job ALTER COLUMN kind DROP NOT NULL",
            "column {s}.job.kind is nullable, expected NOT NULL",
        ),
        ("ALTER TABLE {s}.job DROP COLUMN tenant", "column {s}.job.tenant is missing"),
        (
            "DROP FUNCTION {s}.partitions_ensure(integer)",
            "function {s}.partitions_ensure(days_ahead integer) is missing",
        ),
        ("DROP INDEX {s}.job_claim_idx", "index {s}.job_claim_idx is missing"),
        (
            "DROP INDEX {s}.job_due_idx; CREATE INDEX job_due_idx ON {s}.job (run_at, id)",
            "index {s}.job_due_idx has definition CREATE INDEX job_due_idx ON {s}.job "
            "USING btree (run_at, id), expected",
        ),
        ("ALTER TABLE {s}.job RESET (fillfactor)", "table {s}.job has storage options"),
        ("ALTER TYPE {s}.job_state ADD VALUE 'paused'", "enum type {s}.job_state has definition"),
        ("DROP SEQUENCE {s}.fence_seq CASCADE", "sequence {s}.fence_seq is missing"),
        (
            "CREATE OR REPLACE FUNCTION {s}.partitions_ensure(days_ahead integer) "
            "RETURNS integer LANGUAGE plpgsql SECURITY DEFINER "
            "SET search_path = pg_catalog, pg_temp AS $$ BEGIN RETURN 0; END $$",
            "function {s}.partitions_ensure(days_ahead integer) has a different body",
        ),
    ],
)
async def test_migrate_names_each_missing_or_altered_object_and_changes_nothing(
    dsn: str, conn: asyncpg.Connection, schema: str, damage: str, problem: str
) -> None:
    await conn.execute(damage.format(s=schema))
    before = await migrate.read_catalog(conn, schema)

    message = await _migrate_refused(conn, schema)
    result = await _pgjobd_migrate(dsn, schema)

    assert problem.format(s=schema) in message
    assert "Nothing was changed" in message
    assert result.returncode == 1
    assert problem.format(s=schema) in result.stderr.decode()
    assert await migrate.read_catalog(conn, schema) == before
    with pytest.raises(SchemaError, match="does not match its migrations"):
        await migrate.check_schema(conn, schema, deep=True)  # a member would not start


async def test_migrate_refuses_a_schema_that_already_holds_a_table_of_someone_else(
    dsn: str, conn: asyncpg.Connection, scratch_schema: str
) -> None:
    await conn.execute(f"CREATE SCHEMA {scratch_schema}")
    await conn.execute(f"CREATE TABLE {scratch_schema}.foo (x integer)")
    await conn.execute(f"CREATE VIEW {scratch_schema}.bar AS SELECT 1 AS one")

    message = await _migrate_refused(conn, scratch_schema)
    result = await _pgjobd_migrate(dsn, scratch_schema)
    dry_run = await _pgjobd_migrate(dsn, scratch_schema, "--dry-run")

    assert f"table {scratch_schema}.foo" in message
    assert f"view {scratch_schema}.bar" in message
    assert "did not create" in message
    assert result.returncode == 1 and f"table {scratch_schema}.foo" in result.stderr.decode()
    assert dry_run.returncode == 1 and dry_run.stdout == b""
    tables = await conn.fetch(
        "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = $1 ORDER BY 1",
        scratch_schema,
    )
    assert [r["relname"] for r in tables] == ["bar", "foo"]  # no migration table either


async def test_migrate_uses_an_empty_schema_made_ahead_of_it(
    conn: asyncpg.Connection, scratch_schema: str
) -> None:
    await conn.execute(f"CREATE SCHEMA {scratch_schema}")

    assert await migrate.migrate(conn, scratch_schema) == [m.version for m in migrate.available()]
    assert not (await migrate.verify(conn, scratch_schema)).broken


async def _apply_unverified(
    conn: asyncpg.Connection, schema: str, migrations: list[migrate.Migration]
) -> None:
    """Applies `migrations` (a schema at an older version), as migrate would record them."""
    await conn.execute(migrate.sql_text.render(migrate._BOOTSTRAP, schema))
    for m in migrations:
        await conn.execute(migrate.sql_text.render(m.sql, schema))
        await conn.execute(
            f"INSERT INTO {schema}.migration (version, name, checksum) VALUES ($1, $2, $3)",
            m.version, m.name, m.checksum,
        )  # fmt: skip


async def test_a_stray_table_stops_pending_migrations_before_any_is_applied(
    conn: asyncpg.Connection, scratch_schema: str
) -> None:
    """A schema one version behind, with a table of someone else's: nothing is applied."""
    older = migrate.available()[:-1]
    await _apply_unverified(conn, scratch_schema, older)
    assert not (await migrate.verify(conn, scratch_schema)).foreign  # compared at its version
    await conn.execute(f"CREATE TABLE {scratch_schema}.reports (id integer)")

    message = await _migrate_refused(conn, scratch_schema)

    assert f"table {scratch_schema}.reports" in message
    versions = await conn.fetch(f"SELECT version FROM {scratch_schema}.migration ORDER BY 1")
    assert [r["version"] for r in versions] == [m.version for m in older]


async def test_extra_objects_in_a_used_schema_are_refused_by_migrate_and_only_warned_at_start(
    conn: asyncpg.Connection, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    await conn.execute(f"CREATE INDEX my_report_idx ON {schema}.job (kind)")
    await conn.execute(
        f"CREATE FUNCTION {schema}.my_helper() RETURNS int LANGUAGE sql AS 'SELECT 1'"
    )

    message = await _migrate_refused(conn, schema)
    with caplog.at_level("WARNING", logger="pgjobd.migrate"):
        version = await migrate.check_schema(conn, schema, deep=True)

    assert f"index {schema}.my_report_idx" in message
    assert f"function {schema}.my_helper()" in message
    assert version == migrate.code_version()
    assert f"index {schema}.my_report_idx" in caplog.text


async def test_what_the_fleet_itself_leaves_in_the_schema_is_not_foreign(
    conn: asyncpg.Connection, schema: str
) -> None:
    """Partitions (attached, or detached by a rotator stopped before its DROP) and an
    interrupted REINDEX CONCURRENTLY's invalid copy are the fleet's own."""
    await conn.execute(
        f"CREATE TABLE {schema}.job_history_p20200101 PARTITION OF {schema}.job_history "
        "FOR VALUES FROM ('2020-01-01 00:00+00') TO ('2020-01-02 00:00+00')"
    )
    await conn.execute(
        f"CREATE TABLE {schema}.job_attempt_p20200101 PARTITION OF {schema}.job_attempt "
        "FOR VALUES FROM ('2020-01-01 00:00+00') TO ('2020-01-02 00:00+00')"
    )
    await conn.execute(f"ALTER TABLE {schema}.job_attempt DETACH PARTITION "
                       f"{schema}.job_attempt_p20200101")  # fmt: skip
    await conn.execute(f"CREATE INDEX job_claim_idx_ccnew ON {schema}.job (queue)")

    found = await migrate.verify(conn, schema)

    assert (found.missing, found.altered, found.foreign) == ([], [], [])
    assert await migrate.migrate(conn, schema) == []


# -- partitions at the day boundary (the suite must pass at any UTC hour) ------------------


async def _partition_of(conn: asyncpg.Connection, table: str, where: str) -> str:
    name: str = await conn.fetchval(f"SELECT tableoid::regclass::text FROM {table} WHERE {where}")
    return name.rsplit(".", 1)[-1]


async def test_a_record_written_just_before_midnight_utc_has_a_partition(
    conn: asyncpg.Connection, schema: str
) -> None:
    """A transaction that began at 23:59:59.999 UTC writes that time after midnight, and a
    fresh schema must take it: migrate makes yesterday's partitions too (before, only
    today's on: a history row dated `now() - 3 hours` failed from 00:00 to 03:00 UTC)."""
    midnight = "(date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC')"
    yesterday: date = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date - 1")
    await conn.execute(
        f"INSERT INTO {schema}.job_history (id, finished_at, run_at, enqueued_at, attempt, "
        "max_attempts, priority, state, queue, kind, args) VALUES "
        f"(1, {midnight} - interval '1 ms', now(), now(), 1, 1, 0, 'completed', 'q', 'k', '{{}}')"
    )
    await conn.execute(
        f"INSERT INTO {schema}.job_attempt (job_id, failed_at, attempt, queue, kind, outcome) "
        f"VALUES (1, {midnight} - interval '23 hours', 1, 'q', 'k', 'failed')"
    )

    day = f"{yesterday:%Y%m%d}"
    assert await _partition_of(conn, f"{schema}.job_history", "id = 1") == f"job_history_p{day}"
    assert await _partition_of(conn, f"{schema}.job_attempt", "job_id = 1") == (
        f"job_attempt_p{day}"
    )


async def test_past_partitions_for_a_given_day_across_a_month_end(
    conn: asyncpg.Connection, schema: str
) -> None:
    created = await migrate.ensure_past_partitions(conn, schema, today=date(2026, 3, 1))
    again = await migrate.ensure_past_partitions(conn, schema, today=date(2026, 3, 1))

    assert created == 2 * migrate.PARTITION_DAYS_BACK
    assert again == 0
    await conn.execute("SET TIME ZONE 'UTC'")  # the bounds are printed in the session's
    bounds = await conn.fetchval(
        "SELECT pg_get_expr(c.relpartbound, c.oid) FROM pg_class c WHERE c.oid = $1::regclass",
        f"{schema}.job_history_p20260228",
    )
    assert bounds == "FOR VALUES FROM ('2026-02-28 00:00:00+00') TO ('2026-03-01 00:00:00+00')"
    assert await conn.fetchval("SELECT to_regclass($1) IS NOT NULL",
                               f"{schema}.job_attempt_p20260228")  # fmt: skip
    assert not (await migrate.verify(conn, schema)).foreign  # partitions are the fleet's own


async def test_a_late_completion_of_an_old_job_lands_in_todays_partition(
    conn: asyncpg.Connection, schema: str
) -> None:
    """finished_at is when the outcome is written, not when the job was due or claimed:
    a job due days ago and finished now is today's record (and kept as long as any)."""
    q = for_schema(schema)
    job_id = await conn.fetchval(
        f"SELECT {schema}.enqueue('old', '{{}}', run_at => now() - interval '3 days')"
    )
    await conn.execute(f"UPDATE {schema}.job SET enqueued_at = now() - interval '3 days', "
                       "state = 'available' WHERE id = $1", job_id)  # fmt: skip
    [claimed] = await q.job_claim(conn, "default", 1, "m-1", timedelta(hours=1))
    await conn.execute(f"UPDATE {schema}.job SET attempted_at = now() - interval '2 days' "
                       "WHERE id = $1", job_id)  # fmt: skip

    finished = await q.job_complete_many(conn, [CompleteRow(job_id, claimed.fence, None, True)])

    assert [r.id for r in finished] == [job_id]
    today: date = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    assert await _partition_of(conn, f"{schema}.job_history", f"id = {job_id}") == (
        f"job_history_p{today:%Y%m%d}"
    )


async def test_a_role_that_may_not_create_the_scratch_schema_skips_the_comparison(
    dsn: str, conn: asyncpg.Connection, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A member running as a least-privilege role (no CREATE on the database) still
    starts: the version is checked, the object comparison skipped with a warning."""
    role = f"nocreate_{uuid.uuid4().hex[:8]}"
    await conn.execute(f"CREATE ROLE {role} LOGIN")
    try:
        await conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        await conn.execute(f"GRANT SELECT ON {schema}.migration TO {role}")
        limited = await asyncpg.connect(dsn, user=role)
        try:
            found = await migrate.verify(limited, schema)
            with caplog.at_level("WARNING", logger="pgjobd.migrate"):
                version = await migrate.check_schema(limited, schema, deep=True)
            assert await limited.fetchval("SELECT 1") == 1  # the connection is still usable
        finally:
            await limited.close()
    finally:
        await conn.execute(f"DROP OWNED BY {role}")
        await conn.execute(f"DROP ROLE {role}")

    assert found.skipped is not None and "may not create" in found.skipped
    assert not found.broken and not found.foreign
    assert version == migrate.code_version()
    assert "not compared with the migrations" in caplog.text


async def test_a_member_does_not_start_on_a_schema_missing_an_object(
    dsn: str, conn: asyncpg.Connection, schema: str, tmp_path: Path
) -> None:
    await conn.execute(f"DROP FUNCTION {schema}.partitions_ensure(integer)")
    (tmp_path / "handlers").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}

    with anyio.fail_after(60):
        result = await anyio.run_process(
            [sys.executable, "-m", "pgjobd", "run", "--dsn", dsn, "--schema", schema],
            cwd=tmp_path, env={**env, "PGJOBD_CONFIG": ""}, check=False,
        )  # fmt: skip

    assert result.returncode == 1
    stderr = result.stderr.decode()
    assert f"function {schema}.partitions_ensure(days_ahead integer) is missing" in stderr


async def test_migrations_that_only_build_committed_one_by_one_are_applied_unverified(
    conn: asyncpg.Connection, scratch_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An enum value added by one migration and used by the next cannot be built in the
    single scratch transaction: migrate says the comparison was skipped, and works."""
    shipped = migrate.available()
    n = len(shipped)
    added = [
        migrate.Migration(n + 1, "parked", "ALTER TYPE {{schema}}.job_state ADD VALUE 'parked';"),
        migrate.Migration(
            n + 2, "use_parked",
            "CREATE FUNCTION {{schema}}.parked() RETURNS {{schema}}.job_state LANGUAGE sql "
            "AS $$ SELECT 'parked'::{{schema}}.job_state $$;",
        ),
    ]  # fmt: skip
    monkeypatch.setattr(migrate, "available", lambda: [*shipped, *added])

    first = await migrate.migrate(conn, scratch_schema)
    found = await migrate.verify(conn, scratch_schema)
    again = await migrate.migrate(conn, scratch_schema)

    assert first[-2:] == [n + 1, n + 2] and again == []
    # PostgreSQL 15 refuses the new value in the transaction that added it, so the check
    # is skipped; 18 allows it for a type created in the same transaction (as the scratch
    # build's is), builds it, and must then find nothing different.
    if found.skipped is not None:
        assert "did not build in a scratch schema" in found.skipped
        assert "unsafe use of new value" in found.skipped
    else:
        assert (found.missing, found.altered, found.foreign) == ([], [], [])


async def test_dependencies_made_before_the_flag_existed_are_settled(
    conn: asyncpg.Connection, scratch_schema: str
) -> None:
    """A database migrated with edges in place: the migration flags their dependencies."""
    flag = next(m for m in migrate.available() if m.name == "settle_dependants")
    await _apply_unverified(
        conn, scratch_schema, [m for m in migrate.available() if m.version < flag.version]
    )
    await conn.execute(
        migrate.sql_text.render("SELECT {{schema}}.partitions_ensure(2)", scratch_schema)
    )
    parent = await conn.fetchval(f"SELECT {scratch_schema}.enqueue('parent', '{{}}'::jsonb)")
    child = await conn.fetchval(
        f"SELECT {scratch_schema}.enqueue('child', '{{}}'::jsonb, depends_on => $1)", [parent]
    )
    await migrate.migrate(conn, scratch_schema)
    q = for_schema(scratch_schema)
    [job] = await q.job_claim(conn, "default", 10, "m1", timedelta(seconds=30))
    await q.job_complete_many(conn, [CompleteRow(job.id, job.fence, None, True)])
    state = await conn.fetchval(
        f"SELECT state::text FROM {scratch_schema}.job WHERE id = $1", child
    )
    assert job.id == parent and state == "available"


async def test_the_web_console_migration_gives_old_dead_records_their_last_fingerprint(
    conn: asyncpg.Connection, scratch_schema: str
) -> None:
    """Dead records written before job_history had a fingerprint get their last failed
    attempt's (what job_fingerprint(id) answered), so `dlq list` and the console group
    them as before; other records get none."""
    s = scratch_schema
    ours = next(m for m in migrate.available() if m.name == "web_console")
    await _apply_unverified(conn, s, [m for m in migrate.available() if m.version < ours.version])
    await conn.execute(f"SELECT {s}.partitions_ensure(1)")
    await conn.execute(
        f"""INSERT INTO {s}.job_history (id, finished_at, run_at, enqueued_at, attempt,
                max_attempts, priority, state, reason, queue, kind, owner, args)
            VALUES (1, now(), now(), now(), 2, 2, 0, 'dead', 'attempts_exhausted', 'q', 'k',
                    'm', '{{}}'),
                   (2, now(), now(), now(), 1, 1, 0, 'completed', NULL, 'q', 'k', 'm', '{{}}'),
                   (3, now(), now(), now(), 0, 1, 0, 'dead', 'expired', 'q', 'k', 'm', '{{}}')"""
    )
    await conn.execute(
        f"""INSERT INTO {s}.job_attempt (job_id, attempt, queue, kind, outcome, fingerprint)
            VALUES (1, 1, 'q', 'k', 'failed', 'first'), (1, 2, 'q', 'k', 'failed', 'last'),
                   (2, 1, 'q', 'k', 'failed', 'retried')"""
    )

    assert await migrate.migrate(conn, s) == [m.version for m in migrate.available()
                                              if m.version >= ours.version]  # fmt: skip

    rows = await conn.fetch(f"SELECT id, fingerprint FROM {s}.job_history ORDER BY id")
    assert [(r["id"], r["fingerprint"]) for r in rows] == [(1, "last"), (2, None), (3, None)]
    assert not (await migrate.verify(conn, s)).broken
