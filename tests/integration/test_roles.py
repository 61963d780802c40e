"""The least-privilege roles of `migrate --roles`, against real login roles: every
table, view, sequence and function of the schema has exactly the privileges the matrix
below declares for each group role (a new object without declared grants fails), and
each role can do what it is for and is refused the rest."""

from __future__ import annotations

import sys
from datetime import timedelta

import anyio
import asyncpg
import pytest

from pgjobd import Client, admin, migrate
from pgjobd.config import Config, DatabaseConfig
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.queries import for_schema
from pgjobd.roles import RoleContext
from pgjobd.roles.partitions import PartitionRotator
from pgjobd.roles.reindexer import IndexSize, Reindexer
from tests.logins import LEFTOVER_INDEX, LOGIN_GROUPS, login_dsn, make_maintenance_work

pytestmark = pytest.mark.anyio

TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
SEQUENCE_PRIVILEGES = ("USAGE", "SELECT", "UPDATE")
READ = {"SELECT"}
WRITE = {"SELECT", "INSERT", "UPDATE", "DELETE"}
NONE: set[str] = set()

# object -> group role -> the privileges it holds (every other one it must not hold).
# Column grants count as the table privilege (has_any_column_privilege).
ROLE_MATRIX: dict[str, dict[str, set[str]]] = {
    "table audit": {"producer": NONE, "readonly": READ, "admin": {"SELECT", "INSERT"},
                    "worker": READ},
    "table cron": {"producer": NONE, "readonly": READ, "admin": WRITE, "worker": WRITE},
    "table job": {"producer": {"SELECT", "INSERT"}, "readonly": READ, "admin": WRITE,
                  "worker": WRITE},
    "table job_attempt": {"producer": READ, "readonly": READ, "admin": {"SELECT", "INSERT",
                          "UPDATE"}, "worker": {"SELECT", "INSERT"}},
    "table job_history": {"producer": READ, "readonly": READ, "admin": WRITE,
                          "worker": {"SELECT", "INSERT"}},
    "table kind": {"producer": READ, "readonly": READ, "admin": READ, "worker": WRITE},
    "table leader": {"producer": NONE, "readonly": READ, "admin": READ, "worker": WRITE},
    "table member": {"producer": NONE, "readonly": READ, "admin": READ, "worker": WRITE},
    "table migration": {"producer": READ, "readonly": READ, "admin": READ, "worker": READ},
    "table queue": {"producer": READ, "readonly": READ, "admin": WRITE, "worker": WRITE},
    "table flow_start": {"producer": NONE, "readonly": READ, "admin": READ, "worker": WRITE},
    "table flow_reservation": {"producer": NONE, "readonly": READ, "admin": READ,
                               "worker": WRITE},
    "table fair_pass": {"producer": NONE, "readonly": READ, "admin": READ, "worker": WRITE},
    "table tenant_weight": {"producer": NONE, "readonly": READ, "admin": READ, "worker": WRITE},
    "table fair_finish": {"producer": NONE, "readonly": READ, "admin": READ, "worker": WRITE},
    "table job_dependency": {"producer": NONE, "readonly": READ, "admin": {"SELECT", "DELETE"},
                             "worker": {"SELECT", "DELETE"}},
    "table queue_sample": {"producer": NONE, "readonly": READ, "admin": READ,
                           "worker": {"SELECT", "INSERT", "DELETE"}},
    "table queue_count": {"producer": NONE, "readonly": READ, "admin": READ, "worker": WRITE},
    "table queue_enqueued": {"producer": NONE, "readonly": READ, "admin": READ,
                             "worker": READ},
    "table queue_depth": {"producer": NONE, "readonly": READ, "admin": READ, "worker": READ},
    "sequence audit_id_seq": {"producer": NONE, "readonly": NONE, "admin": {"USAGE"},
                              "worker": {"USAGE"}},
    "sequence fence_seq": {"producer": NONE, "readonly": NONE, "admin": {"USAGE"},
                           "worker": {"USAGE"}},
    "sequence job_id_seq": {"producer": {"USAGE"}, "readonly": NONE, "admin": {"USAGE"},
                            "worker": {"USAGE"}},
    "sequence leader_term_seq": {"producer": NONE, "readonly": NONE, "admin": {"USAGE"},
                                 "worker": {"USAGE"}},
}  # fmt: skip
EXECUTE = {"EXECUTE"}
_ENQUEUERS = {"producer": EXECUTE, "readonly": NONE, "admin": EXECUTE, "worker": EXECUTE}
_FINISHERS = {"producer": NONE, "readonly": NONE, "admin": EXECUTE, "worker": EXECUTE}
# The daemon only (its claims and its leader's roles).
_LEADER = {"producer": NONE, "readonly": NONE, "admin": NONE, "worker": EXECUTE}
_INTERNAL = {"producer": NONE, "readonly": NONE, "admin": NONE, "worker": NONE}
ROLE_MATRIX |= {
    "function enqueue(text,jsonb,text,integer,timestamp with time zone,text,text,integer,"
    "interval,text,integer,text,bigint[],timestamp with time zone,interval,interval,"
    "bigint[],jsonb)": _ENQUEUERS,
    "function enqueue_many(text[],jsonb[],text[],integer[],timestamp with time zone[],"
    "interval[],text[],text[],integer[],text,integer[],text[],text[],timestamp with time zone[],"
    "interval[],interval[],text[],jsonb[])": _ENQUEUERS,
    "function job_trace_context_ok(jsonb)": _ENQUEUERS,
    "function queue_admit(text[],integer[],boolean[])": _ENQUEUERS,
    "function queue_admit_needed(boolean)": _ENQUEUERS,
    "function job_copy_prepare(text[],text[],integer[],timestamp with time zone[],interval[],"
    "integer[],interval[],timestamp with time zone[],integer[],boolean[],integer)": _ENQUEUERS,
    "function job_claim_flow(text,integer,text,interval)": _LEADER,
    "function job_claim_flow(text,integer,text,interval,bigint[])": _LEADER,
    "function flow_reserve(text,integer,text,bigint[],smallint)": _LEADER,
    "function queue_reservable(text)": _LEADER,
    "function job_group_heads(text,text,text,integer,text[],integer)": _LEADER,
    "function flow_lock(text)": _LEADER,
    "function flow_rate_room(text,integer,interval,timestamp with time zone,integer)": _LEADER,
    "function flow_rate_take(text,interval,timestamp with time zone,integer)": _LEADER,
    "function queue_depth_recount(text[])": _LEADER,
    "function fair_tenant_mark(text)": _LEADER,
    "function job_fair_tenants(text,text,text,integer)": _LEADER,
    "function job_claim_limited(text,integer,text,interval,bigint[])": _LEADER,
    "function job_claim_fair(text,integer,text,interval)": _LEADER,
    "function queue_fair_only(text)": _LEADER,
    "function fair_scan_range(text,integer)": _LEADER,
    "function fair_tag_fill(text)": _LEADER,
    "function fair_best_of_tenants(text,bigint[],double precision)": _LEADER,
    "function flow_allocate(text,text,bigint[],integer)": _LEADER,
    "function job_claim_allocated(text,integer,text,interval,bigint[],smallint,"
    "timestamp with time zone,bigint)": _LEADER,
    "function job_reject_group_key(text,integer,integer)": _INTERNAL,
    "function dead_group_key(text,text)": {
        "producer": NONE,
        "readonly": EXECUTE,
        "admin": EXECUTE,
        "worker": NONE,
    },
    "function job_defaults(text,smallint,integer,text,integer,timestamp with time zone,"
    "interval,integer)": _ENQUEUERS,
    "function job_move(bigint[],bigint[],text[],text[],jsonb[],boolean[],text[])": _FINISHERS,
    # Kept for the members of v0.1.0 through a rolling upgrade (migration 0020).
    "function job_finish(anyarray,text[],text[],jsonb[],boolean[],text[])": _FINISHERS,
    "function job_settle(bigint[],text[])": _FINISHERS,
    "function job_fingerprint(bigint)": {
        "producer": NONE,
        "readonly": EXECUTE,
        "admin": EXECUTE,
        "worker": EXECUTE,
    },
    "function job_block(bigint,bigint[],bigint[],boolean,integer,bigint,text,text)": _INTERNAL,
    "function job_lifecycle_problem(text,timestamp with time zone,interval,interval,"
    "text)": _INTERNAL,
    "function job_replace(bigint,text,text,jsonb,text,smallint,timestamp with time zone,text,"
    "integer,text,text,timestamp with time zone,text)": _INTERNAL,
    "function job_wait_for(bigint[],bigint[])": _INTERNAL,
    "function job_end_reason(text,integer,integer,integer,integer,boolean)": _FINISHERS,
    "function partitions_ensure(integer)": _LEADER,
    "function partition_drop(text,text)": _LEADER,
    # Called only by the SECURITY DEFINER functions above, or by triggers.
    "function job_is_duplicate_key(text)": _INTERNAL,
    "function job_problem(text,jsonb,integer,text,integer,interval,timestamp with time zone,"
    "integer,text,text)": _INTERNAL,
    "function job_reject(text,integer,integer,text,jsonb,integer,text,integer,interval,"
    "integer,timestamp with time zone,text,text)": _INTERNAL,
    "function job_reject_duplicate(text,bigint)": _INTERNAL,
    "function job_tenant_guard()": _INTERNAL,
    "function audit_append_only()": _INTERNAL,
}
OWNED_BY_MAINTAINER = ("job", "job_history", "job_attempt")


async def _objects(conn: asyncpg.Connection, schema: str) -> dict[str, str]:
    """Every table, view, sequence (partitions aside) and function: label -> regclass
    or regprocedure text."""
    found: dict[str, str] = {}
    for row in await conn.fetch(
        "SELECT c.relname, c.relkind::text AS kind FROM pg_class AS c "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f') "
        "AND NOT c.relispartition", schema,
    ):  # fmt: skip
        what = "sequence" if row["kind"] == "S" else "table"
        found[f"{what} {row['relname']}"] = f"{schema}.{row['relname']}"
    for row in await conn.fetch(
        "SELECT p.oid::regprocedure::text AS signature FROM pg_proc AS p "
        "JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = $1", schema,
    ):  # fmt: skip
        found[f"function {row['signature'].removeprefix(schema + '.')}"] = row["signature"]
    return found


async def _held(conn: asyncpg.Connection, role: str, label: str, target: str) -> set[str]:
    if label.startswith("function "):
        held = await conn.fetchval("SELECT has_function_privilege($1, $2, 'EXECUTE')", role,
                                   target)  # fmt: skip
        return EXECUTE if held else NONE
    if label.startswith("sequence "):
        return {p for p in SEQUENCE_PRIVILEGES
                if await conn.fetchval("SELECT has_sequence_privilege($1, $2, $3)", role,
                                       target, p)}  # fmt: skip
    return {
        p for p in TABLE_PRIVILEGES
        if await conn.fetchval("SELECT has_table_privilege($1, $2, $3)", role, target, p)
        or (p in ("SELECT", "INSERT", "UPDATE", "REFERENCES") and await conn.fetchval(
            "SELECT has_any_column_privilege($1, $2, $3)", role, target, p))
    }  # fmt: skip


async def test_every_object_has_exactly_the_declared_privileges(
    conn: asyncpg.Connection, schema: str, logins: dict[str, str]
) -> None:
    objects = await _objects(conn, schema)
    undeclared = sorted(objects.keys() - ROLE_MATRIX.keys())
    assert not undeclared, f"objects without declared grants in ROLE_MATRIX: {undeclared}"
    gone = sorted(ROLE_MATRIX.keys() - objects.keys())
    assert not gone, f"ROLE_MATRIX declares objects the schema does not have: {gone}"
    wrong = []
    for label, target in sorted(objects.items()):
        for group in LOGIN_GROUPS:
            held = await _held(conn, f"{schema}_{group}", label, target)
            if held != ROLE_MATRIX[label][group]:
                wrong.append(f"{group} on {label}: holds {sorted(held)}, "
                             f"declared {sorted(ROLE_MATRIX[label][group])}")  # fmt: skip
            # A login holding only that group has no more than the group.
            login_held = await _held(conn, logins[group], label, target)
            if login_held != held:
                wrong.append(f"login of {group} on {label}: holds {sorted(login_held)}")
    assert not wrong, "\n".join(wrong)


async def test_the_group_roles_cannot_log_in_and_the_worker_inherits_no_ownership(
    dsn: str, conn: asyncpg.Connection, schema: str, logins: dict[str, str]
) -> None:
    rows = await conn.fetch(
        "SELECT rolname, rolcanlogin, rolinherit FROM pg_roles WHERE rolname = ANY($1)",
        [f"{schema}_{suffix}" for suffix in migrate.ROLE_SUFFIXES],
    )
    assert len(rows) == len(migrate.ROLE_SUFFIXES)
    assert not any(r["rolcanlogin"] for r in rows)
    assert {r["rolname"] for r in rows if not r["rolinherit"]} == {f"{schema}_worker"}
    owners = await conn.fetch(
        "SELECT c.relname, pg_get_userbyid(c.relowner) AS owner FROM pg_class AS c "
        "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')", schema,
    )  # fmt: skip
    for row in owners:
        part_of = row["relname"].rsplit("_p", 1)[0]
        expected_maintainer = row["relname"] in OWNED_BY_MAINTAINER or (
            part_of in OWNED_BY_MAINTAINER and row["relname"] != part_of
        )
        if expected_maintainer:
            assert row["owner"] == f"{schema}_maintainer", row["relname"]
        else:
            assert row["owner"] != f"{schema}_maintainer", row["relname"]
    # A worker login holds the maintainer's rights only after SET ROLE.
    worker = await _connect_as(dsn, logins["worker"])
    try:
        assert not await worker.fetchval("SELECT pg_has_role($1, 'USAGE')",
                                         f"{schema}_maintainer")  # fmt: skip
        # ("must be owner" on PostgreSQL 15, "permission denied" where MAINTAIN exists)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await worker.execute(f"REINDEX INDEX {schema}.job_claim_idx")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await worker.execute(f"DROP TABLE {schema}.job_history")
        for other in ("producer", "readonly", "admin"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await worker.execute(f"SET ROLE {schema}_{other}")
    finally:
        await worker.close()


async def _all_refused(session: asyncpg.Connection, *statements: str) -> None:
    """Each statement fails for want of a privilege."""
    for statement in statements:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await session.execute(statement)


async def _connect_as(dsn: str, login: str, **settings: str) -> asyncpg.Connection:
    connection: asyncpg.Connection = await asyncpg.connect(
        login_dsn(dsn, login), server_settings=settings or None
    )
    return connection


async def test_a_producer_enqueues_and_reads_its_jobs_and_nothing_else(
    dsn: str, schema: str, logins: dict[str, str]
) -> None:
    async with await Client.connect(login_dsn(dsn, logins["producer"]), schema=schema) as client:
        job_id = await client.enqueue("k", {"a": 1})
        batch = await client.enqueue_many([("k", {"n": 1}), ("k", {"n": 2})])  # COPY path
        info = await client.job(job_id)
        assert info is not None and info.state == "available"
        assert len(batch) == 2
        with pytest.raises(admin.MissingRole, match=f"needs role {schema}_admin"):
            await client.cancel(job_id)
    producer = await _connect_as(dsn, logins["producer"])
    try:
        await _all_refused(
            producer,
            f"UPDATE {schema}.job SET priority = 1",
            f"DELETE FROM {schema}.job",
            f"SELECT * FROM {schema}.member",
            f"SELECT * FROM {schema}.audit",
            f"INSERT INTO {schema}.job_history SELECT * FROM {schema}.job_history LIMIT 0",
            f"SELECT {schema}.partitions_ensure(1)",
            f"SELECT {schema}.job_move(ARRAY[]::bigint[])",
            f"SELECT {schema}.job_finish(ARRAY[]::{schema}.job[])",
            f"INSERT INTO {schema}.job (state, queue, kind, args, owner) "
            "VALUES ('available', 'q', 'k', '{}', 'me')",
        )
    finally:
        await producer.close()


async def test_readonly_reads_everything_and_writes_nothing(
    dsn: str, conn: asyncpg.Connection, schema: str, logins: dict[str, str]
) -> None:
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('k')")
    reader = await _connect_as(dsn, logins["readonly"])
    try:
        status = await admin.status(reader, schema)
        assert status.queues["default"].available == 1
        listed = await admin.list_jobs(reader, schema)
        assert [j.id for j in listed] == [job_id]
        await _all_refused(
            reader,
            f"SELECT {schema}.enqueue('k')",
            f"UPDATE {schema}.job SET priority = 1",
            f"INSERT INTO {schema}.queue (name) VALUES ('x')",
        )
        with pytest.raises(admin.MissingRole, match=f"needs role {schema}_admin"):
            await admin.cancel_jobs(reader, schema, [job_id])
    finally:
        await reader.close()


async def test_an_admin_acts_audited_and_cannot_touch_the_fleet_or_the_trail(
    dsn: str, conn: asyncpg.Connection, schema: str, logins: dict[str, str]
) -> None:
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('k')")
    acting = await _connect_as(dsn, logins["admin"])
    try:
        done = await admin.cancel_jobs(acting, schema, [job_id], user="alice")
        assert done.jobs[0].outcome == "cancelled"
        await admin.retry_jobs(acting, schema, [job_id], user="alice")
        await admin.set_paused(acting, schema, "default", True, user="alice")
        await _all_refused(
            acting,
            f"UPDATE {schema}.member SET pid = 1",
            f"DELETE FROM {schema}.leader",
            f"INSERT INTO {schema}.kind (name, queue) VALUES ('k', 'q')",
            f"UPDATE {schema}.job_history SET state = 'completed'",
            f"SELECT {schema}.partitions_ensure(1)",
        )
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await acting.execute(f"DELETE FROM {schema}.audit")
    finally:
        await acting.close()
    rows = await conn.fetch(f"SELECT db_role, os_user, action FROM {schema}.audit ORDER BY id")
    assert [(r["db_role"], r["os_user"], r["action"]) for r in rows] == [
        (logins["admin"], "alice", "jobs.cancel"),
        (logins["admin"], "alice", "jobs.retry"),
        (logins["admin"], "alice", "queues.pause"),
    ]


async def test_the_admin_cli_refuses_writes_without_the_admin_role(
    dsn: str, conn: asyncpg.Connection, schema: str, logins: dict[str, str]
) -> None:
    job_id = await conn.fetchval(f"SELECT {schema}.enqueue('k')")
    writes = (["jobs", "cancel", str(job_id)], ["queues", "pause", "default"],
              ["dlq", "redrive"], ["scrub", "--kind", "k"])  # fmt: skip
    refusals = [*((logins["readonly"], w) for w in writes), (logins["worker"], writes[0])]
    for login, command in refusals:
        done = await anyio.run_process(
            [sys.executable, "-m", "pgjobd", *command, "--dsn", login_dsn(dsn, login),
             "--schema", schema], check=False,
        )  # fmt: skip
        stderr = done.stderr.decode()
        assert done.returncode == 1, (command, stderr)
        assert f"needs role {schema}_admin" in stderr, stderr
        assert f"GRANT {schema}_admin TO {login}" in stderr
    # Reading needs no admin role.
    done = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", "jobs", "list", "--dsn",
         login_dsn(dsn, logins["readonly"]), "--schema", schema], check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.audit") == 0
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 1


async def test_a_worker_login_rotates_partitions_and_rebuilds_indexes(
    dsn: str, conn: asyncpg.Connection, schema: str, logins: dict[str, str]
) -> None:
    """The leader's DDL as a login holding only <schema>_worker: expired partitions are
    detached and dropped, a half-done detach is finished, a leftover of an interrupted
    REINDEX is dropped and a bloated index rebuilt."""
    expired = await make_maintenance_work(conn, schema)
    pool = await asyncpg.create_pool(login_dsn(dsn, logins["worker"]), min_size=1, max_size=2)
    session = await _connect_as(dsn, logins["worker"])
    try:
        queries = for_schema(schema)
        assert await session.fetchval("SELECT pg_try_advisory_lock($1, $2)",
                                       *lock_key(LEADER, schema))  # fmt: skip
        term = await queries.leader_term_begin(session, "worker-login")
        ctx = RoleContext(pool, queries, Config(database=DatabaseConfig(schema=schema)),
                          "worker-login", term)  # fmt: skip
        await PartitionRotator().tick(ctx)
        reindexer = Reindexer()
        await reindexer.tick(ctx)
        # And a rebuild itself, as the role runs it for a bloated index.
        rows = await queries.index_size_list(session, f"{schema}.job", "job_due_idx")
        async with pool.acquire() as rebuilding:
            await reindexer._rebuild(rebuilding, ctx, f"{schema}.job", IndexSize(*rows[0]), "test")
    finally:
        await session.close()
        await pool.close()
    for name in expired:
        assert await conn.fetchval("SELECT to_regclass($1)", f"{schema}.{name}") is None
    assert reindexer.dropped == 1
    assert reindexer.rebuilt == 1
    assert await conn.fetchval("SELECT to_regclass($1)", f"{schema}.{LEFTOVER_INDEX}") is None


async def test_the_maintenance_functions_do_one_thing_with_checked_arguments(
    dsn: str, conn: asyncpg.Connection, schema: str, logins: dict[str, str]
) -> None:
    """partition_drop and partitions_ensure run with the schema owner's rights: as a
    worker login, nothing but a detached partition of the two parents can be dropped."""
    attached = await conn.fetchval(
        "SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = $1::regclass ORDER BY c.relname LIMIT 1",
        f"{schema}.job_history",
    )
    worker = await _connect_as(dsn, logins["worker"])
    try:
        for parent, partition in (
            ("job", "job_p20240101"),
            ("audit", "audit_p20240101"),
            ("job_history", "job_history"),
            ("job_history", "job_attempt_p20240101"),
            ("job_history", "job_history_p20240101; DROP TABLE x"),
            ("job_history", None),
            (None, "job_history_p20240101"),
        ):
            with pytest.raises(asyncpg.InvalidParameterValueError, match="partition_drop"):
                await worker.fetchval(f"SELECT {schema}.partition_drop($1, $2)", parent,
                                      partition)  # fmt: skip
        with pytest.raises(asyncpg.ObjectInUseError, match="still attached"):
            await worker.fetchval(f"SELECT {schema}.partition_drop('job_history', $1)", attached)
        assert not await worker.fetchval(
            f"SELECT {schema}.partition_drop('job_history', 'job_history_p19990101')"
        )
        for days in (-1, 367, None):
            with pytest.raises(asyncpg.InvalidParameterValueError, match="days_ahead"):
                await worker.fetchval(f"SELECT {schema}.partitions_ensure($1)", days)
    finally:
        await worker.close()
    assert await conn.fetchval("SELECT to_regclass($1)", f"{schema}.{attached}") is not None


async def test_a_worker_login_claims_from_a_limited_queue_and_recounts_its_depth(
    dsn: str, conn: asyncpg.Connection, schema: str, logins: dict[str, str]
) -> None:
    """Flow control as a login holding only <schema>_worker: the limited claim (and the
    functions it calls with the caller's rights) and the leader's depth recount. Before
    their grants, the claim raised "permission denied for function job_claim_flow"."""
    await conn.execute(
        f"INSERT INTO {schema}.queue (name, global_concurrency, rate_limit, rate_window, "
        f"max_depth) VALUES ('limited', 1, 5, interval '1 minute', 100)"
    )
    for _ in range(3):
        await conn.execute(f"SELECT {schema}.enqueue('k', queue => 'limited')")
    worker = await _connect_as(dsn, logins["worker"])
    try:
        queries = for_schema(schema)
        rows = await queries.job_claim_flow(worker, "limited", 3, "worker-login",
                                            timedelta(seconds=30))  # fmt: skip
        assert [r.id is not None for r in rows].count(True) == 1  # global_concurrency 1
        assert await queries.queue_depth_recount(worker, None) == 1
    finally:
        await worker.close()
