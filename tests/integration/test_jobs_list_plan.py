"""Plan shape of the jobs list (admin_jobs_list: `jobs list`, the console's jobs page):
keyset paging must read each table from its newest row by its id index, never a whole
table sorted, with or without filters, on the first page and deep ones, in custom and
generic plans. Plan shape, never time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from pgjobd.queries import for_schema

pytestmark = pytest.mark.anyio

HISTORY_ROWS = 30_000
LIVE_JOBS = 3_000
PAGE = 51


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize(
    ("states", "kind", "tenant", "deep"),
    [
        (None, None, None, False),
        (None, None, None, True),
        (["dead"], None, None, True),
        (["completed", "running"], "kind3", None, False),
        (None, None, "t7", True),
    ],
)
async def test_every_page_reads_from_the_id_indexes(
    conn: asyncpg.Connection, schema: str, generic: bool,
    states: list[str] | None, kind: str | None, tenant: str | None, deep: bool,
) -> None:  # fmt: skip
    await conn.execute(
        f"""INSERT INTO {schema}.job_history (id, finished_at, run_at, enqueued_at, attempt,
                max_attempts, priority, state, reason, queue, kind, tenant, args)
            SELECT g, now() - (({HISTORY_ROWS} - g) * interval '1 second'), now(), now(), 1,
                   1, 0, (CASE WHEN g % 20 = 0 THEN 'dead' ELSE 'completed' END)::
                   {schema}.job_state, CASE WHEN g % 20 = 0 THEN 'discarded' END,
                   'q' || (g % 4), 'kind' || (g % 10), 't' || (g % 30), '{{}}'
            FROM generate_series(1, {HISTORY_ROWS}) AS g"""
    )
    await conn.execute(
        f"SELECT setval(pg_get_serial_sequence('{schema}.job', 'id'), {HISTORY_ROWS + 1})"
    )
    await conn.execute(
        f"""INSERT INTO {schema}.job (state, queue, kind, tenant, args)
            SELECT 'available', 'q' || (g % 4), 'kind' || (g % 10), 't' || (g % 30), '{{}}'
            FROM generate_series(1, {LIVE_JOBS}) AS g"""
    )
    await conn.execute(f"ANALYZE {schema}.job, {schema}.job_history")
    if generic:
        await conn.execute("SET plan_cache_mode = force_generic_plan")
    before = HISTORY_ROWS // 2 if deep else None
    raw = await conn.fetchval(
        "EXPLAIN (FORMAT JSON) " + for_schema(schema).sql("admin_jobs_list"),
        states, None, kind, PAGE, True, True, tenant, before,
    )  # fmt: skip
    nodes = list(_nodes(json.loads(raw)[0]["Plan"]))
    whole = [
        f"{n['Node Type']} on {n.get('Relation Name')}"
        for n in nodes
        if n["Node Type"] in ("Seq Scan", "Bitmap Heap Scan")
        and n.get("Relation Name", "").startswith("job")
    ]
    assert whole == [], f"the jobs list reads whole tables: {whole}"
    indexes = {n.get("Index Name") for n in nodes if n["Node Type"] == "Index Scan"}
    assert "job_pkey" in indexes
    assert any(name and name.startswith("job_history_p") for name in indexes), indexes
    assert any(n["Node Type"] == "Merge Append" for n in nodes)
