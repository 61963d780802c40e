"""What a fresh connection of the member's pool costs its first jobs: the first claim
path read, claim and completion on it, in a pool warmed as the member warms its own
(pgjobd.daemon.job_path_warmer, run as each connection opens) against the same pool
without the warm-up. One job is enqueued before each pool opens, so the claim and the
completion do their work. The two kinds of pool alternate; the medians and their ratio
are printed (issue 17, target 4: a starting member's first jobs).

    .venv/bin/python bench/pool_warm.py [--reps 12] [--dsn DSN | --private]

Not a test: it prints figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import asyncpg
from common import add_server_options, run_on_server

from pgjobd import Client, db
from pgjobd.config import Config, DatabaseConfig
from pgjobd.daemon import create_member_pool
from pgjobd.migrate import migrate
from pgjobd.queries import for_schema
from pgjobd.statements.job import CompleteRow

SCHEMA = "bench_pool_warm"


async def first_jobs_ms(config: Config, *, warm: bool) -> float:
    """Opens a one-connection member pool, warmed or not, and times the first claim path
    read, claim and completion of one job on its connection."""
    q = for_schema(SCHEMA)
    pool = await create_member_pool(config, warm=warm)
    try:
        async with db.acquire(pool) as conn:
            started = time.perf_counter()
            await q.queue_claim_path_get(conn, "default")
            rows = await q.job_claim(conn, "default", 10, "bench", timedelta(seconds=30))
            done = await q.job_complete_many(
                conn, [CompleteRow(r.id, r.fence, None, True) for r in rows]
            )
            elapsed = (time.perf_counter() - started) * 1000
    finally:
        await pool.close()
    if len(rows) != 1 or len(done) != 1:
        raise RuntimeError(f"expected one job claimed and completed, got {len(rows)}, {len(done)}")
    return elapsed


async def main(args: argparse.Namespace) -> None:
    admin = await asyncpg.connect(args.dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    try:
        await migrate(admin, SCHEMA)
        config = Config(
            database=DatabaseConfig(schema=SCHEMA, pool_min=1, pool_max=1), dsn=args.dsn
        )
        client = await Client.connect(args.dsn, schema=SCHEMA, max_size=1)
        figures: dict[bool, list[float]] = {True: [], False: []}
        try:
            for rep in range(args.reps):
                for warm in (True, False) if rep % 2 else (False, True):
                    await client.enqueue("bench_noop", {})
                    figures[warm].append(await first_jobs_ms(config, warm=warm))
        finally:
            await client.close()
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await admin.close()
    cold, warm = (statistics.median(figures[w]) for w in (False, True))
    for label, values in (("cold", figures[False]), ("warmed", figures[True])):
        print(f"first claim path read, claim and completion on a {label} connection: "
              f"median {statistics.median(values):.2f} ms "
              f"(min {min(values):.2f}, max {max(values):.2f})")  # fmt: skip
    print(f"cold / warmed: {cold / warm:.1f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=12)
    add_server_options(parser, "postgresql://root@127.0.0.1:5432/test")
    return parser.parse_args()


if __name__ == "__main__":
    run_on_server(parse_args(), main)
