"""What a completion costs the database: backend CPU time of job_complete_many per batch
of 50, read from /proc/<backend pid>/schedstat around each call (CPU time on the
server, not wall time, so a loaded machine moves it little), for the statement as it
is, for the one-statement form it had before issue 11 gave history writes one home
(a DELETE ... RETURNING feeding an INSERT into job_history, no job_finish, nothing
announced or settled), for that form doing what finishing does since the lifecycle
(announce, settle the jobs with dependants), and for the form of migrations 0015-0019
(the deleted rows passed to job_finish as an array of whole rows, which job_move
replaced in 0020; job_finish stays for members of v0.1.0), interleaved in one run.

Creates schema ``bench_complete`` (migrated fresh) and drops it at the end. Needs the
server on this host (it reads the backend's /proc entry).

    python bench/complete_cpu.py [--jobs 5000] [--reps 10] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from datetime import timedelta
from pathlib import Path

import asyncpg

from pgjobd.client import Client
from pgjobd.migrate import migrate
from pgjobd.queries import for_schema
from pgjobd.sql_text import render

SCHEMA = "bench_complete"
BATCH = 50
# The completions' fence-checked DELETE, as the forms before job_move began.
FINISHED = """
WITH finished AS (
    DELETE FROM {{schema}}.job AS j
    USING unnest($1::bigint[], $2::bigint[], $3::text[], $4::boolean[])
          AS o(id, fence, result, keep)
    WHERE j.id = ANY($1::bigint[]) AND j.id = o.id AND j.fence = o.fence
"""
ONE_STATEMENT = (
    FINISHED
    + """    RETURNING j.*, o.result, o.keep
), recorded AS (
    INSERT INTO {{schema}}.job_history (id, finished_at, run_at, enqueued_at, attempted_at,
        attempt, max_attempts, priority, state, queue, kind, tenant, unique_key, owner,
        last_error, args, result, depends_on, after_jobs)
    SELECT f.id, now(), f.run_at, f.enqueued_at, f.attempted_at, f.attempt, f.max_attempts,
           f.priority, 'completed', f.queue, f.kind, f.tenant,
           coalesce(f.unique_key, f.successor_key), f.owner, f.last_error, f.args,
           f.result::jsonb, f.depends_on, f.after_jobs
    FROM finished AS f
    WHERE f.keep
)
SELECT f.id, f.fence FROM finished AS f
"""
)
# The same one statement doing what finishing does since the lifecycle (0010, 0015):
# announce every id on job_final, settle the jobs something depends on. Beside "now",
# what giving history writes one home (job_finish) costs by itself.
ONE_STATEMENT_SETTLING = ONE_STATEMENT.replace(
    "SELECT f.id, f.fence FROM finished AS f",
    """, announced AS (
    SELECT pg_notify('{{schema}}.job_final', string_agg(f.id::text, ',')) FROM finished AS f
), settled AS (
    SELECT {{schema}}.job_settle(array_agg(f.id), NULL) FROM finished AS f
    WHERE f.has_dependants HAVING count(*) > 0
)
SELECT f.id, f.fence FROM finished AS f
-- (Read once, first, so that both run: a cross join of the two read nothing from
-- announced when settled was empty, and the form announced nothing.)
WHERE (SELECT count(*) FROM announced) >= 0 AND (SELECT count(*) FROM settled) >= 0""",
)

# The completion statement of migrations 0015-0019: the caller's DELETE ... RETURNING
# hands job_finish the rows it deleted.
JOB_FINISH_ROWS = (
    FINISHED
    + """    RETURNING j AS job, j.id, j.fence, o.result, o.keep
), recorded AS (
    SELECT {{schema}}.job_finish(array_agg(f.job), NULL, array_agg((f.job).last_error),
                                 array_agg(f.result::jsonb), array_agg(f.keep))
    FROM finished AS f
)
SELECT f.id, f.fence FROM finished AS f CROSS JOIN recorded
"""
)


def cpu_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


async def per_call_ms(conn: asyncpg.Connection, client: Client, sql: str, n: int) -> float:
    """Median backend CPU (ms) of one completion call, over draining n jobs."""
    q = for_schema(SCHEMA)
    await conn.execute(f"TRUNCATE {SCHEMA}.job, {SCHEMA}.job_history")
    await client.enqueue_many([("k", {"i": i, "pad": "x" * 100}) for i in range(n)])
    await conn.execute(f"VACUUM ANALYZE {SCHEMA}.job")
    pid = conn.get_server_pid()
    spent = []
    while claimed := await q.job_claim(conn, "default", BATCH, "bench", timedelta(minutes=5)):
        ids, fences = [j.id for j in claimed], [j.fence for j in claimed]
        before = cpu_ns(pid)
        await conn.fetch(sql, ids, fences, [None] * len(ids), [True] * len(ids))
        spent.append((cpu_ns(pid) - before) / 1e6)
    return statistics.median(spent)


async def main(args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(args.dsn)
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await migrate(conn, SCHEMA)
    variants = {
        "before issue 11": render(ONE_STATEMENT, SCHEMA),
        "one statement, settling": render(ONE_STATEMENT_SETTLING, SCHEMA),
        "job_finish's rows": render(JOB_FINISH_ROWS, SCHEMA),
        "now": for_schema(SCHEMA).sql("job_complete_many"),
    }
    pool = await asyncpg.create_pool(args.dsn, min_size=1, max_size=2)
    client = Client(pool, schema=SCHEMA)
    spent: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for rep in range(args.reps):
            for name, sql in list(variants.items())[:: 1 if rep % 2 == 0 else -1]:
                spent[name].append(await per_call_ms(conn, client, sql, args.jobs))
    finally:
        await pool.close()
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await conn.close()
    for name, values in spent.items():
        print(f"{name:24s} {statistics.median(values):.3f} ms backend CPU per {BATCH}-job call "
              f"(reps: {', '.join(f'{v:.2f}' for v in values)})")  # fmt: skip
    for baseline in ("before issue 11", "one statement, settling", "job_finish's rows"):
        ratios = [a / b for a, b in zip(spent["now"], spent[baseline], strict=True)]
        print(f"now / {baseline}: median {statistics.median(ratios):.2f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=5_000)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dsn", default=os.environ.get(
        "PGJOBD_DSN", "postgresql://root@127.0.0.1:5432/test"))  # fmt: skip
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
