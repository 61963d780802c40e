"""Plan shape of the job path's statements, on tables seeded with what slows a queue down.

The seed's PgQueuer anecdote (10,000 -> 330 jobs/s once an index stopped being used) is
a schema change that nobody saw in review: these tests run each statement of the job
path under EXPLAIN against a hot table holding far more future, running and dead rows
than due ones, and a history table far larger than both, and fail when a plan reads a
whole table, leaves the index it was built for, or touches buffers in proportion to a
table instead of to the batch. Plan shape, never time: the machine is noisy, plans are
not.

Each statement is planned twice: with its parameters' values (a custom plan, what
asyncpg's first executions get) and as a generic plan (what a prepared statement may
settle on after five executions).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import asyncpg
import pytest

from pgjobd.config import QueueConfig
from pgjobd.member.generations import write_queue_limits
from pgjobd.migrate import migrate
from pgjobd.queries import for_schema

pytestmark = pytest.mark.anyio

QUEUE = "plans"
BATCH = 50
# Scheduled far ahead: outside the claim index. Enough that the hot table has more pages
# than the claim's buffer bound, so a claim that read the table could not pass it
# (issue 17: a million future jobs must not slow the claim).
FUTURE_JOBS = 200_000
OTHER_QUEUE_JOBS = 5_000  # available in another queue
RUNNING_JOBS = 2_000  # held by members
DUE_JOBS = 500  # claimable in QUEUE
FAIR_QUEUE = "plans_fair"  # fair = true, no other limit: claims by tag
FAIR_JOBS = 500  # of 10 tenants, the newest jobs (the claim's fill tags them)
HISTORY_ROWS = 100_000  # final records in today's partition
CHURNED_JOBS = 5_000  # inserted and deleted: dead tuples in every index of the hot table
ATTEMPT_ROWS = 100_000  # failed attempts in today's partition, a tenth of them kind k


@dataclass(frozen=True)
class Case:
    statement: str
    args: Callable[[dict[str, Any]], tuple[Any, ...]]
    # Indexes the plan must use (at least one of each tuple's names).
    uses: tuple[tuple[str, ...], ...]
    # The statement does its work in functions (job_move): it is run, in a transaction
    # rolled back, and the plans of the statements it runs inside them are checked too.
    nested: bool = False


CASES = [
    Case(
        "job_claim",
        lambda s: (QUEUE, BATCH, "planner", timedelta(seconds=30), None, None, None),
        (("job_claim_idx",),),
    ),
    # A producer's look behind its claim cursor (here: behind the last job of the queue).
    Case(
        "job_available_behind",
        lambda s: (QUEUE, 2**15 - 1, datetime.now(UTC) + timedelta(days=1), 2**62),
        (("job_claim_idx",),),
    ),
    # A queue whose only limit is its global_concurrency claims the places it reserved.
    Case(
        "job_claim_reserved",
        lambda s: (QUEUE, "planner", timedelta(seconds=30), 0, BATCH),
        (("job_claim_idx",), ("job_pkey",)),
    ),
    # A queue whose only limit is fair = true: the fill that tags what arrived, then the
    # claim by tag (migration 0024).
    Case(
        "job_claim_fair",
        lambda s: (FAIR_QUEUE, BATCH, "planner", timedelta(seconds=30)),
        (("job_fair_tag_idx",), ("job_pkey",)),
        nested=True,
    ),
    Case("job_promote_due", lambda s: (BATCH,), (("job_due_idx",),)),
    Case(
        "job_complete_many",
        lambda s: (s["running_ids"], s["running_fences"], [None] * BATCH, [True] * BATCH),
        (("job_pkey",),),
        nested=True,
    ),
    Case(
        "job_fail_many",
        lambda s: (
            s["running_ids"],
            s["running_fences"],
            ["failed"] * BATCH,
            [3] * BATCH,
            [timedelta(seconds=1)] * BATCH,
            ["E"] * BATCH,
            ["m"] * BATCH,
            [None] * BATCH,
            [0.1] * BATCH,
            [True] * BATCH,
            [None] * BATCH,
            "planner",
        ),
        (("job_pkey",),),
        nested=True,
    ),
    Case(
        "job_lease_renew",
        lambda s: ("member-0", s["running_ids"], s["running_fences"], timedelta(seconds=30)),
        (("job_pkey",),),
    ),
    Case(
        "job_reap_expired",
        lambda s: (s["term"], timedelta(0), BATCH, [QUEUE], [3], 3, "f"),
        (("job_running_idx",),),
    ),
    Case("job_get", lambda s: (s["history_id"],), (("job_pkey",), ("job_history_id_idx",))),
    Case("job_priorities_age", lambda s: (QUEUE, timedelta(0), BATCH), (("job_claim_idx",),)),
    # The breaker role: a closed breaker counts its kind's recent failures, a probe's
    # outcome is looked up by its id.
    Case(
        "kind_breakers_step",
        lambda s: (None,),
        (("job_attempt_kind_failed_at_idx",), ("job_attempt_job_id_attempt_idx",)),
    ),
]


# A queue whose only limit is its global_concurrency claims within the member's standing
# allocation (migration 0025): its plans are checked where an allocation exists.
ALLOCATED_CLAIM = Case(
    "job_claim_allocated",
    lambda s: (QUEUE, BATCH, "planner", timedelta(seconds=30), [], None, None, None),
    (("job_running_idx",), ("job_claim_idx",), ("job_pkey",)),
    nested=True,
)


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


async def _big_relations(conn: asyncpg.Connection, schema: str) -> frozenset[str]:
    """The schema's tables and partitions of more than 64 pages: reading one of them
    whole is what a statement of the job path must never do (an empty partition of a
    future day is read whole at no cost)."""
    rows = await conn.fetch(
        "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = $1 AND c.relkind = 'r' "
        "AND pg_relation_size(c.oid) > 64 * current_setting('block_size')::int",
        schema,
    )
    return frozenset(row["relname"] for row in rows)


def _problems(plan: dict[str, Any], schema: str, case: Case, big: frozenset[str]) -> list[str]:
    """What in a plan reads a big relation whole: a sequential scan of it, or an index of
    it scanned from end to end, with no condition to seek by (directly or under a
    bitmap heap scan). Nodes name their schema only under EXPLAIN VERBOSE."""
    nodes = list(_nodes(plan))
    ours = [
        node for node in nodes if node.get("Schema") == schema and node.get("Relation Name") in big
    ]
    problems = [
        f"{node['Node Type']} on {node['Relation Name']}"
        for node in ours
        if node["Node Type"] in ("Seq Scan", "Sample Scan")
    ]
    # The partial indexes of a state are read whole by design: they hold only that
    # state's rows (the claim's own ordering, promotion, the reaper).
    by_state = ("job_claim_idx", "job_due_idx", "job_running_idx")
    problems += [
        f"{node['Node Type']} of all of {index['Index Name']}"
        for node in ours
        if node["Node Type"] == "Bitmap Heap Scan"
        for index in _nodes(node)
        if index["Node Type"] == "Bitmap Index Scan"
        and "Index Cond" not in index
        and not index["Index Name"].startswith(by_state)
    ]
    # An end of an index read for its first entry (max(id)) stops there: the only child
    # of a Limit of one row, with no filter to read past entries for.
    endpoints = {
        id(child)
        for node in nodes
        if node["Node Type"] == "Limit" and node["Plan Rows"] == 1
        for child in node.get("Plans", ())
        if "Filter" not in child
    }
    problems += [
        f"{node['Node Type']} of all of {node['Index Name']}"
        for node in ours
        if node["Node Type"] in ("Index Scan", "Index Only Scan")
        and "Index Cond" not in node
        and not node["Index Name"].startswith(by_state)
        and id(node) not in endpoints
    ]
    used = {node.get("Index Name") for node in nodes}
    # A partition's index is named after its parent's: job_history_p20261201_id_idx.
    used |= {re.sub(r"_p\d{8}_", "_", name) for name in used if name}
    for alternatives in case.uses:
        if not used & set(alternatives):
            problems.append(f"uses none of {alternatives} (uses {sorted(n for n in used if n)})")
    return problems


@pytest.fixture(scope="module", params=["analysed", "analysed_empty"])
def seeded_schema(dsn: str, request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    """One seeded schema for the whole module: seeding is the slow part. Its statistics
    are the rows' ("analysed"), or were taken while the tables were empty
    ("analysed_empty": a new install, or autovacuum after a queue drained), which a
    session's cached plans outlive."""
    name = f"t_plans_{uuid.uuid4().hex[:12]}"
    analyse = (
        f"ANALYZE {name}.job; ANALYZE {name}.job_history; ANALYZE {name}.job_attempt; "
        f"ANALYZE {name}.kind;"
        if request.param == "analysed"
        else ""
    )

    async def seed() -> dict[str, Any]:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn, name)
            job = f"{name}.job"
            if request.param == "analysed_empty":
                for table in ("job", "job_history", "job_attempt", "kind"):
                    await conn.execute(f"ANALYZE {name}.{table}")
                for table in ("job", "kind"):  # (partitions: each its own)
                    # (autovacuum would analyse the seeded rows during the module)
                    await conn.execute(
                        f"ALTER TABLE {name}.{table} SET (autovacuum_enabled = false)"
                    )
            await conn.execute(
                f"""
                INSERT INTO {job} (state, queue, kind, run_at, args)
                SELECT 'scheduled', '{QUEUE}', 'k', now() + interval '1 day' + g * interval '1 s', '{{}}'
                FROM generate_series(1, {FUTURE_JOBS}) AS g;
                INSERT INTO {job} (state, queue, kind, args)
                SELECT 'available', 'other', 'k', '{{}}' FROM generate_series(1, {OTHER_QUEUE_JOBS});
                INSERT INTO {job} (state, queue, kind, args)
                SELECT 'available', '{QUEUE}', 'k', '{{}}' FROM generate_series(1, {CHURNED_JOBS});
                DELETE FROM {job} WHERE queue = '{QUEUE}' AND state = 'available';
                INSERT INTO {job} (state, queue, kind, args, owner, fence, attempt,
                                   attempted_at, lease_expires_at)
                SELECT 'running', '{QUEUE}', 'k', '{{}}', 'member-' || (g % 3), nextval('{name}.fence_seq'),
                       1, now(), now() + interval '1 hour'
                FROM generate_series(1, {RUNNING_JOBS}) AS g;
                INSERT INTO {job} (state, queue, kind, args)
                SELECT 'available', '{QUEUE}', 'k', '{{}}' FROM generate_series(1, {DUE_JOBS});
                INSERT INTO {name}.queue (name, fair) VALUES ('{FAIR_QUEUE}', true);
                INSERT INTO {job} (state, queue, kind, args, tenant)
                SELECT 'available', '{FAIR_QUEUE}', 'k', '{{}}', 't' || (g % 10)
                FROM generate_series(1, {FAIR_JOBS}) AS g;
                INSERT INTO {name}.job_history (id, finished_at, run_at, enqueued_at, attempt,
                    max_attempts, priority, state, queue, kind, args)
                SELECT 1000000000 + g, now(), now(), now(), 1, 20, 0, 'completed', '{QUEUE}', 'k', '{{}}'
                FROM generate_series(1, {HISTORY_ROWS}) AS g;
                INSERT INTO {name}.job_attempt (job_id, failed_at, attempt, queue, kind,
                    outcome)
                SELECT g, now() - g * interval '10 ms', 1, '{QUEUE}',
                       CASE WHEN g % 10 = 0 THEN 'k' ELSE 'other' END, 'failed'
                FROM generate_series(1, {ATTEMPT_ROWS}) AS g;
                INSERT INTO {name}.kind (name, queue, breaker_failures, breaker_window,
                    breaker_cooldown)
                VALUES ('k', '{QUEUE}', 1000000, '1 hour', '30 s'),
                       ('other', '{QUEUE}', 5, '1 minute', '30 s');
                {analyse}
                """  # noqa: E501
            )
            running = await conn.fetch(
                f"SELECT id, fence FROM {job} WHERE state = 'running' AND owner = 'member-0' "
                f"ORDER BY id LIMIT {BATCH}"
            )
            term = await for_schema(name).leader_term_begin(conn, "planner")
            return {
                "big": await _big_relations(conn, name),
                "running_ids": [r["id"] for r in running],
                "running_fences": [r["fence"] for r in running],
                "history_id": 1_000_000_000 + HISTORY_ROWS // 2,
                "term": term,
            }
        finally:
            await conn.close()

    async def drop() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
        finally:
            await conn.close()

    try:
        yield name, anyio.run(seed)
    finally:
        anyio.run(drop)


async def _plan(
    conn: asyncpg.Connection, sql: str, args: tuple[Any, ...], *, generic: bool, analyze: bool,
    nested: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The plan of `sql` with `args`, in a transaction rolled back (an ANALYZE runs it).
    `nested`: the statement is also run, and the plans of the statements it runs inside
    functions are added under the top plan's "Plans" (auto_explain, sent as notices)."""
    # (VERBOSE: only then does a node name its relation's schema, which _problems reads)
    options = "FORMAT JSON, VERBOSE" + (", ANALYZE, BUFFERS" if analyze else "")
    transaction = conn.transaction()
    await transaction.start()
    notices: list[str] = []
    try:
        if generic:
            await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE plan_case AS {sql}")
        # EXPLAIN EXECUTE takes no bind parameters: each value becomes a literal of the
        # type PostgreSQL inferred for its parameter.
        types = await conn.fetchval(
            "SELECT parameter_types::text[] FROM pg_prepared_statements WHERE name = 'plan_case'"
        )
        literals = [
            f"{await conn.fetchval(f'SELECT quote_nullable(($1::{t})::text)', v)}::{t}"
            for t, v in zip(types, args, strict=True)
        ]
        text = await conn.fetchval(f"EXPLAIN ({options}) EXECUTE plan_case({', '.join(literals)})")
        plan: dict[str, Any] = json.loads(text)[0]["Plan"]
        if nested:
            await conn.execute(
                "LOAD 'auto_explain'; SET LOCAL auto_explain.log_min_duration = 0; "
                "SET LOCAL auto_explain.log_nested_statements = on; "
                "SET LOCAL auto_explain.log_format = json; "
                "SET LOCAL auto_explain.log_verbose = on; "
                "SET LOCAL auto_explain.log_level = notice"
            )
            conn.add_log_listener(lambda _, message: notices.append(message.message))
            await conn.fetch(f"EXECUTE plan_case({', '.join(literals)})")
            await conn.execute("SET LOCAL auto_explain.log_min_duration = -1")
            inner = [json.loads(n.partition("plan:")[2])["Plan"] for n in notices if "plan:" in n]
            plan = {**plan, "Plans": [*plan.get("Plans", ()), *inner]}
        return plan
    finally:
        await transaction.rollback()
        await conn.execute("DEALLOCATE ALL")


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("case", CASES, ids=[c.statement for c in CASES])
async def test_the_statement_reads_by_index_never_a_whole_table(
    dsn: str, seeded_schema: tuple[str, dict[str, Any]], case: Case, generic: bool
) -> None:
    schema, seeds = seeded_schema
    conn = await asyncpg.connect(dsn)
    try:
        sql = for_schema(schema).sql(case.statement)
        plan = await _plan(
            conn, sql, case.args(seeds), generic=generic, analyze=False, nested=case.nested
        )
    finally:
        await conn.close()
    assert _problems(plan, schema, case, seeds["big"]) == [], json.dumps(plan, indent=1)[:4000]


async def test_the_claim_touches_buffers_in_proportion_to_its_batch_not_the_table(
    dsn: str, seeded_schema: tuple[str, dict[str, Any]]
) -> None:
    schema, seeds = seeded_schema
    conn = await asyncpg.connect(dsn)
    try:
        sql = for_schema(schema).sql("job_claim")
        plan = await _plan(conn, sql, CASES[0].args(seeds), generic=False, analyze=True)
        pages = await conn.fetchval(
            f"SELECT pg_relation_size('{schema}.job') / current_setting('block_size')::int"
        )
    finally:
        await conn.close()
    touched = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    rows = FUTURE_JOBS + OTHER_QUEUE_JOBS + RUNNING_JOBS + DUE_JOBS
    # A claimed row costs a few pages (heap, each index it is in, the fence sequence):
    # a plan that scanned the hot table would touch about a page per 40 rows instead,
    # more than the bound (checked, so that the bound keeps meaning something).
    bound = 25 * BATCH
    assert pages > bound, f"seed more rows: the hot table has {pages} pages"
    assert plan["Actual Rows"] == BATCH
    assert touched < bound, (touched, rows)


async def _analyse_while_empty(conn: asyncpg.Connection, schema: str) -> None:
    """Statistics of an empty job table (relpages 0), kept while the test fills it."""
    await conn.execute(f"ANALYZE {schema}.job")
    await conn.execute(f"ALTER TABLE {schema}.job SET (autovacuum_enabled = false)")


@pytest.mark.parametrize("limits", ["global_concurrency", "fair", "allocated"])
async def test_a_flow_claim_planned_on_an_empty_table_still_updates_its_rows_by_id(
    conn: asyncpg.Connection, schema: str, limits: str
) -> None:
    """A session's plans outlive the statistics they were made from: with the job table
    analysed while empty (a new queue, or autovacuum after a queue drained) and then
    filled, job_claim_flow's update must still find its rows through job_pkey, not by
    reading all of job_claim_idx (migration 0023; before it, about 120 buffers a row).
    "allocated": the same for job_claim_allocated (migration 0025), whose LIMIT is a
    PL/pgSQL variable (the member's room in its allocation)."""
    await _analyse_while_empty(conn, schema)
    config = QueueConfig(global_concurrency=1000, fair=limits == "fair")
    await write_queue_limits(conn, for_schema(schema), {QUEUE: config}, "planner")
    await conn.execute(
        f"INSERT INTO {schema}.job (state, queue, kind, args, tenant) "
        f"SELECT 'available', '{QUEUE}', 'k', '{{}}', 't' || (g % 20) "
        f"FROM generate_series(1, {DUE_JOBS * 40}) AS g"
    )
    notices: list[str] = []
    conn.add_log_listener(lambda _, message: notices.append(message.message))
    async with conn.transaction():
        await conn.execute(
            "SET LOCAL plan_cache_mode = force_generic_plan; LOAD 'auto_explain'; "
            "SET LOCAL auto_explain.log_min_duration = 0; "
            "SET LOCAL auto_explain.log_nested_statements = on; "
            "SET LOCAL auto_explain.log_analyze = on; SET LOCAL auto_explain.log_buffers = on; "
            "SET LOCAL auto_explain.log_format = json; SET LOCAL auto_explain.log_level = notice"
        )
        q = for_schema(schema)
        if limits == "allocated":
            assert await q.flow_allocate(conn, QUEUE, "planner", [], BATCH) is not None
            # The plan of the claim runs under test: the allocation's own statements
            # would add notices of their own.
            notices.clear()
            claimed = await q.job_claim_allocated(
                conn, QUEUE, BATCH, "planner", timedelta(seconds=30), []
            )
        else:
            claimed = await q.job_claim_flow(
                conn, QUEUE, BATCH, "planner", timedelta(seconds=30), []
            )
    assert len([row for row in claimed if row.id is not None]) == BATCH
    plans = [json.loads(n.partition("plan:")[2])["Plan"] for n in notices if "plan:" in n]
    updates = [
        plan
        for plan in plans
        if plan["Node Type"] == "ModifyTable"
        and plan.get("Operation") == "Update"
        and plan.get("Relation Name") == "job"
        and plan.get("Actual Rows") == BATCH
    ]
    assert len(updates) == 1, [p["Node Type"] for p in plans]
    update = updates[0]
    # (job_claim_allocated picks its jobs in the update's own statement, a CTE read in
    # claim order through job_claim_idx: the rows' lookup is the rest of the plan.)
    lookup = [
        node
        for child in update.get("Plans", ())
        if child.get("Subplan Name") != "CTE picked"
        for node in _nodes(child)
    ]
    assert {n.get("Index Name") for n in lookup} & {"job_pkey"}, json.dumps(update)
    assert "job_claim_idx" not in {n.get("Index Name") for n in lookup}, json.dumps(update)
    touched = update["Shared Hit Blocks"] + update["Shared Read Blocks"]
    assert touched < 25 * BATCH, touched


@pytest.mark.parametrize(
    ("statement", "state", "args"),
    [
        ("admin_jobs_make_available", "scheduled", lambda ids: (ids,)),
        ("admin_jobs_cancel", "running", lambda ids: ([], ids)),
    ],
)
async def test_admin_actions_planned_on_an_empty_table_find_their_jobs_by_id(
    conn: asyncpg.Connection, schema: str, statement: str, state: str, args: Any
) -> None:
    """Admin actions name their jobs by id and check each one's state: with the job
    table analysed while empty and then filled, the check must not lead the planner into
    the partial index of that state (job_due_idx, job_running_idx), which it would read
    whole for a handful of ids."""
    await _analyse_while_empty(conn, schema)
    await conn.execute(
        f"""INSERT INTO {schema}.job (state, queue, kind, args, run_at, owner, fence, attempt,
                                      attempted_at, lease_expires_at)
            SELECT '{state}', '{QUEUE}', 'k', '{{}}', now() + interval '1 day',
                   CASE WHEN '{state}' = 'running' THEN 'member-0' END,
                   CASE WHEN '{state}' = 'running' THEN g END,
                   CASE WHEN '{state}' = 'running' THEN 1 ELSE 0 END,
                   CASE WHEN '{state}' = 'running' THEN now() END,
                   CASE WHEN '{state}' = 'running' THEN now() + interval '1 hour' END
            FROM generate_series(1, {DUE_JOBS * 40}) AS g"""
    )
    ids = [r["id"] for r in await conn.fetch(f"SELECT id FROM {schema}.job ORDER BY id LIMIT 5")]
    sql = for_schema(schema).sql(statement)
    plan = await _plan(conn, sql, args(ids), generic=True, analyze=True)
    used = {node.get("Index Name") for node in _nodes(plan)}
    assert "job_pkey" in used, json.dumps(plan)[:3000]
    assert not used & {"job_due_idx", "job_running_idx"}, used


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("statement", ["job_claim", "job_claim_reserved", "job_claim_allocated"])
async def test_a_claim_updates_its_rows_by_id_whatever_the_queues_backlog(
    conn: asyncpg.Connection, schema: str, statement: str, generic: bool
) -> None:
    """A claim's update joins the jobs it picked, as many as its LIMIT: a number a
    generic plan does not know (nor any plan when the LIMIT was read from the
    reservation), and the planner then expects a tenth of the queue's backlog. With a
    20,000-job backlog it joined the picked ids to a scan of the whole hot table."""
    q = for_schema(schema)
    if statement != "job_claim":
        config = QueueConfig(global_concurrency=1000)
        await write_queue_limits(conn, q, {QUEUE: config}, "planner")
    await conn.execute(
        f"INSERT INTO {schema}.job (state, queue, kind, args) "
        f"SELECT 'available', '{QUEUE}', 'k', '{{}}' FROM generate_series(1, {DUE_JOBS * 40})"
    )
    await conn.execute(f"ANALYZE {schema}.job")
    if statement == "job_claim_reserved":
        assert await q.flow_reserve(conn, QUEUE, BATCH, "planner", [], 0) == BATCH
    if statement == "job_claim_allocated":
        # Room for two batches: _plan runs the claim twice (EXPLAIN ANALYZE, and again
        # for the plans inside the function), in one transaction.
        assert await q.flow_allocate(conn, QUEUE, "planner", [], 2 * BATCH) is not None
    case = next(c for c in [*CASES, ALLOCATED_CLAIM] if c.statement == statement)
    plan = await _plan(
        conn, q.sql(case.statement), case.args({}), generic=generic, analyze=True,
        nested=case.nested,
    )  # fmt: skip
    assert plan["Actual Rows"] == BATCH
    big = await _big_relations(conn, schema)
    assert "job" in big
    assert _problems(plan, schema, case, big) == [], json.dumps(plan)[:4000]
