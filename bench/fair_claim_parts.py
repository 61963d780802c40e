"""What the parts of a fair claim cost (issue 12): the claim, timed alone, with one part
at a time replaced by something that costs next to nothing.

One session claims ``--n`` (20,000) no-op jobs of 100 tenants in a fair queue (set up as
``bench/flow.py``'s claim part does: marked by the member's write), ``--want`` at a
time, completing each claim's jobs, nothing else running; then the same with:

- ``no_fill``: ``fair_tenant_mark`` marks nothing (every job is marked already);
- ``no_scan``: ``job_fair_tenants`` returns the 100 tenant names without reading the
  job table (the loose index scan of ``job_fair_idx``, which since migration 0022 runs
  once a second, not every claim);
- ``neither``: both;
- ``tenants``: the same jobs in a queue with tenants and no fair share.

Variants interleave per repetition. The replaced functions are wrong in general and
right for this data only (the bench's schema is dropped at the end). Printed: the
claim's p50 and p90 in ms per variant, the medians over the reps.

    .venv/bin/python bench/fair_claim_parts.py [--reps 3] [--want 25] [--n 20000]
        [--dsn DSN | --private]
"""

from __future__ import annotations

import argparse
import statistics
import time

import flow
from common import add_server_options, run_on_server

from pgjobd.queries import for_schema

NO_FILL = "CREATE OR REPLACE FUNCTION {s}.fair_tenant_mark(claim_queue text) RETURNS text[] "
NO_FILL += "LANGUAGE sql AS 'SELECT ''{{}}''::text[]'"
NO_SCAN = """
CREATE OR REPLACE FUNCTION {s}.job_fair_tenants(
    claim_queue text, after_key text, upto_key text, scan_limit integer)
RETURNS TABLE (tenant text, turn integer) LANGUAGE sql STABLE AS $$
    SELECT x.t, (row_number() OVER (ORDER BY x.t))::integer
    FROM (SELECT 't' || g AS t FROM generate_series(0, 99) AS g) AS x
    WHERE x.t > after_key AND (upto_key IS NULL OR x.t < upto_key)
    ORDER BY x.t
$$"""
VARIANTS = {"fair": [], "no_fill": [NO_FILL], "no_scan": [NO_SCAN],
            "neither": [NO_FILL, NO_SCAN], "tenants": []}  # fmt: skip


async def one_run(dsn: str, variant: str, want: int, n: int) -> list[float]:
    conn = await flow.fresh_schema(dsn)
    try:
        q = for_schema(flow.SCHEMA)
        await flow.setup_claim(conn, "tenants" if variant == "tenants" else "fair", n)
        for statement in VARIANTS[variant]:
            await conn.execute(statement.format(s=flow.SCHEMA))
        seconds: list[float] = []
        while True:
            started = time.perf_counter()
            rows = await conn.fetch(q.sql("job_claim_flow"), "bench", want, "m1", flow.LEASE, [])
            seconds.append(time.perf_counter() - started)
            jobs = [r for r in rows if r["id"] is not None]
            if not jobs:
                return seconds
            await conn.fetch(
                q.sql("job_complete_many"), [r["id"] for r in jobs], [r["fence"] for r in jobs],
                [None] * len(jobs), [False] * len(jobs),
            )  # fmt: skip
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {flow.SCHEMA} CASCADE")
        await conn.close()


async def main(args: argparse.Namespace) -> None:
    p50s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    p90s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for variant in VARIANTS:
            seconds = await one_run(args.dsn, variant, args.want, args.n)
            cuts = statistics.quantiles(seconds, n=10)
            p50s[variant].append(statistics.median(seconds) * 1000)
            p90s[variant].append(cuts[8] * 1000)
            print(f"  rep {rep + 1} {variant:8s} p50 {p50s[variant][-1]:.2f} ms", flush=True)
    base = statistics.median(p50s["fair"])
    print(f"\nfair claim of {args.want}, 100 tenants, {args.n:,} jobs, one session, "
          f"{args.reps} reps")  # fmt: skip
    print(f"{'variant':8s} {'p50 ms':>8s} {'p90 ms':>8s} {'of fair':>8s}")
    for variant in VARIANTS:
        p50 = statistics.median(p50s[variant])
        print(f"{variant:8s} {p50:8.2f} {statistics.median(p90s[variant]):8.2f} {p50 / base:8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_options(parser, "postgresql://root@127.0.0.1:5432/test")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--want", type=int, default=25)
    parser.add_argument("--n", type=int, default=20_000, help="jobs claimed per run")
    run_on_server(parser.parse_args(), main)
