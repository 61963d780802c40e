"""Enqueueing from Python against a real server: options, defaults, transactions,
wake-ups, and every kind of bad input, which must write nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import asyncpg
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd import Client, DuplicateJob, EnqueueError, JobSpec, SyncClient, job
from pgjobd.client import MAX_ARGS_BYTES
from pgjobd.handler_loader import Registry

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(dsn: str, schema: str) -> AsyncIterator[Client]:
    async with await Client.connect(dsn, schema=schema) as c:
        yield c


async def _count(conn: asyncpg.Connection, schema: str) -> int:
    count: int = await conn.fetchval(f"SELECT count(*) FROM {schema}.job")
    return count


async def _row(conn: asyncpg.Connection, schema: str, job_id: int) -> asyncpg.Record:
    return await conn.fetchrow(
        f"SELECT *, run_at - enqueued_at AS wait FROM {schema}.job WHERE id = $1", job_id
    )


async def test_enqueue_writes_an_available_job_with_the_defaults(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    job_id = await client.enqueue("send_welcome", {"user_id": 7})

    row = await _row(conn, schema, job_id)
    assert row["state"] == "available"
    assert (row["queue"], row["kind"], row["priority"]) == ("default", "send_welcome", 0)
    assert (row["attempt"], row["max_attempts"]) == (0, 20)
    assert msgspec.json.decode(row["args"]) == {"user_id": 7}
    assert row["wait"] == timedelta(0)  # run_at is the database's now()


async def test_enqueue_options_are_stored(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    job_id = await client.enqueue(
        "report", {"scope": "all"}, queue="reports", priority=-3, delay="90s",
        tenant="acme", unique_key="report-acme", max_attempts=4,
    )  # fmt: skip

    row = await _row(conn, schema, job_id)
    assert row["state"] == "scheduled"
    assert row["wait"] == timedelta(seconds=90)
    assert (row["queue"], row["priority"], row["tenant"]) == ("reports", -3, "acme")
    assert (row["unique_key"], row["max_attempts"]) == ("report-acme", 4)


async def test_run_at_in_the_past_is_available_now_and_in_the_future_is_scheduled(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    past = await client.enqueue("k", {}, run_at=datetime(2020, 1, 1, tzinfo=UTC))
    future = await client.enqueue("k", {}, run_at=datetime.now(UTC) + timedelta(days=1))

    assert (await _row(conn, schema, past))["state"] == "available"
    assert (await _row(conn, schema, future))["state"] == "scheduled"


async def test_declared_kind_defaults_apply_when_the_enqueue_names_only_the_kind(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    await conn.execute(
        f"INSERT INTO {schema}.kind (name, queue, priority, max_attempts) "
        "VALUES ('send_welcome', 'email', 2, 5)"
    )

    single = await client.enqueue("send_welcome", {"user_id": 1})
    batch = await client.enqueue_many([("send_welcome", {"user_id": 2})])
    explicit = await client.enqueue("send_welcome", {}, queue="urgent", max_attempts=1)

    for job_id in (single, *batch):
        row = await _row(conn, schema, job_id)
        assert (row["queue"], row["priority"], row["max_attempts"]) == ("email", 2, 5)
    row = await _row(conn, schema, explicit)
    assert (row["queue"], row["priority"], row["max_attempts"]) == ("urgent", 2, 1)


async def test_enqueue_many_returns_ids_in_input_order_with_per_item_options(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    ids = await client.enqueue_many(
        [
            ("a", {"n": 1}),
            JobSpec("b", {"n": 2}, priority=1, queue="other"),
            JobSpec("c", {"n": 3}, delay=timedelta(minutes=5)),
        ],
        queue="bulk",
        priority=9,
    )

    rows = [await _row(conn, schema, i) for i in ids]
    assert [r["kind"] for r in rows] == ["a", "b", "c"]
    assert [msgspec.json.decode(r["args"])["n"] for r in rows] == [1, 2, 3]
    assert [(r["queue"], r["priority"]) for r in rows] == [
        ("bulk", 9), ("other", 1), ("bulk", 9),
    ]  # fmt: skip
    assert [r["state"] for r in rows] == ["available", "available", "scheduled"]
    assert rows[2]["wait"] == timedelta(minutes=5)


async def test_enqueue_many_with_unique_keys_returns_existing_ids(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    first = await client.enqueue("k", {}, unique_key="one")

    ids = await client.enqueue_many(
        [JobSpec("k", {}, unique_key="one"), JobSpec("k", {}, unique_key="two"),
         JobSpec("k", {}, unique_key="two"), ("k", {})]
    )  # fmt: skip

    assert ids[0] == first
    assert ids[1] == ids[2] != first
    assert len(set(ids)) == 3
    assert await _count(conn, schema) == 3


async def test_large_batches_keep_order(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    ids = await client.enqueue_many(("n", {"i": i}) for i in range(5000))

    assert ids == sorted(ids) and len(set(ids)) == 5000
    rows = await conn.fetch(f"SELECT id, args->>'i' AS i FROM {schema}.job")
    assert {r["id"]: int(r["i"]) for r in rows} == {job_id: i for i, job_id in enumerate(ids)}


@pytest.mark.parametrize("bulk", [False, True])
async def test_enqueue_in_the_callers_transaction_rolls_back_with_it(
    client: Client, conn: asyncpg.Connection, schema: str, bulk: bool
) -> None:
    with pytest.raises(RuntimeError, match="order failed"):
        async with conn.transaction():
            if bulk:
                await client.enqueue_many([("k", {}), ("k", {})], conn=conn)
            else:
                await client.enqueue("k", {}, conn=conn)
            assert await _count(conn, schema) >= 1  # visible inside the transaction
            raise RuntimeError("order failed")

    assert await _count(conn, schema) == 0


async def test_committed_caller_transaction_keeps_the_job(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    async with conn.transaction():
        job_id = await client.enqueue("k", {}, conn=conn)
    assert (await _row(conn, schema, job_id))["state"] == "available"


async def test_one_wake_up_per_queue_per_statement(dsn: str, client: Client, schema: str) -> None:
    heard: list[str] = []
    listener = await asyncpg.connect(dsn)
    await listener.add_listener(f"{schema}.job_ready", lambda *a: heard.append(a[3]))
    try:
        await client.enqueue_many([("k", {})] * 40 + [JobSpec("k", {}, queue="b")] * 40)
        await client.enqueue_many(
            [JobSpec("k", {}, queue="b", unique_key=f"u{i}") for i in range(10)]
        )
        await client.enqueue("k", {}, queue="c")
        await client.enqueue("k", {}, queue="d", delay="1h")  # not runnable: no wake-up
        with anyio.fail_after(5):
            while len(heard) < 4:
                await listener.execute("SELECT 1")
                await anyio.sleep(0.01)
        await listener.execute("SELECT 1")
    finally:
        await listener.close()

    assert sorted(heard) == ["b", "b", "c", "default"]


# -- bad input: each is rejected with a clear error and writes nothing ---------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.enqueue("k", {"pad": "x" * MAX_ARGS_BYTES}), "over the 65536-byte limit"),
        (lambda c: c.enqueue("k", [1, 2]), "must be a JSON object"),
        (lambda c: c.enqueue("k", "text"), "must be a JSON object"),
        (lambda c: c.enqueue("k", {"when": object()}), "not JSON-encodable"),
        (lambda c: c.enqueue("k", {}, queue="no spaces"), "invalid queue name 'no spaces'"),
        (lambda c: c.enqueue("k", {}, queue=""), "invalid queue name"),
        (lambda c: c.enqueue("k", {}, delay="-5s"), "delay must not be negative"),
        (lambda c: c.enqueue("k", {}, delay=-1), "delay must not be negative"),
        (lambda c: c.enqueue("k", {}, delay="soon"), "invalid delay"),
        (lambda c: c.enqueue("k", {}, max_attempts=0), "max_attempts"),
        (lambda c: c.enqueue("k", {}, priority=40000), "priority"),
        (lambda c: c.enqueue("bad kind!", {}), "invalid job kind"),
        (lambda c: c.enqueue("k", {}, run_at=datetime(2030, 1, 1)), "timezone-aware"),
        (lambda c: c.enqueue("k", {}, on_conflict="ignore"), "on_conflict"),
        (
            lambda c: c.enqueue_many([("k", {}), ("k", {}), ("k", [])]),
            "job 3: args must be a JSON object",
        ),
        (
            lambda c: c.enqueue_many([("k", {}), JobSpec("k", {}, queue="b@d")]),
            "job 2: invalid queue name",
        ),
        (lambda c: c.enqueue_many(["k"]), "job 1: expected a JobSpec or a (kind, args) tuple"),
    ],
)
async def test_bad_input_is_rejected_and_writes_nothing(
    client: Client, conn: asyncpg.Connection, schema: str, call: object, message: str
) -> None:
    with pytest.raises(EnqueueError) as rejected:
        await call(client)  # type: ignore[operator]
    assert message in str(rejected.value)
    assert await _count(conn, schema) == 0


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(size=st.integers(min_value=MAX_ARGS_BYTES - 40, max_value=MAX_ARGS_BYTES + 40))
async def test_args_size_limit_is_exact(
    client: Client, conn: asyncpg.Connection, schema: str, size: int
) -> None:
    args = {"p": "x" * (size - len(b'{"p":""}'))}
    assert len(msgspec.json.encode(args)) == size
    before = await _count(conn, schema)
    if size <= MAX_ARGS_BYTES:
        await client.enqueue("k", args)
        assert await _count(conn, schema) == before + 1
    else:
        with pytest.raises(EnqueueError, match="over the 65536-byte limit"):
            await client.enqueue("k", args)
        assert await _count(conn, schema) == before


@pytest.mark.parametrize("holder_state", ["available", "scheduled", "running", "retryable"])
async def test_duplicate_unique_key_returns_the_live_jobs_id(
    client: Client, conn: asyncpg.Connection, schema: str, holder_state: str
) -> None:
    first = await client.enqueue("k", {"v": 1}, unique_key="welcome-7")
    await conn.execute(
        f"UPDATE {schema}.job SET state = $2::text::{schema}.job_state, "
        "owner = CASE WHEN $2 = 'running' THEN 'm' END, "
        "fence = CASE WHEN $2 = 'running' THEN 1 END, "
        "lease_expires_at = CASE WHEN $2 = 'running' THEN now() + interval '30s' END "
        "WHERE id = $1",
        first,
        holder_state,
    )

    again = await client.enqueue("k", {"v": 2}, unique_key="welcome-7")
    with pytest.raises(DuplicateJob) as duplicate:
        await client.enqueue("k", {"v": 3}, unique_key="welcome-7", on_conflict="raise")

    assert again == first
    assert duplicate.value.existing_id == first
    assert duplicate.value.unique_key == "welcome-7"
    assert await _count(conn, schema) == 1
    assert await conn.fetchval(f"SELECT args->>'v' FROM {schema}.job") == "1"


async def test_a_finished_job_frees_its_unique_key(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    first = await client.enqueue("k", {}, unique_key="once")
    await conn.execute(f"DELETE FROM {schema}.job WHERE id = $1", first)

    assert await client.enqueue("k", {}, unique_key="once") != first


class Welcome(msgspec.Struct):
    user_id: int
    locale: str = "en"


@job(queue="email")
async def send_welcome(args: Welcome) -> None:
    return None


async def test_args_are_checked_against_the_handlers_args_type(
    dsn: str, conn: asyncpg.Connection, schema: str
) -> None:
    registry = Registry.from_functions([send_welcome])
    async with await Client.connect(dsn, schema=schema, handlers=registry) as client:
        good = await client.enqueue("send_welcome", {"user_id": 7})
        with pytest.raises(EnqueueError, match=r"Expected `int`, got `str` - at `\$.user_id`"):
            await client.enqueue("send_welcome", {"user_id": "seven"})
        with pytest.raises(EnqueueError, match=r"job 2: .*Object missing required field"):
            await client.enqueue_many([("send_welcome", {"user_id": 1}), ("send_welcome", {})])
        with pytest.raises(EnqueueError, match="unknown kind 'send_welcom'"):
            await client.enqueue("send_welcom", {"user_id": 7})

    assert await _count(conn, schema) == 1
    assert (await _row(conn, schema, good))["kind"] == "send_welcome"


async def test_job_returns_the_live_job_and_none_for_unknown_ids(client: Client) -> None:
    job_id = await client.enqueue("k", {"x": [1, 2]}, queue="q", max_attempts=3)

    info = await client.job(job_id)
    assert info is not None
    assert (info.id, info.kind, info.queue, info.state) == (job_id, "k", "q", "available")
    assert (info.attempt, info.max_attempts, info.args) == (0, 3, {"x": [1, 2]})
    assert (info.result, info.reason, info.errors) == (None, None, [])
    assert await client.job(job_id + 1000) is None


async def test_sync_client_enqueues_without_an_event_loop(dsn: str, schema: str) -> None:
    def application_code() -> None:  # a plain thread: no event loop here
        with SyncClient(dsn, schema=schema) as client:
            job_id = client.enqueue("k", {"a": 1}, queue="sync")
            ids = client.enqueue_many([("k", {"a": 2})])
            info = client.job(job_id)
            with pytest.raises(EnqueueError):
                client.enqueue("k", [])
        assert info is not None and info.queue == "sync"
        assert len(ids) == 1 and ids[0] != job_id

    await anyio.to_thread.run_sync(application_code)


async def test_sql_functions_hold_the_clients_args_bound(
    conn: asyncpg.Connection, schema: str
) -> None:
    """One limit: the SQL function refuses exactly what the client refuses."""
    fits = await conn.fetchval(
        f"SELECT {schema}.job_problem('k', '{{}}'::jsonb, $1, 'q', 0, NULL, NULL, 1, NULL, NULL)",
        MAX_ARGS_BYTES,
    )
    over = await conn.fetchval(
        f"SELECT {schema}.job_problem('k', '{{}}'::jsonb, $1, 'q', 0, NULL, NULL, 1, NULL, NULL)",
        MAX_ARGS_BYTES + 1,
    )
    assert (fits, over) == (None, "args_size")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    declared=st.booleans(),
    queue=st.none() | st.just("given"),
    priority=st.none() | st.integers(-3, 3),
    max_attempts=st.none() | st.integers(1, 3),
    when=st.sampled_from(["now", "delay", "past", "future"]),
)
async def test_every_enqueue_path_applies_the_same_defaults(
    client: Client,
    conn: asyncpg.Connection,
    schema: str,
    declared: bool,
    queue: str | None,
    priority: int | None,
    max_attempts: int | None,
    when: str,
) -> None:
    """The COPY path, enqueue_many and enqueue: one set of defaults (job_defaults)."""
    await conn.execute(f"DELETE FROM {schema}.kind")
    if declared:
        await conn.execute(
            f"INSERT INTO {schema}.kind (name, queue, priority, max_attempts) "
            "VALUES ('k', 'declared', 7, 9)"
        )
    now = datetime.now(UTC)
    timing: dict[str, object] = {
        "now": {},
        "delay": {"delay": timedelta(hours=1)},
        "past": {"run_at": now - timedelta(days=1)},
        "future": {"run_at": now + timedelta(days=1)},
    }[when]  # type: ignore[assignment]
    options = dict(queue=queue, priority=priority, max_attempts=max_attempts, **timing)
    by_copy = (await client.enqueue_many([("k", {})], **options))[0]  # type: ignore[arg-type]
    by_function = (
        await client.enqueue_many([JobSpec("k", {}, unique_key=f"u{by_copy}", **options)])  # type: ignore[arg-type]
    )[0]
    single = await client.enqueue("k", {}, **options)  # type: ignore[arg-type]
    rows = [await _row(conn, schema, i) for i in (by_copy, by_function, single)]
    shapes = {
        (r["queue"], r["priority"], r["max_attempts"], r["state"], r["run_at"] > now) for r in rows
    }
    assert len(shapes) == 1, rows
    if "run_at" in timing:
        assert {r["run_at"] for r in rows} == {timing["run_at"]}


async def test_two_copy_batches_in_one_caller_transaction(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    """Each batch gets its own jobs and ids, not only at commit."""
    async with conn.transaction():
        first = await client.enqueue_many([("k", {"n": 1}), ("k", {"n": 2})], conn=conn)
        second = await client.enqueue_many([("k", {"n": 3})], conn=conn)
    assert len(first) == 2 and len(second) == 1
    rows = [await _row(conn, schema, i) for i in (*first, *second)]
    assert [r["args"] for r in rows] == ['{"n": 1}', '{"n": 2}', '{"n": 3}']


_SHAPE = (
    "SELECT kind, args, queue, priority, max_attempts, state::text, tenant, group_key, "
    "CASE WHEN run_at > enqueued_at + interval '1 day' OR run_at < enqueued_at "
    "THEN run_at::text ELSE (run_at - enqueued_at)::text END AS due, "
    "CASE WHEN expires_at > enqueued_at + interval '1 day' THEN expires_at::text "
    "ELSE (expires_at - enqueued_at)::text END AS expires "
    "FROM {schema}.job WHERE id = ANY($1::bigint[]) ORDER BY array_position($1, id)"
)
_NOW = datetime.now(UTC)
_item_options = st.fixed_dictionaries(
    {},
    optional={
        "queue": st.sampled_from(["q1", "q2"]),
        "priority": st.integers(-2, 2),
        "max_attempts": st.integers(1, 3),
        "tenant": st.sampled_from(["t1", "t2"]),
        "group": st.sampled_from(["g1", "g2"]),
        "delay": st.just(timedelta(hours=1)),
        "ttl": st.just(timedelta(hours=2)),
        "expires_at": st.just(_NOW + timedelta(days=3)),
    },
).filter(lambda o: not ("ttl" in o and "expires_at" in o))
_batch_item = st.tuples(st.sampled_from(["a", "b"]), st.none() | _item_options)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    items=st.lists(_batch_item, min_size=1, max_size=8),
    shared=st.fixed_dictionaries({}, optional={"queue": st.just("shared"), "priority": st.just(5)}),
    run_at=st.sampled_from([None, _NOW - timedelta(days=2), _NOW + timedelta(days=2)]),
)
async def test_a_copy_batch_of_many_option_sets_matches_the_function_path(
    client: Client,
    conn: asyncpg.Connection,
    schema: str,
    items: list[tuple[str, dict[str, Any] | None]],
    shared: dict[str, Any],
    run_at: datetime | None,
) -> None:
    """The COPY path resolves each distinct set of options once (job_copy_prepare) and
    gives every job in the batch, in input order, what the SQL function gives it."""
    await conn.execute(
        f"INSERT INTO {schema}.kind (name, queue, priority, max_attempts) "
        "VALUES ('a', 'declared', 7, 9) ON CONFLICT DO NOTHING"
    )
    keys = await conn.fetchval(f"SELECT count(*) FROM {schema}.job")
    by_copy: list[JobSpec | tuple[str, Any]] = []
    by_function: list[JobSpec] = []
    for n, (kind, own) in enumerate(items):
        by_copy.append((kind, {"n": n}) if own is None else JobSpec(kind, {"n": n}, **own))
        key = f"u{keys}-{n}"  # through the function, and the same defaults
        by_function.append(JobSpec(kind, {"n": n}, unique_key=key, **(own or {})))
    copied = await client.enqueue_many(by_copy, run_at=run_at, **shared)
    through_function = await client.enqueue_many(by_function, run_at=run_at, **shared)
    assert copied == sorted(copied)
    shape = _SHAPE.format(schema=schema)
    assert [tuple(r) for r in await conn.fetch(shape, copied)] == [
        tuple(r) for r in await conn.fetch(shape, through_function)
    ]


async def test_the_copy_path_leaves_no_session_state_behind(
    client: Client, conn: asyncpg.Connection, schema: str
) -> None:
    """COPY goes straight into the job table: no temporary table in the session (which a
    transaction pooler would hand to other clients' transactions), no TEMPORARY privilege
    needed."""
    async with client.pool.acquire() as own:
        ids = await client.enqueue_many([("k", {"n": n}) for n in range(3)], conn=own)
        temporary = await own.fetchval(
            "SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()"
        )
    assert len(ids) == 3
    assert temporary == 0
