"""What the lifecycle costs a completion that has no dependants: claims and completions
(batches of 50) through the completion statement of migrations 0015-0019 (the deleted
rows handed to job_finish) with job_finish as the lifecycle migration defines it
(history, then job_settle: the job_final announcement and the dependency edges'
look-up) beside job_finish as 0006 defined it (history only), and as the web console
migration defines it (the lifecycle's, plus the fingerprints column); and through
job_complete_many as it is (job_move, migration 0020); interleaved in one run on one
schema.

Creates schema ``bench_finish`` (migrated fresh) and drops it at the end.

    /work/venv/bin/python bench/finish_cost.py [--jobs 20000] [--reps 3] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from datetime import timedelta

import asyncpg
from complete_cpu import JOB_FINISH_ROWS  # (bench/ is the script's directory)

from pgjobd.client import Client
from pgjobd.migrate import available, migrate
from pgjobd.queries import for_schema
from pgjobd.sql_text import render
from pgjobd.statements import columns
from pgjobd.statements.job import CompleteRow

SCHEMA = "bench_finish"
BATCH = 50


def finish_of(version: int) -> str:
    """The CREATE FUNCTION job_finish of migration `version`, as CREATE OR REPLACE."""
    text = next(m.sql for m in available() if m.version == version)
    start = text.index("CREATE FUNCTION {{schema}}.job_finish(")
    end = text.index("$$;", text.index("AS $$", start)) + 3
    return render("CREATE OR REPLACE" + text[start + len("CREATE") : end], SCHEMA)


async def drain(conn: asyncpg.Connection, client: Client, n: int, sql: str) -> float:
    """Jobs/s of claiming and completing n jobs, the completions by `sql`."""
    q = for_schema(SCHEMA)
    await conn.execute(f"TRUNCATE {SCHEMA}.job, {SCHEMA}.job_history")
    for start in range(0, n, 10_000):
        await client.enqueue_many([("k", {"i": i}) for i in range(start, min(n, start + 10_000))])
    await conn.execute(f"ANALYZE {SCHEMA}.job")
    started = time.perf_counter()
    while claimed := await q.job_claim(conn, "default", BATCH, "bench", timedelta(minutes=5)):
        await conn.fetch(
            sql, *columns([CompleteRow(j.id, j.fence, None, True) for j in claimed], 4)
        )
    return n / (time.perf_counter() - started)


SIGNATURE = (
    "results     jsonb[]   DEFAULT NULL,\n    keep        boolean[] DEFAULT NULL,\n"
    "    fingerprints text[]  DEFAULT NULL\n)"
)


def with_signature(body: str) -> str:
    """`body` (an older job_finish) with the current signature, ignoring the arguments
    it does not read: CREATE OR REPLACE must not add an overload."""
    head, rest = body.split("RETURNS integer", 1)
    head = head[: head.index("results")] + SIGNATURE + "\n"
    return head + "RETURNS integer" + rest


async def main(args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(args.dsn)
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await migrate(conn, SCHEMA)
    version = {m.name: m.version for m in available()}
    bodies = {
        "0006": with_signature(finish_of(6)),
        "lifecycle": with_signature(finish_of(version["lifecycle"])),
        "web_console": finish_of(version["web_console"]),
        # The same, without the dead jobs' partial index the migration adds (a
        # completion's insert only checks its predicate): what that index costs.
        "web_console_no_dead_idx": finish_of(version["web_console"])
        + f"; DROP INDEX IF EXISTS {SCHEMA}.job_history_dead_at_idx",
        # job_complete_many as it is: job_move, which does not call job_finish.
        "job_move": finish_of(version["web_console"]),
    }
    rows_form, now = render(JOB_FINISH_ROWS, SCHEMA), for_schema(SCHEMA).sql("job_complete_many")
    restore = (
        f"CREATE INDEX IF NOT EXISTS job_history_dead_at_idx ON {SCHEMA}.job_history "
        "(finished_at) INCLUDE (fingerprint, reason, kind, queue) WHERE state = 'dead'"
    )
    pool = await asyncpg.create_pool(args.dsn, min_size=1, max_size=2)
    client = Client(pool, schema=SCHEMA)
    rates: dict[str, list[float]] = {name: [] for name in bodies}
    try:
        for rep in range(args.reps):
            for name, body in list(bodies.items())[:: 1 if rep % 2 == 0 else -1]:
                await conn.execute(restore)
                await conn.execute(body)
                sql = now if name == "job_move" else rows_form
                rates[name].append(await drain(conn, client, args.jobs, sql))
                print(f"rep {rep + 1} {name}: {rates[name][-1]:,.0f} jobs/s", flush=True)
    finally:
        await pool.close()
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await conn.close()
    for new, old in (
        ("lifecycle", "0006"),
        ("web_console", "lifecycle"),
        ("web_console", "web_console_no_dead_idx"),
        ("job_move", "web_console"),
    ):
        ratios = [a / b for a, b in zip(rates[new], rates[old], strict=True)]
        print(
            f"claim + complete_many ({BATCH}/batch), {args.jobs:,} jobs x {args.reps}: "
            f"{new}/{old} median {statistics.median(ratios):.3f} "
            f"(each: {', '.join(f'{r:.3f}' for r in ratios)})"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dsn", default=os.environ.get(
        "PGJOBD_DSN", "postgresql://root@127.0.0.1:5432/test"))  # fmt: skip
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
