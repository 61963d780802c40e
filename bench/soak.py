"""A long run at half of capacity: does anything grow or slow down? (issue 17, target 7)

Creates schema ``bench_soak`` (migrated fresh) and drops it at the end.

1. Capacity: bench/throughput.py's drain of ``--capacity-n`` (10,000) no-op jobs with
   the soak's own member settings (``--round``, default processes=2, concurrency=20:
   the defaults).
2. Soak: one ``pgjobd run`` member for ``--minutes`` (30); a producer in this process
   enqueues (enqueue_many, every 0.1 s) at ``--load`` (0.5) of that capacity, a mix of
   80 % no-op jobs, 8 % that fail their first attempt (Retry after 1 s), 7 % that snooze
   for 1 s half of the time, and 5 % scheduled 5 to ``--ahead-s`` (60) s ahead
   (bench/handlers/soak.py).
   Every 10 s it samples: jobs finished in the interval (job_history rows by
   finished_at, on the database clock), available jobs, the hot table's
   pg_total_relation_size and its dead rows (pg_stat_user_tables), the member's RSS
   (supervisor plus workers, VmRSS from /proc) and the job_history partitions present.
3. End: the producer stops; the run waits until the hot table is empty (scheduled jobs
   included) and checks that every enqueued job has exactly one final record, completed.

Reports the throughput of the first 5 minutes against the last 5 (target >= 0.95; with
the enqueue rate fixed, it falls only when the member stops keeping up), and the bounds:
the largest hot-table size, dead rows and RSS, the RSS at the end against the first
sample, the partitions. ``--ci`` (the chaos smoke's short run: ``python -m chaos smoke``
runs ``--minutes 2 --ci`` on its own private server) asserts loose bounds instead and
exits 1 on a breach: nothing lost or duplicated, the hot table under 256 MiB (vacuum
may come a minute late), RSS at the end under 1.5x the first sample + 20 MiB; no
throughput ratio.

    .venv/bin/python bench/soak.py [--minutes 30] [--load 0.5] [--round 2:20:all] [--ci]
        [--private]   # on a throwaway cluster of its own (autovacuum on)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
from common import add_server_options, autovacuum_note, hot_table_stats, run_on_server
from procstat import children_of
from throughput import DEFAULT_DSN, Round, drain, fresh_harness, member, verdict

from pgjobd.client import Client, JobSpec

SCHEMA = "bench_soak"
SAMPLE_S = 10.0
EDGE_S = 300.0  # first and last 5 minutes
FLAT_RATIO = 0.95
CI_HOT_TABLE_BYTES = 256 * 2**20
CI_RSS_GROWTH = 1.5
CI_RSS_SLACK = 20 * 2**20


@dataclass
class Sample:
    at_s: float  # since the soak started
    finished: int  # final records in the interval
    rate: float  # finished per second over the interval
    enqueued: int  # so far
    available: int
    hot_bytes: int
    dead_tuples: int
    rss_bytes: int
    partitions: int


def rss_bytes(pid: int) -> int:
    """VmRSS of a process and its children (0 for one that is gone)."""
    total = 0
    for p in [pid, *children_of(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def mixed(count: int, serial: int, rng: random.Random, ahead_s: float = 60.0) -> list[JobSpec]:
    jobs = []
    for i in range(serial, serial + count):
        draw = rng.random()
        if draw < 0.80:
            jobs.append(JobSpec("bench_noop", {"i": i}))
        elif draw < 0.88:
            jobs.append(JobSpec("bench_soak_retry", {"i": i}))
        elif draw < 0.95:
            jobs.append(JobSpec("bench_soak_snooze", {"i": i}))
        else:
            ahead = timedelta(seconds=rng.uniform(5, ahead_s))
            jobs.append(JobSpec("bench_noop", {"i": i}, run_at=datetime.now(UTC) + ahead))
    return jobs


class Producer:
    def __init__(self, client: Client, rate: float, seed: int, ahead_s: float = 60.0) -> None:
        self.client = client
        self.rate = rate
        self.ahead_s = ahead_s
        self.enqueued = 0
        self.rng = random.Random(seed)
        self.stop = asyncio.Event()

    async def run(self) -> None:
        started = time.monotonic()
        while not self.stop.is_set():
            due = int(self.rate * (time.monotonic() - started)) - self.enqueued
            if due > 0:
                await self.client.enqueue_many(mixed(due, self.enqueued, self.rng, self.ahead_s))
                self.enqueued += due
            await asyncio.sleep(0.1)


async def sample(admin: asyncpg.Connection, since: datetime, soak_start: float,
                 producer: Producer, pid: int) -> tuple[Sample, datetime]:  # fmt: skip
    now: datetime = await admin.fetchval("SELECT clock_timestamp()")
    finished = await admin.fetchval(
        f"SELECT count(*) FROM {SCHEMA}.job_history WHERE finished_at > $1 AND finished_at <= $2",
        since,
        now,
    )
    available = await admin.fetchval(f"SELECT count(*) FROM {SCHEMA}.job WHERE state = 'available'")
    partitions = await admin.fetchval(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass",
        f"{SCHEMA}.job_history",
    )
    size, _, dead = await hot_table_stats(admin, SCHEMA)
    seconds = (now - since).total_seconds()
    s = Sample(time.monotonic() - soak_start, finished, finished / seconds, producer.enqueued,
               available, size, dead, rss_bytes(pid), partitions)  # fmt: skip
    print(f"t={s.at_s:6.0f}s finished {s.rate:7,.0f}/s enqueued {s.enqueued:>9,} available "
          f"{s.available:>6,} hot table {s.hot_bytes / 2**20:6.1f} MiB dead {s.dead_tuples:>7,} "
          f"RSS {s.rss_bytes / 2**20:6.1f} MiB partitions {s.partitions}", flush=True)  # fmt: skip
    return s, now


def report(samples: list[Sample], enqueued: int, lost: list[str], args: argparse.Namespace,
           *, rate: float, capacity: float) -> bool:  # fmt: skip
    """Prints the figures; True when --ci's bounds hold (always True without --ci)."""
    edge_samples = max(1, min(int(EDGE_S / SAMPLE_S), len(samples) // 2))
    edge = edge_samples * SAMPLE_S
    first = [s.rate for s in samples[:edge_samples]]
    last = [s.rate for s in samples[-edge_samples:]]
    hot = max(s.hot_bytes for s in samples)
    dead = max(s.dead_tuples for s in samples)
    rss_first, rss_max, rss_end = samples[0].rss_bytes, max(s.rss_bytes for s in samples), \
        samples[-1].rss_bytes  # fmt: skip
    ratio = statistics.mean(last) / statistics.mean(first)
    print(f"\ncapacity {capacity:,.0f} jobs/s; enqueued at {rate:,.0f}/s for {args.minutes:g} "
          f"min: {enqueued:,} jobs")  # fmt: skip
    print(f"throughput, first {edge:.0f} s {statistics.mean(first):,.0f}/s, last {edge:.0f} s "
          f"{statistics.mean(last):,.0f}/s: ratio {ratio:.3f} (target >= {FLAT_RATIO}: "
          f"{verdict(ratio >= FLAT_RATIO)})")  # fmt: skip
    print(f"hot table: max {hot / 2**20:.1f} MiB, max dead rows {dead:,}; available at the "
          f"end of each sample max {max(s.available for s in samples):,}")  # fmt: skip
    print(f"member RSS: first {rss_first / 2**20:.1f} MiB, max {rss_max / 2**20:.1f} MiB, "
          f"end {rss_end / 2**20:.1f} MiB; history partitions "
          f"{sorted({s.partitions for s in samples})}")  # fmt: skip
    print(f"lost or wrong: {lost or 'none'}")
    if not args.ci:
        return not lost
    breaches = list(lost)
    if hot > CI_HOT_TABLE_BYTES:
        breaches.append(f"hot table reached {hot / 2**20:.1f} MiB")
    if rss_end > CI_RSS_GROWTH * rss_first + CI_RSS_SLACK:
        breaches.append(f"RSS grew from {rss_first / 2**20:.1f} to {rss_end / 2**20:.1f} MiB")
    print(f"--ci bounds: {'held' if not breaches else 'BREACHED: ' + '; '.join(breaches)}")
    return not breaches


async def main(args: argparse.Namespace) -> bool:
    rnd = Round.parse(args.round)
    async with fresh_harness(args.dsn, SCHEMA) as (h, client):
        admin = h.admin
        note = await autovacuum_note(admin)
        print(f"{note}; load average {os.getloadavg()[0]:.2f}", flush=True)
        await drain(h, client, rnd, 1_000, prefix="warmup")
        d = await drain(h, client, rnd, args.capacity_n, prefix="capacity")
        capacity = args.capacity_n / d.seconds
        rate = capacity * args.load
        print(f"capacity {capacity:,.0f} jobs/s ({rnd.key}); soak at {rate:,.0f} jobs/s "
              f"for {args.minutes:g} min (load average {os.getloadavg()[0]:.2f})",
              flush=True)  # fmt: skip
        await admin.execute(f"TRUNCATE {SCHEMA}.job, {SCHEMA}.job_history, "
                            f"{SCHEMA}.job_attempt")  # fmt: skip
        producer = Producer(client, rate, args.seed, args.ahead_s)
        samples: list[Sample] = []
        async with member(args.dsn, rnd, "soak", schema=SCHEMA) as running:
            await h.poll(f"SELECT count(*) FROM {SCHEMA}.member", lambda v: v > 0,
                         running, 0.05)  # fmt: skip
            started = time.monotonic()
            since: datetime = await admin.fetchval("SELECT clock_timestamp()")
            task = asyncio.create_task(producer.run())
            try:
                while time.monotonic() - started < args.minutes * 60:
                    await asyncio.sleep(SAMPLE_S - (time.monotonic() - started) % SAMPLE_S)
                    running.check_alive()
                    s, since = await sample(admin, since, started, producer,
                                            running.process.pid)  # fmt: skip
                    samples.append(s)
            finally:
                producer.stop.set()
                await task
            # everything enqueued, scheduled ones included, is finished
            await h.poll(f"SELECT count(*) FROM (SELECT 1 FROM {SCHEMA}.job LIMIT 1) s",
                         lambda v: v == 0, running, 0.5, timeout_s=180)  # fmt: skip
        lost = []
        counts = await admin.fetch(
            f"SELECT state::text, count(*), count(DISTINCT id) FROM {SCHEMA}.job_history "
            "GROUP BY state"
        )
        by_state = {r[0]: (r[1], r[2]) for r in counts}
        completed, distinct = by_state.pop("completed", (0, 0))
        if completed != producer.enqueued or distinct != completed:
            lost.append(f"{producer.enqueued} enqueued, {completed} completed records "
                        f"for {distinct} jobs")  # fmt: skip
        if by_state:
            lost.append(f"other final states: {by_state}")
        return report(samples, producer.enqueued, lost, args, rate=rate, capacity=capacity)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_options(parser, DEFAULT_DSN)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--load", type=float, default=0.5, help="share of capacity")
    parser.add_argument("--capacity-n", type=int, default=10_000)
    parser.add_argument("--round", default="2:20:all", help="processes:concurrency:history")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ahead-s", type=float, default=60.0,
                        help="scheduled jobs run 5 s to this far ahead (at the end, the run "
                        "waits for them: tests/bench's smoke runs 5)")  # fmt: skip
    parser.add_argument("--ci", action="store_true", help="assert loose bounds, exit 1 if not")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(0 if run_on_server(parse_args(), main) else 1)
