"""Issue 10, hostile input: values at the edges of PostgreSQL's types, fed to every
enqueue surface (the SQL functions as a producer-only role, the producer's direct INSERT,
Client.enqueue, enqueue_many by COPY and through the function, SyncClient, `pgjobd
enqueue`). Each value is either refused with a clear error (EnqueueError, an SQLSTATE of
pgjobd's PJ class or PostgreSQL's own refusal of the value, exit status 2) and nothing
is written, or stored; and afterwards what members, the leader's roles and the admin
commands run over the job table still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import anyio
import asyncpg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pgjobd import Client, EnqueueError, JobSpec, SyncClient, admin, cli
from pgjobd.client import MAX_ARGS_BYTES
from pgjobd.roles import RoleContext
from pgjobd.roles.queue_stats import QueueStats
from pgjobd.roles.reaper import Reaper

pytestmark = pytest.mark.anyio

SETTINGS = settings(
    max_examples=int(os.environ.get("PGJOBD_HOSTILE_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- edge values ---------------------------------------------------------------------

EDGE_INTS = [
    -(2**63) - 1, -(2**63), -(2**31) - 1, -(2**31), -32769, -32768, -1, 0, 1, 2, 100,
    32767, 32768, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**30, -(10**30),
]  # fmt: skip
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers())


def _repeated(unit: str, n: int) -> str:
    return unit * n


LENGTHS = [1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513, 70_000]
long_texts = st.builds(_repeated, st.sampled_from(["a", "é", "😀", "-"]), st.sampled_from(LENGTHS))
# Text PostgreSQL can receive (no lone surrogates: those cannot even be sent).
sendable_texts = st.one_of(
    st.sampled_from(["", "\x00", "a\x00b", " ", "\n", "é", "😀", "k", "default", "a b"]),
    st.text(max_size=12),
    long_texts,
)
texts = st.one_of(sendable_texts, st.sampled_from(["\ud800", "a\udcff"]))
optional_texts = st.one_of(st.none(), texts)

EDGE_TIMES = [
    datetime.min.replace(tzinfo=UTC),
    datetime.min.replace(tzinfo=timezone(timedelta(hours=14))),
    datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(1970, 1, 1, tzinfo=UTC),
    datetime(1970, 1, 1, tzinfo=timezone(timedelta(hours=1))),
    datetime(2000, 1, 1, tzinfo=UTC),
    datetime(9998, 12, 31, 23, 59, 59, tzinfo=UTC),
    datetime(9999, 1, 1, tzinfo=UTC),
    datetime(9998, 12, 31, 23, 0, tzinfo=timezone(timedelta(hours=-14))),
    datetime.max.replace(tzinfo=UTC),
    datetime.max.replace(tzinfo=timezone(timedelta(hours=-14))),
    datetime(2030, 1, 1),  # naive
]
run_ats = st.one_of(
    st.none(),
    st.sampled_from(EDGE_TIMES),
    st.datetimes(timezones=st.just(UTC)),
    st.datetimes(),
)
delays = st.one_of(
    st.none(),
    st.sampled_from(["0s", "-5s", "1h30m", "999999999d", "3000000d", "2900000d", "soon", ""]),
    st.floats(),
    ints,
    st.timedeltas(),
    st.sampled_from([timedelta.max, timedelta.min, timedelta(days=2_900_000)]),
)
json_leaves = st.one_of(
    st.none(), st.booleans(), ints, st.floats(), texts, st.sampled_from([10**400, -(10**4000)])
)
json_values = st.recursive(
    json_leaves,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=8,
)


def _nested(depth: int, leaf: Any) -> dict[str, Any]:
    value = leaf
    for _ in range(depth - 1):
        value = [value]
    return {"a": value}


args_values = st.one_of(
    st.dictionaries(texts, json_values, max_size=4),
    json_values,  # mostly not an object
    st.builds(_nested, st.sampled_from([98, 99, 100, 101, 3000]), st.sampled_from([[], 1, "x"])),
    st.builds(
        lambda n: {"p": "x" * n},
        st.sampled_from([MAX_ARGS_BYTES - 8, MAX_ARGS_BYTES - 7, MAX_ARGS_BYTES]),
    ),
)


SPEC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "kind": st.one_of(texts, ints),
    "args": args_values,
    "queue": texts,
    "priority": ints,
    "delay": delays,
    "run_at": run_ats,
    "tenant": texts,
    "unique_key": texts,
    "max_attempts": ints,
}


@st.composite
def specs(draw: st.DrawFn, *, unique_keys: bool = True) -> JobSpec:
    """A job with one to three fields set to edge values, the others plain: so that
    each edge value also reaches the database alone, not only behind another refusal."""
    fields = [f for f in SPEC_FIELDS if unique_keys or f != "unique_key"]
    chosen = draw(st.sets(st.sampled_from(fields), min_size=1, max_size=3))
    values = {name: draw(SPEC_FIELDS[name]) for name in sorted(chosen)}
    return JobSpec(**{"kind": "k", "args": {}, **values})


# -- fixtures and checks -------------------------------------------------------------


@pytest.fixture
async def client(dsn: str, schema: str) -> AsyncIterator[Client]:
    async with await Client.connect(dsn, schema=schema, max_size=2) as c:
        yield c


async def _count(conn: asyncpg.Connection, schema: str) -> int:
    live: int = await conn.fetchval(f"SELECT count(*) FROM {schema}.job")
    final: int = await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history")
    return live + final


async def _refused_or_stored(
    conn: asyncpg.Connection, schema: str, call: Callable[[], Awaitable[Any]]
) -> Any:
    """The call's result, or None when it raised EnqueueError having written nothing.
    Any other exception fails the test."""
    before = await _count(conn, schema)
    try:
        return await call()
    except EnqueueError as e:
        assert str(e), "an EnqueueError must say what was wrong"
        assert await _count(conn, schema) == before
        return None


async def _fleet_still_works(ctx: RoleContext, client: Client, schema: str) -> None:
    """What members, roles and admin commands run over the job table, all of it."""
    q = ctx.queries
    async with ctx.pool.acquire() as conn:
        await q.job_promote_due(conn, 1000)
        queues = [r[0] for r in await conn.fetch(f"SELECT DISTINCT queue FROM {schema}.job")]
        for queue in queues:
            # A lease that is over at once: the reaper takes the jobs back below.
            await q.job_claim(conn, queue, 1000, "hostile", timedelta(microseconds=1))
    await Reaper().tick(ctx)
    await QueueStats().tick(ctx)
    await admin.status(ctx.pool, schema)
    jobs = await admin.list_jobs(ctx.pool, schema, limit=1000)
    await admin.list_dead(ctx.pool, schema, limit=1000)
    for job in jobs[:20]:
        assert await client.job(job.id) is not None
    # The CLI's renderings of the same, human and --json.
    parser = cli._parser()
    for json_flag in ([], ["--json"]):
        commands: list[tuple[list[str], Any]] = [
            (["status"], cli._status),
            (["jobs", "list", "--limit", "1000"], cli._jobs_list),
            (["dlq", "list", "--limit", "1000"], cli._dlq_list),
            *((["jobs", "show", str(job.id)], cli._jobs_show) for job in jobs[:5]),
        ]
        for argv, command in commands:
            args = parser.parse_args([*argv, *json_flag])
            assert await command(args, ctx.pool, schema) == 0


# -- the Python client ---------------------------------------------------------------


@SETTINGS
@given(spec=specs())
@example(spec=JobSpec("k", run_at=datetime.max.replace(tzinfo=UTC)))
@example(spec=JobSpec("k", run_at=datetime.min.replace(tzinfo=UTC)))
@example(spec=JobSpec("k", delay=timedelta.max))
@example(spec=JobSpec("k", tenant="\x00", unique_key=""))
@example(spec=JobSpec("k", {"a": "\x00"}, max_attempts=2**31))
async def test_client_enqueue_refuses_or_stores_and_the_fleet_reads_it(
    client: Client, conn: asyncpg.Connection, schema: str, leading: RoleContext, spec: JobSpec
) -> None:
    await _refused_or_stored(
        conn,
        schema,
        lambda: client.enqueue(
            spec.kind,
            spec.args,
            queue=spec.queue,
            priority=spec.priority,
            delay=spec.delay,
            run_at=spec.run_at,
            tenant=spec.tenant,
            unique_key=spec.unique_key,
            max_attempts=spec.max_attempts,
        ),
    )
    await _fleet_still_works(leading, client, schema)


@SETTINGS
@given(
    items=st.lists(st.one_of(specs(unique_keys=False), st.tuples(texts, args_values)), max_size=3),
    shared=specs(unique_keys=False),
)
async def test_enqueue_many_by_copy_refuses_or_stores(
    client: Client,
    conn: asyncpg.Connection,
    schema: str,
    leading: RoleContext,
    items: list[Any],
    shared: JobSpec,
) -> None:
    options = {
        "queue": shared.queue, "priority": shared.priority, "delay": shared.delay,
        "run_at": None if shared.delay is not None else shared.run_at,
        "tenant": shared.tenant, "max_attempts": shared.max_attempts,
    }  # fmt: skip
    items = [("k", {}), *items]  # never empty: an empty batch writes nothing, rightly
    ids = await _refused_or_stored(conn, schema, lambda: client.enqueue_many(items, **options))
    if ids is not None:
        assert len(ids) == len(items)
    await _fleet_still_works(leading, client, schema)


@SETTINGS
@given(items=st.lists(specs(), min_size=1, max_size=3), key=optional_texts)
async def test_enqueue_many_through_the_function_refuses_or_stores(
    client: Client,
    conn: asyncpg.Connection,
    schema: str,
    leading: RoleContext,
    items: list[JobSpec],
    key: str | None,
) -> None:
    # One item with a valid key sends the whole batch through the SQL function.
    items = [JobSpec("k", {}, unique_key="through-the-function"), *items]
    ids = await _refused_or_stored(conn, schema, lambda: client.enqueue_many(items, unique_key=key))
    if ids is not None:
        assert len(ids) == len(items)
    await _fleet_still_works(leading, client, schema)


async def test_sync_client_refuses_what_client_refuses(dsn: str, schema: str) -> None:
    def run() -> list[str]:
        refused = []
        with SyncClient(dsn, schema=schema) as sync:
            for options in (
                {"run_at": datetime(9999, 6, 1, tzinfo=UTC)},
                {"run_at": datetime(2030, 1, 1)},
                {"delay": float("nan")},
                {"delay": "999999999d"},
                {"tenant": "a\x00"},
                {"unique_key": ""},
                {"max_attempts": 2**31},
                {"priority": 2**63},
            ):
                try:
                    sync.enqueue("k", {}, **options)
                except EnqueueError as e:
                    refused.append(str(e))
            sync.enqueue("k", {"ok": True}, run_at=datetime(1970, 1, 1, tzinfo=UTC))
        return refused

    refused = await anyio.to_thread.run_sync(run)

    assert len(refused) == 8, refused


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"run_at": datetime(9999, 1, 1, tzinfo=UTC)}, "run_at 9999-01-01T00:00:00+00:00 is out"),
        ({"run_at": datetime(1969, 12, 31, tzinfo=UTC)}, "expected a time from 1970-01-01"),
        ({"run_at": datetime.max.replace(tzinfo=UTC)}, "out of range"),
        ({"run_at": datetime(2030, 1, 1)}, "run_at must be a timezone-aware datetime"),
        ({"delay": float("nan")}, "invalid delay: expected a finite number of seconds"),
        ({"delay": float("inf")}, "invalid delay"),
        ({"delay": -0.5}, "delay must not be negative"),
        ({"delay": timedelta.max}, "is too long: the job would run on or after 9999-01-01"),
        ({"delay": "3000000d"}, "is too long"),
        ({"tenant": ""}, "tenant must not be empty"),
        ({"tenant": "a\x00b"}, "tenant must not contain NUL"),
        ({"tenant": "x" * 257}, "tenant is 257 bytes, over the 256-byte limit"),
        ({"tenant": "\ud800"}, "tenant is not valid Unicode"),
        ({"unique_key": ""}, "unique_key must not be empty"),
        ({"unique_key": "é" * 257}, "unique_key is 514 bytes, over the 512-byte limit"),
        ({"unique_key": "k\x00"}, "unique_key must not contain NUL"),
        ({"max_attempts": 2**31}, "max_attempts must be an int from 1 to 2147483647"),
        ({"priority": 2**63}, "priority must be an int from -32768 to 32767"),
        ({"queue": 7}, "queue must be a str"),
    ],
)
async def test_options_out_of_range_name_the_option(
    client: Client, conn: asyncpg.Connection, schema: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(EnqueueError) as single:
        await client.enqueue("k", {}, **options)
    with pytest.raises(EnqueueError) as batch:
        await client.enqueue_many([("k", {})], **options)

    assert message in str(single.value)
    assert message in str(batch.value)
    assert await _count(conn, schema) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"a": "\x00"}, "args contain a NUL character"),
        ({"a\x00": 1}, "args contain a NUL character"),
        ({"a": ["x", {"b": "y\x00"}]}, "args contain a NUL character"),
        (_nested(100, 1), "args are nested more than 100 levels deep"),
        (_nested(5000, 1), "args are nested more than 100 levels deep"),
        ({"a": "\ud800"}, "args are not JSON-encodable"),
    ],
)
async def test_args_postgresql_cannot_store_or_python_cannot_read_are_refused(
    client: Client, conn: asyncpg.Connection, schema: str, args: Any, message: str
) -> None:
    with pytest.raises(EnqueueError, match=message):
        await client.enqueue("k", args)
    with pytest.raises(EnqueueError, match=f"job 2: {message}"):
        await client.enqueue_many([("k", {}), ("k", args)])
    assert await _count(conn, schema) == 0


async def test_escaped_backslashes_are_not_nul_and_depth_99_is_allowed(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    text = "\\u0000 and \\\\u0000"  # backslashes, not NUL characters
    one = await client.enqueue("k", {"a": text, "deep": _nested(98, 1)})
    many = await client.enqueue_many([("k", {"a": text, "deep": _nested(98, [])})])

    stored = await conn.fetchval(f"SELECT args ->> 'a' FROM {schema}.job WHERE id = $1", one)
    assert stored == text and len(many) == 1


async def test_client_job_of_ids_beyond_a_bigint(client: Client) -> None:
    assert await client.job(2**63) is None
    assert await client.job(-(2**63) - 1) is None
    with pytest.raises(admin.UnknownJobs):
        await client.cancel(2**70)
    with pytest.raises(admin.UnknownJobs):
        await client.retry(-(2**70))


# -- SQL: the functions as a producer-only role, and its direct INSERT ----------------

SQL_TIMES = [
    "infinity", "-infinity", "epoch", "1969-12-31 23:59:59.999999+00", "9998-12-31 23:59:59+00",
    "9999-01-01 00:00:00+00", "294276-12-31 23:59:59+00", "4713-01-01 00:00:00+00 BC", "now",
    "2000-01-01 00:00:00+14",
]  # fmt: skip
SQL_INTERVALS = [
    "-1 second", "0", "1 day", "100 years", "7975 years", "9999 years", "10001 years",
    "178000000 years", "-178000000 years", "1 month -40 days",
]  # fmt: skip
SQL_ARGS = [
    "{}", "[]", "null", "7", '"x"', '{"a":"\\u0000"}', '{"a":1e400}', '{"a":-1e-400}',
    '{"a":' + "1" * 5000 + "}", '{"a":' + "[" * 99 + "]" * 99 + "}",
    '{"a":' + "[" * 100 + "]" * 100 + "}", '{"a":' + "[" * 3000 + "]" * 3000 + "}",
    '{"a":' + "[" * 100_000 + "]" * 100_000 + "}", '{"a":"\\ud800"}', '{"\\u00e9":"😀"}',
    '{"p":"' + "x" * 65_530 + '"}',
]  # fmt: skip


def _as_text(value: int | str | None) -> str | None:
    return None if value is None else str(value)


sql_ints = st.one_of(st.none(), st.builds(_as_text, ints))
sql_texts = st.one_of(st.none(), sendable_texts)

# Refusals by PostgreSQL itself, before any pgjobd code runs: a value the type cannot
# hold (class 22: data exception), or JSON nested beyond the server's stack (54001).
POSTGRES_REFUSALS = ("22", "54001")


def _clear_refusal(error: asyncpg.PostgresError) -> bool:
    state = error.sqlstate or ""
    return state.startswith("PJ") or state.startswith(POSTGRES_REFUSALS)


@pytest.fixture
async def as_producer(dsn: str, producer_login: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(dsn)
    await connection.execute(f"SET ROLE {producer_login}")
    try:
        yield connection
    finally:
        await connection.close()


SQL_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "kind": sql_texts,
    "args": st.sampled_from(SQL_ARGS),
    "queue": sql_texts,
    "priority": sql_ints,
    "run_at": st.sampled_from(SQL_TIMES),
    "tenant": sql_texts,
    "unique_key": sql_texts,
    "max_attempts": sql_ints,
    "delay": st.sampled_from(SQL_INTERVALS),
}


@SETTINGS
@given(
    edges=st.sets(st.sampled_from(list(SQL_FIELDS)), min_size=1, max_size=3).flatmap(
        lambda names: st.fixed_dictionaries({name: SQL_FIELDS[name] for name in names})
    ),
    many=st.booleans(),
)
@example(edges={"run_at": "infinity"}, many=False)  # killed the promoter before 0005
@example(edges={"run_at": "-infinity"}, many=True)
@example(edges={"run_at": "4713-01-01 00:00:00+00 BC"}, many=False)
@example(edges={"run_at": "294276-12-31 23:59:59+00"}, many=True)
@example(edges={"delay": "9999 years"}, many=False)
@example(edges={"args": SQL_ARGS[11]}, many=False)
@example(edges={"tenant": "", "unique_key": ""}, many=True)
async def test_sql_functions_as_a_producer_refuse_or_store(
    client: Client,
    conn: asyncpg.Connection,
    as_producer: asyncpg.Connection,
    schema: str,
    leading: RoleContext,
    edges: dict[str, str | None],
    many: bool,
) -> None:
    job = {"kind": "k", "args": "{}", **edges}
    values = [job.get(name) for name in SQL_FIELDS]  # $1..$9 in SQL_FIELDS' order
    if many:
        sql = (
            f"SELECT id FROM {schema}.enqueue_many(ARRAY[$1::text], ARRAY[$2::text::jsonb], "
            "ARRAY[$3::text], ARRAY[$4::text::integer], ARRAY[$5::text::timestamptz], "
            "ARRAY[$9::text::interval], ARRAY[$6::text], ARRAY[$7::text], "
            "ARRAY[$8::text::integer])"
        )
    else:
        sql = (
            f"SELECT {schema}.enqueue($1, $2::text::jsonb, $3, $4::text::integer, "
            "$5::text::timestamptz, $6, $7, $8::text::integer, $9::text::interval)"
        )
    before = await _count(conn, schema)
    try:
        await as_producer.fetchval(sql, *values)
    except asyncpg.PostgresError as e:
        assert _clear_refusal(e), f"unexpected {e.sqlstate}: {e}"
        assert await _count(conn, schema) == before
    await _fleet_still_works(leading, client, schema)


@SETTINGS
@given(
    run_at=st.sampled_from(SQL_TIMES),
    tenant=sql_texts,
    args=st.sampled_from(SQL_ARGS[:8]),
    max_attempts=sql_ints,
    state=st.sampled_from(["available", "scheduled", "retryable", "running"]),
    id_=st.one_of(st.none(), st.sampled_from(["-1", "0", str(2**63 - 1)])),
)
async def test_a_producers_own_insert_is_held_to_the_same_rules(
    client: Client,
    conn: asyncpg.Connection,
    as_producer: asyncpg.Connection,
    schema: str,
    leading: RoleContext,
    run_at: str,
    tenant: str | None,
    args: str,
    max_attempts: str | None,
    state: str,
    id_: str | None,
) -> None:
    # The client's COPY path needs INSERT on the job table: a producer can write rows
    # without the functions' checks, so the table's own checks must keep them readable.
    columns = "state, queue, kind, run_at, args, tenant, max_attempts" + (", id" if id_ else "")
    placeholders = (
        f"$1::text::{schema}.job_state, 'q', 'k', $2::text::timestamptz, $3::text::jsonb, $4, "
        "coalesce($5::text::integer, 20)" + (", $6::text::bigint" if id_ else "")
    )
    values = [state, run_at, args, tenant, max_attempts, *([id_] if id_ else [])]
    before = await _count(conn, schema)
    try:
        await as_producer.execute(
            f"INSERT INTO {schema}.job ({columns}) VALUES ({placeholders})", *values
        )
    except asyncpg.PostgresError as e:
        # 23514: a check of the table; 23505: an id an earlier example took.
        assert _clear_refusal(e) or e.sqlstate in ("23514", "23505"), f"{e.sqlstate}: {e}"
        assert await _count(conn, schema) == before
    await _fleet_still_works(leading, client, schema)


async def test_a_producer_cannot_set_what_members_own(
    conn: asyncpg.Connection, as_producer: asyncpg.Connection, schema: str
) -> None:
    for column, value in (
        ("attempt", "2147483647"), ("crashes", "2147483647"), ("enqueued_at", "'-infinity'"),
        ("owner", "'m'"), ("fence", "1"), ("unique_key", "'k'"), ("last_error", "'e'"),
    ):  # fmt: skip
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await as_producer.execute(
                f"INSERT INTO {schema}.job (state, queue, kind, args, {column}) "
                f"VALUES ('available', 'q', 'k', '{{}}', {value})"
            )
    assert await _count(conn, schema) == 0


# -- pgjobd enqueue ------------------------------------------------------------------


async def _pgjobd(*args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PGJOBD_DSN", "DATABASE_URL")}
    result = await anyio.run_process(
        [sys.executable, "-m", "pgjobd", *args], env=clean, check=False
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


# Argument strings a shell can pass (no NUL, no lone surrogates).
cli_texts = st.one_of(
    st.sampled_from(["", " ", "é", "😀", "k", "\n", "-1", "0"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
            max_size=10),
    st.builds(_repeated, st.sampled_from(["a", "é"]), st.sampled_from([256, 257, 512, 513])),
)  # fmt: skip
CLI_JSON = [
    "{}", '{"a":"\\u0000"}', '{"a":NaN}', '{"a":Infinity}', '{"a":1e400}',
    '{"a":' + "1" * 5000 + "}", '{"a":' + "[" * 100 + "]" * 100 + "}",
    '{"a":' + "[" * 5000 + "]" * 5000 + "}", '{"a":"\\ud800"}', "[1]", "{",
]  # fmt: skip
CLI_TIMES = [
    "1969-12-31T23:59:59+00:00", "1970-01-01", "9998-12-31T23:00:00-14:00", "9999-01-01",
    "9999-12-31T23:59:59", "0001-01-01", "2030-01-01T00:00:00+05:00", "infinity",
]  # fmt: skip
CLI_DELAYS = ["-5s", "0s", "999999999d", "2900000d", "1h", "nan", "1e400s"]


@settings(SETTINGS, max_examples=int(os.environ.get("PGJOBD_HOSTILE_CLI_EXAMPLES", "12")))
@given(
    kind=st.one_of(st.just("k"), cli_texts),
    args_json=st.sampled_from(CLI_JSON),
    options=st.dictionaries(
        st.sampled_from(
            [
                "--queue",
                "--priority",
                "--delay",
                "--at",
                "--tenant",
                "--unique-key",
                "--max-attempts",
            ]
        ),
        st.one_of(cli_texts, st.builds(str, ints), st.sampled_from(CLI_TIMES + CLI_DELAYS)),
        max_size=3,
    ),
)
async def test_pgjobd_enqueue_exits_2_or_stores(
    dsn: str,
    client: Client,
    conn: asyncpg.Connection,
    schema: str,
    leading: RoleContext,
    kind: str,
    args_json: str,
    options: dict[str, str],
) -> None:
    if "--delay" in options and "--at" in options:
        del options["--at"]
    argv = ["enqueue", "--dsn", dsn, "--schema", schema, "--json", "--", kind, args_json]
    flags = [f"{name}={value}" for name, value in options.items()]
    before = await _count(conn, schema)

    result = await _pgjobd(*argv[:6], *flags, *argv[6:])

    assert result.returncode in (0, 2), result.stderr
    if result.returncode == 2:  # pgjobd's own message, or argparse's usage error
        assert result.stderr.strip() and "Traceback" not in result.stderr
        assert await _count(conn, schema) == before
    else:
        job_id = json.loads(result.stdout)["id"]
        assert await client.job(job_id) is not None
    await _fleet_still_works(leading, client, schema)


async def test_admin_commands_show_jobs_stored_at_the_edges(
    dsn: str, client: Client, conn: asyncpg.Connection, schema: str, leading: RoleContext
) -> None:
    ids = [
        await client.enqueue("k", {"big": 10**30}, run_at=datetime(1970, 1, 1, tzinfo=UTC)),
        await client.enqueue("k", {}, run_at=datetime(9998, 12, 31, 23, tzinfo=UTC)),
        await client.enqueue("k", {"deep": _nested(98, 1)}, tenant="t" * 256),
        await client.enqueue("k", {}, unique_key="é" * 256, priority=-32768),
    ]
    # What jsonb holds and msgspec cannot read: shown as text, never a crash.
    huge_float = "1" + "0" * 400 + ".5"
    odd = await conn.fetchval(
        f"SELECT {schema}.enqueue('k', jsonb_build_object('a', 1e400, 'b', {'1' * 5000}, "
        f"'c', {huge_float}))"
    )
    ids.append(odd)
    info = await client.job(odd)
    assert info is not None
    assert info.args == {"a": 10**400, "b": "1" * 5000, "c": huge_float}

    await _fleet_still_works(leading, client, schema)
    for command in (["status"], ["jobs", "list"], ["dlq", "list"],
                    *(["jobs", "show", str(i)] for i in ids)):  # fmt: skip
        for flags in ([], ["--json"]):
            result = await _pgjobd(*command, "--dsn", dsn, "--schema", schema, *flags)
            assert result.returncode == 0, result.stderr


# -- the lifecycle options (issue 13) ------------------------------------------------------

lifecycle_durations = st.one_of(
    st.none(), st.sampled_from(["1ms", "10m", "0s", "-1s", "1d", "xyz", ""]),
    st.floats(allow_nan=False, allow_infinity=False), st.integers(-(2**40), 2**40),
    st.timedeltas(min_value=timedelta(days=-3), max_value=timedelta(days=400_000)),
)  # fmt: skip
job_id_lists = st.one_of(
    st.none(), st.just("12"), st.lists(st.one_of(st.integers(-(2**70), 2**70), texts,
                                                 st.booleans()), max_size=4),
)  # fmt: skip


@SETTINGS
@given(
    depends_on=job_id_lists, after=job_id_lists, ttl=lifecycle_durations,
    unique_for=lifecycle_durations, key=optional_texts,
    on_conflict=st.sampled_from(["return", "raise", "replace", "bogus"]),
    existing=st.booleans(),
)  # fmt: skip
async def test_lifecycle_options_refuse_or_store_and_the_fleet_reads_them(
    client: Client, conn: asyncpg.Connection, schema: str, leading: RoleContext,
    depends_on: Any, after: Any, ttl: Any, unique_for: Any, key: str | None,
    on_conflict: str, existing: bool,
) -> None:  # fmt: skip
    if existing:  # a real job to depend on, alongside whatever was drawn
        real = await client.enqueue("k")
        depends_on = [real, *(depends_on if isinstance(depends_on, list) else [])]
    result = await _refused_or_stored(
        conn, schema,
        lambda: client.enqueue("k", depends_on=depends_on, after=after, ttl=ttl,
                               unique_for=unique_for, unique_key=key,
                               on_conflict=on_conflict),  # type: ignore[arg-type]
    )  # fmt: skip
    if result is not None:
        info = await client.job(result)
        assert info is not None
    await _fleet_still_works(leading, client, schema)
