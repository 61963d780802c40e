"""Flow control's cost, as ratios against baselines in the same run (issue 12).

Two parts, each in its own fresh schema (``bench_flow``, dropped at the end):

- claim: C sessions (default 3, as 3 members) each loop the claim statement (LIMIT 50)
  and ``job_complete_many`` for what it claimed, over N pre-enqueued no-op jobs, with
  nothing else running. Modes, interleaved per repetition:
    baseline     the claim statement as it was before flow control (no flow guard)
    unlimited    today's ``job_claim`` (the flow guard: two more probes of small tables)
    limited      ``job_claim_flow`` with global_concurrency = 150 (never reached)
    every_limit  ``job_claim_flow`` with global_concurrency 150, rate_limit 10000/1s,
                 a kind with global_concurrency 150 (half the jobs are of it), and half
                 of the jobs in 500 groups
    tenants      ``job_claim_flow`` with global_concurrency = 150, jobs of 100 tenants
    fair         as tenants, with fair = true, made fair by the member's write after the
                 enqueue (which marks the jobs), then shared by stride scheduling
                 (migrations 0014, 0018)
  Printed: jobs/s, and the claim statement's p50/p99 (client-timed).
- drain: 2 real ``pgjobd run`` members drain N no-op jobs, ABBA per rep; setups
  (``--drains``): ``global_concurrency = 50`` (concurrency 50 each) against
  ``concurrency = 25`` each (per-member limits adding up to 50); and jobs of 100
  tenants in a queue with ``fair = true`` against the same jobs without it
  (concurrency 50 each). Timed from the enqueue's commit to an empty hot table.
- flood: 2 members drain a fair queue where one tenant has ``--flood-n`` jobs queued
  (100,000); every 0.5 s another tenant enqueues one job. Per such job: the queue's
  starts between its enqueue and its start (the fairness bound says at most the number
  of waiting tenants, 2, per claim order), and that wait in ms.

    .venv/bin/python bench/flow.py [--reps 3] [--n 20000] [--drain-n 5000]
        [--dsn DSN | --private]
        [--parts claim,drain,flood] [--drains per_member_25x2,global_50,tenants_100,fair_100]
        [--flood-n 100000] [--probes 5]
        [--modes baseline,unlimited,no_breaker,limited,every_limit,tenants,fair]

Not a test: it prints figures, and the ratios beside the issue's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import asyncpg
from common import add_server_options, run_on_server

from pgjobd.config import QueueConfig
from pgjobd.member.generations import write_queue_limits
from pgjobd.migrate import migrate
from pgjobd.queries import Queries, for_schema

SCHEMA = "bench_flow"
LEASE = timedelta(seconds=60)
HANDLERS = Path(__file__).parent / "handlers"
FLOW_GUARD = """
      AND NOT EXISTS (SELECT FROM {s}.queue AS q
                      WHERE q.name = $1 AND (q.paused OR q.flow))
      AND NOT EXISTS (SELECT FROM {s}.kind AS k
                      WHERE k.global_concurrency IS NOT NULL OR k.rate_limit IS NOT NULL
                            OR k.breaker_limit IS NOT NULL)"""
OLD_GUARD = """
      AND NOT EXISTS (SELECT FROM {s}.queue AS q WHERE q.name = $1 AND q.paused)"""


async def fresh_schema(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await migrate(conn, SCHEMA)
    return conn


async def setup_claim(conn: asyncpg.Connection, mode: str, n: int) -> None:
    await conn.execute(f"TRUNCATE {SCHEMA}.job, {SCHEMA}.flow_start, {SCHEMA}.fair_pass")
    await conn.execute(f"DELETE FROM {SCHEMA}.queue")
    await conn.execute(f"DELETE FROM {SCHEMA}.kind")
    if mode == "limited":
        await conn.execute(
            f"INSERT INTO {SCHEMA}.queue (name, global_concurrency) VALUES ('bench', 150)"
        )
    if mode == "every_limit":
        await conn.execute(
            f"INSERT INTO {SCHEMA}.queue (name, global_concurrency, rate_limit, rate_window) "
            "VALUES ('bench', 150, 10000, '1 second')"
        )
        await conn.execute(
            f"INSERT INTO {SCHEMA}.kind (name, queue, global_concurrency) "
            "VALUES ('capped', 'bench', 150)"
        )
    if mode == "tenants":
        await conn.execute(
            f"INSERT INTO {SCHEMA}.queue (name, global_concurrency) VALUES ('bench', 150)"
        )
    grouped = mode == "every_limit"
    await conn.execute(
        f"""INSERT INTO {SCHEMA}.job (state, queue, kind, args, group_key, tenant)
            SELECT 'available', 'bench', CASE WHEN $2 AND g % 2 = 0 THEN 'capped'
                                              ELSE 'noop' END,
                   '{{}}'::jsonb, CASE WHEN $2 AND g % 2 = 1 THEN 'g' || (g % 500) END,
                   CASE WHEN $3 THEN 't' || (g % 100) END
            FROM generate_series(1, $1) AS g""",
        n,
        grouped,
        mode in ("tenants", "fair"),
    )
    if grouped:
        await conn.execute(f"UPDATE {SCHEMA}.queue SET grouped = true WHERE name = 'bench'")
    if mode == "fair":
        # As a member makes a queue fair (its write marks the live jobs with their
        # tenant): a queue row written by hand has no fair_scanned, and its claims
        # would mark only the newest 2,100 ids, running the rest unmarked.
        config = QueueConfig(global_concurrency=150, fair=True)
        await write_queue_limits(conn, for_schema(SCHEMA), {"bench": config}, "bench")
    await conn.execute(f"ANALYZE {SCHEMA}.job")


async def claim_loop(dsn: str, statement: str, q: Queries, out: list[float]) -> int:
    conn = await asyncpg.connect(dsn)
    done = 0
    empty = 0
    args: tuple[object, ...] = ("bench", 50, f"m{id(out)}", LEASE)
    # The rest by type: no ended and unrecorded jobs (job_claim_flow's fences), no claim
    # cursor (job_claim's last position), so the claim starts at the queue's head.
    rest = (await conn.prepare(statement)).get_parameters()[len(args) :]
    args += tuple([] if parameter.name == "_int8" else None for parameter in rest)
    try:
        while empty < 3:
            started = time.perf_counter()
            rows = await conn.fetch(statement, *args)
            out.append(time.perf_counter() - started)
            jobs = [r for r in rows if r["id"] is not None]
            if not jobs:
                if not rows:  # nothing held back by a limit either: none left
                    empty += 1
                await asyncio.sleep(0.001)
                continue
            empty = 0
            await conn.fetch(
                q.sql("job_complete_many"), [r["id"] for r in jobs], [r["fence"] for r in jobs],
                [None] * len(jobs), [False] * len(jobs),
            )  # fmt: skip
            done += len(jobs)
    finally:
        await conn.close()
    return done


async def claim_part(
    dsn: str, reps: int, n: int, sessions: int, modes: list[str]
) -> dict[str, list[float]]:
    conn = await fresh_schema(dsn)
    q = for_schema(SCHEMA)
    new_guard, old_guard = FLOW_GUARD.format(s=SCHEMA), OLD_GUARD.format(s=SCHEMA)
    assert new_guard in q.sql("job_claim"), "the flow guard of job_claim has changed"
    statements = {
        "baseline": q.sql("job_claim").replace(new_guard, old_guard),
        "unlimited": q.sql("job_claim"),
        # job_claim before the circuit breaker's predicate (issue 12): its price.
        "no_breaker": q.sql("job_claim").replace(
            "\n                            OR k.breaker_limit IS NOT NULL)", ")"
        ),
        "limited": q.sql("job_claim_flow"),
        "every_limit": q.sql("job_claim_flow"),
        "tenants": q.sql("job_claim_flow"),
        "fair": q.sql("job_claim_flow"),
    }
    assert statements["no_breaker"] != statements["unlimited"], "the breaker guard changed"
    statements = {mode: statements[mode] for mode in modes}
    rates: dict[str, list[float]] = {mode: [] for mode in statements}
    latencies: dict[str, list[float]] = {mode: [] for mode in statements}
    try:
        for rep in range(reps):
            for mode, statement in statements.items():
                await setup_claim(conn, mode, n)
                seen: list[float] = []
                started = time.perf_counter()
                counts = await asyncio.gather(
                    *(claim_loop(dsn, statement, q, seen) for _ in range(sessions))
                )
                elapsed = time.perf_counter() - started
                assert sum(counts) == n, (mode, sum(counts))
                rates[mode].append(n / elapsed)
                latencies[mode] += seen
                print(f"  rep {rep + 1} {mode:12s} {n / elapsed:10.0f} jobs/s", flush=True)
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await conn.close()
    print(f"\nclaim: {sessions} sessions, {n} jobs, claim LIMIT 50, {reps} reps")
    print(f"{'mode':12s} {'jobs/s (median)':>16s} {'ratio':>7s} {'p50 ms':>8s} {'p99 ms':>8s}"
          f"   (ratio: against {modes[0]})")  # fmt: skip
    base = statistics.median(rates[modes[0]])
    for mode in statements:
        cuts = statistics.quantiles(latencies[mode], n=100)
        median = statistics.median(rates[mode])
        print(f"{mode:12s} {median:16.0f} {median / base:7.2f} "
              f"{cuts[49] * 1000:8.2f} {cuts[98] * 1000:8.2f}")  # fmt: skip
    return rates


def member_config(tmp: Path, index: int, queue: str, handlers: Path, dsn: str) -> Path:
    path = tmp / f"member{index}.toml"
    path.write_text(
        f'[database]\nschema = "{SCHEMA}"\n\n'
        f'[daemon]\nhandlers = ["{handlers}"]\nmetrics_listen = ""\nlog_format = "text"\n'
        f'log_level = "warning"\n\n{queue}'
    )
    return path


# Drain setups, in pairs: (name, queue TOML, jobs of 100 tenants) and the baseline the
# issue measures it against.
DRAIN_SETUPS = {
    "per_member_25x2": ('concurrency = 25\nprocesses = 2\nhistory = "none"\n', False),
    "global_50": ('concurrency = 50\nprocesses = 2\nhistory = "none"\nglobal_concurrency = 50\n',
                  False),
    "tenants_100": ('concurrency = 50\nprocesses = 2\nhistory = "none"\n', True),
    "fair_100": ('concurrency = 50\nprocesses = 2\nhistory = "none"\nfair = true\n', True),
}  # fmt: skip
DRAIN_PAIRS = (("global_50", "per_member_25x2", 0.8), ("fair_100", "tenants_100", 0.7))


@contextlib.asynccontextmanager
async def members_running(
    dsn: str, queue_toml: str, members: int
) -> AsyncIterator[asyncpg.Connection]:
    """`members` real `pgjobd run` members serving queue "default" (QUEUE_TOML) on a
    fresh schema, each past its first claim; yields an admin session."""
    conn = await fresh_schema(dsn)
    processes = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(members):
                config = member_config(
                    Path(tmp), i, f"[queues.default]\n{queue_toml}", HANDLERS, dsn
                )
                processes.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, "-m", "pgjobd", "run", "--config", str(config),
                        env={**os.environ, "PGJOBD_DSN": dsn},
                        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                    )
                )  # fmt: skip
            while await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.member") < members:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # every producer has made its first claim
            yield conn
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            await process.wait()
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await conn.close()


async def enqueue_rows(conn: asyncpg.Connection, n: int, tenant_sql: str) -> None:
    """N no-op jobs in one INSERT, their tenant given by `tenant_sql` over g (1..N)."""
    await conn.execute(
        f"""INSERT INTO {SCHEMA}.job (state, queue, kind, args, tenant)
            SELECT 'available', 'default', 'bench_noop', '{{}}'::jsonb, {tenant_sql}
            FROM generate_series(1, $1) AS g""",
        n,
    )
    await conn.execute(f"NOTIFY \"{SCHEMA}.job_ready\", 'default'")


async def drain_once(dsn: str, queue_toml: str, n: int, members: int, tenants: bool) -> float:
    async with members_running(dsn, queue_toml, members) as conn:
        started = time.perf_counter()
        await enqueue_rows(conn, n, "'t' || (g % 100)" if tenants else "NULL")
        while await conn.fetchval(f"SELECT EXISTS (SELECT FROM {SCHEMA}.job)"):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        return time.perf_counter() - started


FLOOD_TOML = 'concurrency = 50\nprocesses = 2\nhistory = "all"\nfair = true\n'


async def flood_once(dsn: str, flood: int, probes: int) -> list[tuple[int, float]]:
    """A fair queue draining `flood` jobs of one tenant on 2 members; every 0.5 s another
    tenant enqueues one job. Per probe: the queue's starts between its enqueue and its
    start, and that time in ms (the database's clock)."""
    found: list[tuple[int, float]] = []
    async with members_running(dsn, FLOOD_TOML, 2) as conn:
        await enqueue_rows(conn, flood, "'flood'")
        for probe in range(probes):
            await asyncio.sleep(0.5)
            late = await conn.fetchval(
                f"INSERT INTO {SCHEMA}.job (state, queue, kind, args, tenant) VALUES "
                f"('available', 'default', 'bench_noop', '{{}}', 'late{probe}') RETURNING id"
            )
            await conn.execute(f"NOTIFY \"{SCHEMA}.job_ready\", 'default'")
            row = None
            while row is None:
                await asyncio.sleep(0.005)
                row = await conn.fetchrow(
                    f"SELECT enqueued_at, attempted_at FROM {SCHEMA}.job_history WHERE id = $1",
                    late,
                )
            between = await conn.fetchval(
                f"""SELECT (SELECT count(*) FROM {SCHEMA}.job_history AS h
                            WHERE h.attempted_at > $1 AND h.attempted_at < $2)
                         + (SELECT count(*) FROM {SCHEMA}.job AS j
                            WHERE j.state = 'running' AND j.attempted_at > $1
                              AND j.attempted_at < $2)""",
                row["enqueued_at"], row["attempted_at"],
            )  # fmt: skip
            waited_ms = (row["attempted_at"] - row["enqueued_at"]).total_seconds() * 1000
            found.append((between, waited_ms))
            left = await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.job")
            print(f"    probe {probe + 1}: {between} starts, {waited_ms:.1f} ms "
                  f"({left} jobs left)", flush=True)  # fmt: skip
    return found


async def flood_part(dsn: str, reps: int, flood: int, probes: int) -> None:
    found: list[tuple[int, float]] = []
    for rep in range(reps):
        print(f"  rep {rep + 1}: a tenant with {flood} jobs queued, others' single jobs")
        found += await flood_once(dsn, flood, probes)
    starts = sorted(f[0] for f in found)
    waits = sorted(f[1] for f in found)
    print(f"\nflood: {len(found)} single jobs behind {flood} of another tenant, 2 members, "
          f"fair = true: starts between enqueue and start median {statistics.median(starts)}, "
          f"max {starts[-1]}; wait median {statistics.median(waits):.1f} ms, "
          f"max {waits[-1]:.1f} ms")  # fmt: skip


async def drain_part(dsn: str, reps: int, n: int, setups: list[str]) -> None:
    rates: dict[str, list[float]] = {name: [] for name in setups}
    for rep in range(reps):
        for name in setups if rep % 2 == 0 else reversed(setups):
            toml, tenants = DRAIN_SETUPS[name]
            seconds = await drain_once(dsn, toml, n, members=2, tenants=tenants)
            rates[name].append(n / seconds)
            print(f"  rep {rep + 1} {name:16s} {n / seconds:8.0f} jobs/s", flush=True)
    print(f"\ndrain: 2 members, {n} no-op jobs, {reps} reps (ABBA), median jobs/s")
    for name in setups:
        print(f"  {name:16s} {statistics.median(rates[name]):8.0f}")
    for variant, base, target in DRAIN_PAIRS:
        if variant in rates and base in rates:
            ratios = [v / b for v, b in zip(rates[variant], rates[base], strict=True)]
            print(f"  {variant} / {base}: {statistics.median(ratios):.2f} (per rep "
                  f"{', '.join(f'{r:.2f}' for r in ratios)}; target >= {target})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_options(parser, "postgresql://root@127.0.0.1:5432/test")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--drain-n", type=int, default=5000)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--parts", default="claim,drain", help="claim,drain,flood")
    parser.add_argument("--flood-n", type=int, default=100_000)
    parser.add_argument("--probes", type=int, default=5, help="single jobs per flood rep")
    parser.add_argument("--drains", default=",".join(DRAIN_SETUPS), help="drain setups")
    parser.add_argument(
        "--modes", default="baseline,unlimited,limited,every_limit,tenants,fair",
        help="claim modes, the first the ratios' baseline",
    )  # fmt: skip
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    run_on_server(args, run_parts)


async def run_parts(args: argparse.Namespace) -> None:
    parts = args.parts.split(",")
    if "claim" in parts:
        modes = args.modes.split(",")
        await claim_part(args.dsn, args.reps, args.n, args.sessions, modes)
    if "drain" in parts:
        await drain_part(args.dsn, args.reps, args.drain_n, args.drains.split(","))
    if "flood" in parts:
        await flood_part(args.dsn, args.reps, args.flood_n, args.probes)


if __name__ == "__main__":
    main()
