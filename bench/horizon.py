"""Drain rate while a REPEATABLE READ transaction holds the xmin horizon (issue 17, target 5).

Creates schema ``bench_horizon`` (migrated fresh) and drops it at the end. Each
repetition, for each round (processes:concurrency:history), runs in this order:

- free: ``--free`` drains in a row (default 3), no holder; their median is the rep's
  baseline;
- held: a separate session opens a REPEATABLE READ transaction and reads the queue table
  (a snapshot: its backend_xmin holds the horizon, so vacuum removes no dead row of
  the hot table); drains run back to back until it has held for ``--hold`` seconds
  (default 120, at least 3 drains). Dead tuples accumulate: nothing is truncated
  between drains;
- recovery: the holder commits; drains run back to back for ``--recover`` seconds
  (default 60). The recovery figure is the best drain that started within that time.

A drain is bench/throughput.py's (one ``pgjobd run`` member per drain, 20,000 no-op jobs
enqueued with enqueue_many, timed from the first handler start until no job is available
or running; not fresh, so dead rows stay). Each member serves /metrics; after each drain
the claim statement's histogram (``pgjobd_claim_duration_seconds``: one claim round trip
including the pool acquire) gives the share of claims within 50 ms and the p99 bucket.
Dead rows of the hot table: ``pg_stat_user_tables.n_dead_tup`` after each drain.

    .venv/bin/python bench/horizon.py [--reps 3] [--rounds 2:100:all,2:20:all]
        [--hold 120] [--recover 60] [--n 20000] [--explain]   # --explain: plans while held

Targets: held rate >= 0.8 of free (median over the held drains, per rep, against that
rep's free median), claim p99 < 50 ms while held, a drain within 60 s of the release at
>= 0.95 of free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import urllib.request
from dataclasses import dataclass, field

import asyncpg
from common import (
    add_server_options,
    autovacuum_note,
    explain_job_path,
    hot_table_stats,
    run_on_server,
)
from throughput import (
    DEFAULT_DSN,
    Harness,
    Member,
    Round,
    drain,
    fresh_harness,
    spread,
    verdict,
)  # fmt: skip

from pgjobd.client import Client
from pgjobd.embedded import free_port

SCHEMA = "bench_horizon"
HELD_RATIO = 0.8
RECOVERED_RATIO = 0.95
CLAIM_P99_S = 0.05


@dataclass
class Sample:
    phase: str  # free | held | recovery
    started_s: float  # since the phase began
    rate: float
    dead_tuples: int
    claims: int
    claims_within_50ms: float  # share
    claim_p99_le_s: float  # upper bound of the bucket holding the 99th percentile


@dataclass
class Rep:
    round: str
    samples: list[Sample] = field(default_factory=list)

    def rates(self, phase: str) -> list[float]:
        return [s.rate for s in self.samples if s.phase == phase]


def claim_histogram(text: str) -> dict[float, float]:
    """Cumulative bucket counts of pgjobd_claim_duration_seconds, summed over queues."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("pgjobd_claim_duration_seconds_bucket{"):
            labels, _, value = line.rpartition(" ")
            le = labels.split('le="')[1].split('"')[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return buckets


def histogram_figures(buckets: dict[float, float]) -> tuple[int, float, float]:
    """(claims, share within 50 ms, upper bound of the p99 bucket)."""
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return 0, 1.0, 0.0
    within = buckets.get(CLAIM_P99_S, 0.0) / total
    p99 = next(le for le, count in sorted(buckets.items()) if count >= 0.99 * total)
    return int(total), within, p99


async def dead_tuples(admin: asyncpg.Connection) -> int:
    return (await hot_table_stats(admin, SCHEMA))[2]


async def one_drain(h: Harness, client: Client, rnd: Round, n: int, phase: str, *,
                    phase_start: float) -> Sample:  # fmt: skip
    scraped: dict[float, float] = {}
    port = free_port()  # (not a fixed one: two runs at once would scrape each other)

    async def scrape(running: Member) -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        scraped.update(claim_histogram(text.decode()))

    started = time.monotonic() - phase_start
    d = await drain(h, client, rnd, n, prefix=f"horizon_{phase}", fresh=False, on_done=scrape,
                    metrics_listen=f"127.0.0.1:{port}")  # fmt: skip
    claims, within, p99 = histogram_figures(scraped)
    sample = Sample(phase, started, n / d.seconds, await dead_tuples(h.admin), claims, within, p99)
    print(f"  {rnd.key} {phase:<8} t={started:5.0f}s {sample.rate:8,.0f} jobs/s  dead tuples "
          f"{sample.dead_tuples:>9,}  claims {claims:>6} within 50 ms {within:.3f} "
          f"p99 <= {p99 * 1000:g} ms", flush=True)  # fmt: skip
    return sample


async def hold(dsn: str) -> asyncpg.Connection:
    """A session in a REPEATABLE READ transaction that has read something: its snapshot
    holds the xmin horizon until it ends."""
    holder = await asyncpg.connect(dsn, server_settings={"application_name": "bench-holder"})
    await holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    await holder.fetchval(f"SELECT count(*) FROM {SCHEMA}.queue")
    return holder


async def run_rep(h: Harness, client: Client, rnd: Round, args: argparse.Namespace) -> Rep:
    rep = Rep(rnd.key)
    await h.admin.execute(f"VACUUM {SCHEMA}.job")  # each rep starts from a clean table
    start = time.monotonic()
    for _ in range(args.free):
        rep.samples.append(await one_drain(h, client, rnd, args.n, "free", phase_start=start))
    if args.explain:
        plans = await explain_job_path(h.admin, client, SCHEMA)
        print("  free, buffers: " + ", ".join(f"{p.statement} {p.buffers}" for p in plans))
    holder = await hold(h.dsn)
    try:
        start = time.monotonic()
        while time.monotonic() - start < args.hold or len(rep.rates("held")) < 3:
            rep.samples.append(await one_drain(h, client, rnd, args.n, "held", phase_start=start))
        if args.explain:
            held_s = time.monotonic() - start
            for plan in await explain_job_path(h.admin, client, SCHEMA):
                print(f"\n-- {plan.statement} ({rnd.key}, held {held_s:.0f} s): "
                      f"{plan.buffers} buffers\n{plan.text}")  # fmt: skip
    finally:
        await holder.execute("COMMIT")
        await holder.close()
    start = time.monotonic()
    while time.monotonic() - start < args.recover:
        rep.samples.append(await one_drain(h, client, rnd, args.n, "recovery", phase_start=start))
    return rep


def report(reps: list[Rep], rounds: list[Round], recover_s: float) -> None:
    print("\nper round: medians over reps of per-rep figures (min-max); ratios against the "
          "rep's own free median")  # fmt: skip
    for rnd in rounds:
        mine = [r for r in reps if r.round == rnd.key]
        free = [statistics.median(r.rates("free")) for r in mine]
        held = [statistics.median(r.rates("held")) / f for r, f in zip(mine, free, strict=True)]
        worst = [min(r.rates("held")) / f for r, f in zip(mine, free, strict=True)]
        last = [r.rates("held")[-1] / f for r, f in zip(mine, free, strict=True)]
        first_after = [r.rates("recovery")[0] / f for r, f in zip(mine, free, strict=True)]
        recovered = [max(s.rate for s in r.samples if s.phase == "recovery"
                         and s.started_s <= recover_s) / f
                     for r, f in zip(mine, free, strict=True)]  # fmt: skip
        held_samples = [s for r in mine for s in r.samples if s.phase == "held"]
        within = min(s.claims_within_50ms for s in held_samples)
        p99 = max(s.claim_p99_le_s for s in held_samples)
        dead = max(s.dead_tuples for s in held_samples)
        print(f"{rnd.key}: free {spread(free)} jobs/s; held/free {spread(held, '.2f')} "
              f"(worst drain {spread(worst, '.2f')}, last {spread(last, '.2f')}); "
              f"first drain after release {spread(first_after, '.2f')}, best within "
              f"{recover_s:g} s {spread(recovered, '.2f')}; most dead tuples {dead:,}; "
              f"claims within 50 ms while held: worst drain {within:.4f}, p99 bucket <= "
              f"{p99 * 1000:g} ms")  # fmt: skip
        print(
            f"  held >= {HELD_RATIO} of free: {verdict(statistics.median(held) >= HELD_RATIO)}; "
            f"claim p99 < 50 ms: {verdict(within >= 0.99)}; recovery >= {RECOVERED_RATIO} "
            f"within {recover_s:g} s: {verdict(statistics.median(recovered) >= RECOVERED_RATIO)}"
        )


async def main(args: argparse.Namespace) -> list[Rep]:
    rounds = [Round.parse(text) for text in args.rounds.split(",")]
    reps: list[Rep] = []
    async with fresh_harness(args.dsn, SCHEMA) as (h, client):
        note = await autovacuum_note(h.admin)
        print(f"{note}; load average {os.getloadavg()[0]:.2f}", flush=True)
        await drain(h, client, rounds[0], 2_000, prefix="warmup", fresh=False)
        for rep in range(1, args.reps + 1):
            print(f"rep {rep}, load average {os.getloadavg()[0]:.2f}", flush=True)
            for rnd in rounds if rep % 2 else rounds[::-1]:
                reps.append(await run_rep(h, client, rnd, args))
        report(reps, rounds, args.recover)
    return reps


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_options(parser, DEFAULT_DSN)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=20_000, help="jobs per drain")
    parser.add_argument("--rounds", default="2:100:all,2:20:all",
                        help="processes:concurrency:history per round (2:20:all: the "
                        "defaults)")  # fmt: skip
    parser.add_argument("--free", type=int, default=3, help="free drains per rep")
    parser.add_argument("--hold", type=float, default=120.0, help="seconds held")
    parser.add_argument("--recover", type=float, default=60.0, help="seconds after release")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="EXPLAIN (ANALYZE, BUFFERS) the job path at the end of each hold",
    )
    parser.add_argument("--json", help="write the raw samples to this file")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    measured = run_on_server(arguments, main)
    if arguments.json:
        with open(arguments.json, "w") as out:
            json.dump([{"round": r.round, "samples": [s.__dict__ for s in r.samples]}
                       for r in measured], out, indent=1)  # fmt: skip
