"""What a transaction-mode PgBouncer costs pgjobd, as ratios within one run (issue 18).

Three routes to one database, measured interleaved in each repetition:

- ``direct``: asyncpg straight to PostgreSQL, prepared statements cached (the default);
- ``direct_nocache``: straight to PostgreSQL, ``statement_cache_size=0`` (what
  ``database.pooler = "transaction"`` sets): the cost of unnamed statements alone;
- ``pgbouncer``: through a private stock PgBouncer in transaction mode, no cache: what
  a pooled deployment pays.

Workloads: ``enqueue`` (``client.enqueue`` × --single-n, autocommit), ``copy``
(``client.enqueue_many`` of --n jobs, the COPY path), ``read`` (``client.job(id)`` ×
--single-n), and ``drain`` (a real ``pgjobd run`` member, noop handler, draining --n
jobs; the member's pool takes the route, its leader/LISTEN sessions are direct). Not a
test.

    .venv/bin/python bench/pooler.py --reps 3 [--dsn DSN] [--n 5000] [--single-n 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

from pgjobd.client import Client
from pgjobd.config import Pooler
from pgjobd.migrate import migrate
from pgjobd.pgbouncer import PgBouncer

SCHEMA = "bench_pooler"
DEFAULT_DSN = "postgresql://root@127.0.0.1:5432/test"
HANDLERS = Path(__file__).parent / "handlers"
ROUTES = ("direct", "direct_nocache", "pgbouncer")
WORKLOADS = ("enqueue", "copy", "read", "drain")


async def reset(admin: asyncpg.Connection) -> None:
    await admin.execute(f"TRUNCATE {SCHEMA}.job, {SCHEMA}.job_history, {SCHEMA}.job_attempt")


async def client_workloads(
    dsn: str, pooler: Pooler, cache: bool, args: argparse.Namespace, admin: asyncpg.Connection
) -> dict[str, float]:
    """Operations per second of each client workload on one route."""
    extra = {} if cache else {"statement_cache_size": 0}
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, **extra)
    client = Client(pool, schema=SCHEMA)
    rates: dict[str, float] = {}
    try:
        await client.enqueue("bench_noop", {"warm": True})
        await reset(admin)
        started = time.perf_counter()
        ids = [await client.enqueue("bench_noop", {"i": i}) for i in range(args.single_n)]
        rates["enqueue"] = args.single_n / (time.perf_counter() - started)
        started = time.perf_counter()
        for job_id in ids:
            await client.job(job_id)
        rates["read"] = args.single_n / (time.perf_counter() - started)
        await reset(admin)
        jobs = [("bench_noop", {"i": i}) for i in range(args.n)]
        started = time.perf_counter()
        await client.enqueue_many(jobs)
        rates["copy"] = args.n / (time.perf_counter() - started)
        await reset(admin)
    finally:
        await pool.close()
    return rates


async def drain(
    route_dsn: str, pooler: Pooler, args: argparse.Namespace, admin: asyncpg.Connection,
    workdir: Path,
) -> float:  # fmt: skip
    """Jobs per second a real member drains, its pool on the route."""
    database = f'pooler = "{pooler}"\nleader_dsn = "{args.dsn}"\n' if pooler != "none" else ""
    config = workdir / f"{pooler}.toml"
    config.write_text(
        f'[database]\nschema = "{SCHEMA}"\n{database}\n'
        f'[daemon]\nhandlers = ["{HANDLERS}"]\nmetrics_listen = ""\nlog_format = "text"\n\n'
        "[queues.default]\nconcurrency = 50\nprocesses = 2\n"
    )
    env = {**os.environ, "PGJOBD_DSN": route_dsn, "PGJOBD_BENCH_DIR": str(workdir)}
    log = (workdir / f"{pooler}.log").open("wb")
    member = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pgjobd", "run", "--config", str(config),
        stdout=log, stderr=log, env=env,
    )  # fmt: skip
    try:
        while not await admin.fetchval(f"SELECT count(*) FROM {SCHEMA}.member"):
            if member.returncode is not None:
                raise SystemExit(f"member exited {member.returncode}: see {log.name}")
            await asyncio.sleep(0.05)
        await admin.execute(
            f"SELECT count({SCHEMA}.enqueue('bench_noop')) FROM generate_series(1, $1::int)",
            args.n,
        )
        started = time.perf_counter()
        history = f"SELECT count(*) FROM {SCHEMA}.job_history"
        while await admin.fetchval(history) < args.n:  # noqa: ASYNC110 - polled, as a user would
            await asyncio.sleep(0.02)
        rate = args.n / (time.perf_counter() - started)
    finally:
        member.terminate()
        await asyncio.wait_for(member.wait(), 60)
        log.close()
    await reset(admin)
    return rate


async def main(args: argparse.Namespace) -> None:
    admin = await asyncpg.connect(args.dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await migrate(admin, SCHEMA)
    figures: dict[tuple[str, str], list[float]] = {}
    try:
        with PgBouncer.start(args.dsn) as bouncer, tempfile.TemporaryDirectory() as tmp:
            routes: dict[str, tuple[str, Pooler, bool]] = {
                "direct": (args.dsn, "none", True),
                "direct_nocache": (args.dsn, "none", False),
                "pgbouncer": (bouncer.dsn(), "transaction", False),
            }
            for rep in range(args.reps):
                for name, (dsn, pooler, cache) in routes.items():
                    rates = await client_workloads(dsn, pooler, cache, args, admin)
                    if name != "direct_nocache":  # a member's cache follows its pooler
                        rates["drain"] = await drain(dsn, pooler, args, admin, Path(tmp))
                    for workload, rate in rates.items():
                        figures.setdefault((name, workload), []).append(rate)
                print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await admin.close()

    print(f"{'workload':<10}" + "".join(f"{r:>16}" for r in ROUTES) + "   ratios to direct")
    for workload in WORKLOADS:
        medians = {
            r: statistics.median(figures[r, workload]) for r in ROUTES if (r, workload) in figures
        }
        cells = "".join(f"{medians[r]:>14.0f}/s" if r in medians else f"{'-':>16}" for r in ROUTES)
        ratios = ", ".join(
            f"{r} {medians[r] / medians['direct']:.2f}" for r in ROUTES[1:] if r in medians
        )
        print(f"{workload:<10}{cells}   {ratios}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("PGJOBD_DSN", DEFAULT_DSN))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=5_000, help="jobs per COPY and per drain")
    parser.add_argument("--single-n", type=int, default=1_000, help="single enqueues and reads")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
