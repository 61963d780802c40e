"""The drain beside a million future jobs and ten million history rows (issue 17, target 6).

Two schemas, both migrated fresh and dropped at the end:

- ``bench_scale_big``: ``--future`` (1,000,000) jobs scheduled a day ahead or more in the
  hot table (state scheduled: outside the claim index, inside job_due_idx), and
  ``--history`` (10,000,000) final records spread over ``--days`` (6) daily partitions of
  job_history, today's included (1 % of them dead). Generated server-side with
  INSERT ... SELECT generate_series: each day's partition is filled as a plain table
  and then attached (its indexes built once, in bulk), the hot table's rows are
  inserted directly; then VACUUM ANALYZE, as a long-running database would be.
- ``bench_scale_empty``: nothing.

Each repetition drains ``--n`` (20,000) no-op jobs with bench/throughput.py's drain (one
``pgjobd run`` member, default round processes=2, concurrency=100) on each schema, in
ABBA order (empty, big; then big, empty; ...). Drains are not fresh: the big schema keeps
its rows, and the drain ends when the new jobs are all in job_history. The figure is,
per rep, the big drain's rate over the empty one's; target >= 0.9.

At the end, EXPLAIN (ANALYZE, BUFFERS) of the claim, the completion, the reaper and the
promotion on the big schema (bench/common.py): the claim must touch a number of buffers
bounded by its batch (50), not by the table: fewer than 25 per claimed row.

    .venv/bin/python bench/scale.py [--reps 3] [--future 1000000] [--history 10000000]
        [--days 6] [--n 20000] [--round 2:100:all]
    .venv/bin/python bench/scale.py --reps 3 --future 100000 --history 1000000   # quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import UTC, datetime, timedelta

import asyncpg
from common import (
    EXPLAIN_BATCH,
    add_server_options,
    autovacuum_note,
    explain_job_path,
    hot_table_stats,
    run_on_server,
)
from throughput import DEFAULT_DSN, Harness, Round, drain, spread, verdict

from pgjobd.client import Client
from pgjobd.migrate import migrate

BIG = "bench_scale_big"
EMPTY = "bench_scale_empty"
RATIO = 0.9
BUFFERS_PER_ROW = 25  # as tests/integration/test_plans.py


async def seed(admin: asyncpg.Connection, future: int, history: int, days: int) -> None:
    """Fill BIG: history first (ids 1..history), then the future jobs (ids after)."""
    started = time.monotonic()
    await admin.execute("SET maintenance_work_mem = '256MB'; SET synchronous_commit = off")
    today = datetime.now(UTC).date()
    per_day = history // days
    for back in range(days - 1, -1, -1):
        day = today - timedelta(days=back)
        rows = per_day if back else history - per_day * (days - 1)
        part = f"job_history_p{day:%Y%m%d}"
        lower = datetime(day.year, day.month, day.day, tzinfo=UTC)
        # Today's records end a minute ago at the latest: the drains' come after them.
        upper = min(lower + timedelta(days=1), datetime.now(UTC) - timedelta(minutes=1))
        upper = max(upper, lower + timedelta(seconds=1))
        first = 1 + per_day * (days - 1 - back)
        await admin.execute(f"DROP TABLE IF EXISTS {BIG}.{part}")
        await admin.execute(
            f"CREATE TABLE {BIG}.{part} (LIKE {BIG}.job_history INCLUDING DEFAULTS "
            "INCLUDING CONSTRAINTS)"
        )
        await admin.execute(
            f"""
            INSERT INTO {BIG}.{part} (id, finished_at, run_at, enqueued_at, attempted_at,
                attempt, max_attempts, priority, state, queue, kind, reason, owner, args)
            SELECT {first} + g, t, t - interval '2 s', t - interval '2 s', t - interval '1 s',
                   1, 20, 0,
                   CASE WHEN g % 100 = 0 THEN 'dead' ELSE 'completed' END::{BIG}.job_state,
                   'default', CASE WHEN g % 7 = 0 THEN 'report' ELSE 'bench_noop' END,
                   CASE WHEN g % 100 = 0 THEN 'attempts_exhausted' END, 'seed-member',
                   jsonb_build_object('i', g, 'user', 'u' || (g % 1000))
            FROM generate_series(0, {rows - 1}) AS g,
                 LATERAL (SELECT $1::timestamptz + ($2::timestamptz - $1::timestamptz)
                                 * (g::float8 / {rows})) AS s(t)
            """,
            lower,
            upper,
        )
        await admin.execute(
            f"ALTER TABLE {BIG}.job_history ATTACH PARTITION {BIG}.{part} "
            f"FOR VALUES FROM ('{lower.isoformat()}') TO "
            f"('{(lower + timedelta(days=1)).isoformat()}')"
        )
        print(f"  history {day}: {rows:,} rows ({time.monotonic() - started:.0f} s)", flush=True)
    await admin.execute(f"SELECT setval(pg_get_serial_sequence('{BIG}.job', 'id'), {history + 1})")
    await admin.execute(
        f"""
        INSERT INTO {BIG}.job (state, queue, kind, run_at, args)
        SELECT 'scheduled', 'default', 'bench_noop',
               now() + interval '1 day' + g * interval '50 ms', jsonb_build_object('i', g)
        FROM generate_series(1, {future}) AS g
        """
    )
    print(f"  hot table: {future:,} future jobs ({time.monotonic() - started:.0f} s)")
    for schema in (BIG, EMPTY):
        await admin.execute(f"VACUUM ANALYZE {schema}.job")
        await admin.execute(f"VACUUM ANALYZE {schema}.job_history")
    print(f"seeded in {time.monotonic() - started:.0f} s", flush=True)


async def main(args: argparse.Namespace) -> None:
    rnd = Round.parse(args.round)
    admin = await asyncpg.connect(args.dsn)
    print(f"{await autovacuum_note(admin)}; load average {os.getloadavg()[0]:.2f}", flush=True)
    clients: dict[str, Client] = {}
    for schema in (BIG, EMPTY):
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    try:
        for schema in (BIG, EMPTY):
            await migrate(admin, schema)
        await seed(admin, args.future, args.history, args.days)
        poller = await asyncpg.connect(args.dsn, server_settings={"enable_seqscan": "off"})
        harness = {s: Harness(args.dsn, admin, poller, s) for s in (BIG, EMPTY)}
        for schema in (BIG, EMPTY):
            clients[schema] = await Client.connect(args.dsn, schema=schema, max_size=2)
        rates: dict[str, list[float]] = {BIG: [], EMPTY: []}
        for schema in (EMPTY, BIG):  # warm-up: statements prepared, caches warm
            await drain(harness[schema], clients[schema], rnd, 2_000, prefix="warmup",
                        fresh=False)  # fmt: skip
        for rep in range(1, args.reps + 1):
            order = (EMPTY, BIG) if rep % 2 else (BIG, EMPTY)
            load = os.getloadavg()[0]
            for schema in order:
                d = await drain(harness[schema], clients[schema], rnd, args.n,
                                prefix="scale", fresh=False)  # fmt: skip
                rates[schema].append(args.n / d.seconds)
                size, live, dead = await hot_table_stats(admin, schema)
                print(f"rep {rep} {schema:<18} {args.n / d.seconds:8,.0f} jobs/s  hot table "
                      f"{size / 2**20:7.1f} MiB, {live:,} live, {dead:,} dead (load {load:.2f})",
                      flush=True)  # fmt: skip
        plans = await explain_job_path(admin, clients[BIG], BIG)
        for plan in plans:
            print(f"\n-- {plan.statement} on {BIG}: {plan.buffers} buffers, {plan.rows} rows\n"
                  f"{plan.text}")  # fmt: skip
        ratios = [b / e for b, e in zip(rates[BIG], rates[EMPTY], strict=True)]
        claim = next(p for p in plans if p.statement == "job_claim")
        history = await admin.fetchval(f"SELECT count(*) FROM {BIG}.job_history")
        hot = await admin.fetchval(f"SELECT count(*) FROM {BIG}.job")
        print(f"\nbig: {hot:,} live jobs, {history:,} history rows; drain ({rnd.key}, "
              f"{args.n:,} jobs): empty {spread(rates[EMPTY])} jobs/s, big "
              f"{spread(rates[BIG])} jobs/s; big/empty per rep "
              f"{spread(ratios, '.2f')}")  # fmt: skip
        print(f"  drain >= {RATIO} of empty: {verdict(statistics.median(ratios) >= RATIO)}")
        bound = BUFFERS_PER_ROW * EXPLAIN_BATCH
        print(f"  claim of {claim.rows} rows touched {claim.buffers} buffers (bound "
              f"{bound}, by the batch): {verdict(claim.buffers < bound)}")  # fmt: skip
        await poller.close()
    finally:
        for client in clients.values():
            await client.close()
        if not args.keep:
            for schema in (BIG, EMPTY):
                await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_options(parser, DEFAULT_DSN)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=20_000, help="jobs per drain")
    parser.add_argument("--future", type=int, default=1_000_000)
    parser.add_argument("--history", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=6, help="daily history partitions")
    parser.add_argument("--round", default="2:100:all", help="processes:concurrency:history")
    parser.add_argument("--keep", action="store_true", help="keep the schemas at the end")
    return parser.parse_args()


if __name__ == "__main__":
    run_on_server(parse_args(), main)
