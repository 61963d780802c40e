"""The web console's cost: page server times on a big database, keyset paging, and the
drain rate with the console refreshing beside it, in one run.

Creates schema ``bench_web`` (migrated fresh) and drops it at the end. It loads
``--history`` final records (completed 93 %, dead 5 % with 40 distinct errors,
cancelled 2 %, over 6 queues, 30 kinds and 200 tenants, finished over the last 20 h)
and ``--live`` live jobs in queues no member serves (available 70 %, scheduled 20 %,
retryable 10 %), 24 h of queue samples, then VACUUM ANALYZEs (as autovacuum would
soon after such a load). Then:

- a real ``pgjobd web`` process and one real member (the leader, whose queue_stats
  role publishes the live counts the overview reads); each page (and the API reads) is requested
  ``--requests`` times after a warm-up; the server time of each request is its
  ``Server-Timing: app;dur=`` header (what the ASGI app spent, database included);
  p50 and p95 are printed against the 200 ms target;
- keyset paging: /api/jobs?limit=50 walked from the newest page to the 100th by its
  cursor; the server times of pages 1-5 and 96-100 are compared, and EXPLAIN ANALYZE
  of the statement for the first and the 100th page is printed;
- drain: one real ``pgjobd run`` member (bench/handlers, no-op jobs, queue ``drain``);
  each round pauses the queue, enqueues ``--drain-jobs`` jobs, resumes it and times
  until the queue is empty. Rounds alternate without and with the console refreshing
  (six tabs, one on each page, each polling its live region every ``--refresh-s``, the
  default [web] refresh), ``--rounds`` pairs in ABBA order; the median of the pairs'
  ratios is printed against the 0.95 target.

    .venv/bin/python bench/web.py [--history 1000000] [--live 100000] [--requests 40]
        [--drain-jobs 20000] [--rounds 4] [--refresh-s 5] [--dsn DSN] [--json out.json]

Not a test: it prints figures, and met/missed against the targets of issue 15.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from pgjobd import admin
from pgjobd.client import Client, JobSpec
from pgjobd.migrate import migrate
from pgjobd.queries import for_schema

SCHEMA = "bench_web"
DEFAULT_DSN = "postgresql://root@127.0.0.1:5432/test"
HERE = Path(__file__).resolve().parent
TOKEN = "bench-token-0123456789abcdef"
PAGE_P95_MS = 200.0
DRAIN_RATIO = 0.95
PAGE_SIZE = 50
DEEP_PAGE = 100


def _p(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def load(conn: asyncpg.Connection, history: int, live: int) -> dict[str, int]:
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await migrate(conn, SCHEMA)
    started = time.monotonic()
    await conn.execute(
        f"""INSERT INTO {SCHEMA}.job_history (id, finished_at, run_at, enqueued_at,
                attempted_at, attempt, max_attempts, priority, state, reason, queue, kind,
                tenant, owner, last_error, args, result, fingerprint)
            SELECT g, now() - (($1 - g) * (72000.0 / $1)) * interval '1 second',
                   now() - interval '21 hours', now() - interval '21 hours', now(),
                   1, 20, 0, s.state::{SCHEMA}.job_state,
                   CASE s.state WHEN 'dead' THEN 'attempts_exhausted'
                                WHEN 'cancelled' THEN 'cancelled' END,
                   'q' || (g % 6), 'kind' || (g % 30), 't' || (g % 200), 'bench-member',
                   CASE WHEN s.state = 'dead'
                        THEN 'ValueError: failure number ' || (g % 40) END,
                   jsonb_build_object('i', g, 'payload', repeat('x', 40)),
                   CASE WHEN s.state = 'completed' THEN '{{"ok": true}}'::jsonb END,
                   CASE WHEN s.state = 'dead' THEN left(md5('error ' || (g % 40)), 16) END
            FROM generate_series(1, $1) AS g,
                 LATERAL (SELECT CASE WHEN g % 100 < 93 THEN 'completed'
                                      WHEN g % 100 < 98 THEN 'dead'
                                      ELSE 'cancelled' END AS state) AS s""",
        history,
    )
    await conn.execute(
        f"""INSERT INTO {SCHEMA}.job_attempt (job_id, failed_at, duration_s, attempt, queue,
                kind, member, outcome, error_class, error_message, traceback, fingerprint)
            SELECT h.id, h.finished_at, 0.01, 1, h.queue, h.kind, 'bench-member', 'failed',
                   'ValueError', 'failure number ' || (h.id % 40),
                   'Traceback (most recent call last):\n  ...\nValueError', h.fingerprint
            FROM {SCHEMA}.job_history AS h WHERE h.state = 'dead'"""
    )
    await conn.execute(
        f"SELECT setval(pg_get_serial_sequence('{SCHEMA}.job', 'id'), $1)", history + 1
    )
    await conn.execute(
        f"""INSERT INTO {SCHEMA}.job (run_at, state, queue, kind, tenant, args, attempt)
            SELECT CASE WHEN g % 10 < 7 THEN now() - interval '1 minute'
                        ELSE now() + interval '1 hour' END,
                   (CASE WHEN g % 10 < 7 THEN 'available' WHEN g % 10 < 9 THEN 'scheduled'
                         ELSE 'retryable' END)::{SCHEMA}.job_state,
                   'backlog' || (g % 3), 'kind' || (g % 30), 't' || (g % 200),
                   jsonb_build_object('i', g), (g % 10 = 9)::int
            FROM generate_series(1, $1) AS g""",
        live,
    )
    await conn.execute(
        f"""INSERT INTO {SCHEMA}.queue_sample (at, queue, available, scheduled, running,
                retryable, completed, dead, cancelled)
            SELECT now() - m * interval '1 minute', 'q' || q, 1000 + m, 10, 50, 5, 800, 40, 16
            FROM generate_series(1, 1440) AS m, generate_series(0, 5) AS q"""
    )
    await conn.execute(
        f"""INSERT INTO {SCHEMA}.cron (name, schedule, timezone, kind, source)
            SELECT 'entry' || g, (g % 60) || ' * * * *', 'Europe/Berlin', 'kind1', 'api'
            FROM generate_series(1, 20) AS g"""
    )
    # What autovacuum does to an insert-only table soon after a load: statistics, the
    # visibility map and the BRIN summaries (unsummarized ranges are always read).
    await conn.execute(f"VACUUM ANALYZE {SCHEMA}.job_history, {SCHEMA}.job, {SCHEMA}.job_attempt")
    newest_dead = await conn.fetchval(
        f"SELECT max(id) FROM {SCHEMA}.job_history WHERE state = 'dead'"
    )
    print(f"loaded {history:,} final records and {live:,} live jobs in "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    return {"dead_job": newest_dead}


class Process:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(args, stdout=out, stderr=out, env=env)

    def events(self, name: str) -> list[dict[str, Any]]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == name:
                found.append(event)
        return found

    async def wait_event(self, name: str, timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.log} exited: {self.log.read_text()[-2000:]}")
            found = self.events(name)
            if found:
                return found[0]
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no {name} in {self.log}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def _server_ms(response: httpx.Response) -> float:
    match = re.search(r"app;dur=([0-9.]+)", response.headers.get("server-timing", ""))
    assert match, f"no Server-Timing on {response.url}"
    return float(match.group(1))


async def pages(client: httpx.AsyncClient, ids: dict[str, int], n: int) -> dict[str, Any]:
    urls = {
        "overview /": "/",
        "jobs /jobs": "/jobs",
        "jobs ?state=dead": "/jobs?state=dead",
        "jobs ?queue=q3": "/jobs?queue=q3",
        "jobs ?kind=kind7": "/jobs?kind=kind7",
        "jobs ?tenant=t42": "/jobs?tenant=t42",
        "job /jobs/ID (dead)": f"/jobs/{ids['dead_job']}",
        "members": "/members",
        "cron": "/cron",
        "dead (groups, 1 h)": "/dead",
        "dead (groups, 24 h)": "/dead?hours=24",
        "live fragment /jobs": "/jobs",  # as htmx polls it
        "live fragment /": "/",
        "api status": "/api/status",
        "api jobs": "/api/jobs",
        "api dead (dlq list)": "/api/dead",
        "api dead groups 24 h": "/api/dead/groups?hours=24",
    }
    results: dict[str, Any] = {}
    for name, url in urls.items():
        headers = {"hx-request": "true"} if "fragment" in name else {}
        for _ in range(3):
            (await client.get(url, headers=headers)).raise_for_status()
        server, wall = [], []
        for _ in range(n):
            started = time.perf_counter()
            response = await client.get(url, headers=headers)
            wall.append((time.perf_counter() - started) * 1000)
            response.raise_for_status()
            server.append(_server_ms(response))
        results[name] = {
            "p50_ms": statistics.median(server), "p95_ms": _p(server, 0.95),
            "wall_p95_ms": _p(wall, 0.95),
        }  # fmt: skip
        print(f"  {name:24} server p50 {results[name]['p50_ms']:7.1f} ms  "
              f"p95 {results[name]['p95_ms']:7.1f} ms  (wall p95 "
              f"{results[name]['wall_p95_ms']:.1f} ms)  "
              f"{'met' if results[name]['p95_ms'] < PAGE_P95_MS else 'MISSED'}")  # fmt: skip
    return results


async def paging(client: httpx.AsyncClient, conn: asyncpg.Connection) -> dict[str, Any]:
    times: list[float] = []
    cursor = None
    for _ in range(DEEP_PAGE):
        url = f"/api/jobs?limit={PAGE_SIZE}" + (f"&cursor={cursor}" if cursor else "")
        response = await client.get(url)
        response.raise_for_status()
        times.append(_server_ms(response))
        last_cursor = cursor
        cursor = response.json()["next_cursor"]
    first, deep = times[:5], times[-5:]
    # The 100th page again, repeatedly, beside the first: the same cost?
    again_first, again_deep = [], []
    for _ in range(20):
        again_first.append(_server_ms(await client.get(f"/jobs?limit={PAGE_SIZE}")))
        again_deep.append(
            _server_ms(await client.get(f"/jobs?limit={PAGE_SIZE}&cursor={last_cursor}"))
        )
    ratio = statistics.median(again_deep) / statistics.median(again_first)
    print(f"  API pages 1-5 median {statistics.median(first):.1f} ms, pages 96-100 median "
          f"{statistics.median(deep):.1f} ms")  # fmt: skip
    print(f"  /jobs page 1 median {statistics.median(again_first):.1f} ms, page 100 median "
          f"{statistics.median(again_deep):.1f} ms: ratio {ratio:.2f} "
          f"({'met' if ratio < 1.5 else 'MISSED'}: equally fast)")  # fmt: skip
    q = for_schema(SCHEMA)
    plans = {}
    for label, before in (("first page", None), ("100th page", last_cursor)):
        rows = await conn.fetch(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + q.sql("admin_jobs_list"),
            None, None, None, PAGE_SIZE + 1, True, True, None, before,
        )  # fmt: skip
        plan = [r[0] for r in rows]
        plans[label] = plan
        top = [line for line in plan if "Merge Append" in line or "Execution Time" in line]
        print(f"  EXPLAIN {label}: {'; '.join(s.strip() for s in top)}")
    return {
        "api_first5_ms": first, "api_deep5_ms": deep, "page1_ms": again_first,
        "page100_ms": again_deep, "ratio": ratio, "plans": plans,
    }  # fmt: skip


async def refresher(client: httpx.AsyncClient, ids: dict[str, int], every_s: float,
                    stop: asyncio.Event, counter: list[int]) -> None:  # fmt: skip
    urls = ["/", "/jobs", f"/jobs/{ids['dead_job']}", "/members", "/cron", "/dead"]

    async def poll(url: str) -> None:
        try:
            await client.get(url, headers={"hx-request": "true"})
        except httpx.TransportError:
            # The server closed the kept-alive connection as the request went out (its
            # idle timeout, 5 s, is the refresh interval): a browser sends it again.
            await client.get(url, headers={"hx-request": "true"})

    while not stop.is_set():
        started = time.monotonic()
        await asyncio.gather(*(poll(u) for u in urls))
        counter[0] += len(urls)
        await asyncio.sleep(max(0.0, every_s - (time.monotonic() - started)))


async def drain_round(conn: asyncpg.Connection, client: Client, n: int) -> float:
    await admin.set_paused(conn, SCHEMA, "drain", True)
    await client.enqueue_many([JobSpec("bench_noop", {"i": i}, queue="drain") for i in range(n)])
    await admin.set_paused(conn, SCHEMA, "drain", False)
    started = time.monotonic()
    while True:  # polling the database, as bench/throughput.py does
        if not await _left(conn):
            break
        await asyncio.sleep(0.05)
    return n / (time.monotonic() - started)


async def _left(conn: asyncpg.Connection) -> int:
    left: int = await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.job WHERE queue = 'drain'")
    return left


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("PGJOBD_DSN", DEFAULT_DSN))
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--live", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--drain-jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--refresh-s", type=float, default=5.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    conn = await asyncpg.connect(args.dsn)
    ids = await load(conn, args.history, args.live)
    work = Path(tempfile.mkdtemp(prefix="bench_web_"))
    (work / "token").write_text(TOKEN)
    config = work / "pgjobd.toml"
    config.write_text(
        f'[database]\nschema = "{SCHEMA}"\n'
        f'[daemon]\nhandlers = ["{HERE / "handlers"}"]\nlog_format = "json"\n'
        'metrics_listen = ""\n'
        f'[web]\nadmin_token_file = "{work / "token"}"\n'
        "[queues.drain]\nconcurrency = 50\nprocesses = 2\n"
    )
    env = {**os.environ, "PGJOBD_DSN": args.dsn}
    web = Process([sys.executable, "-m", "pgjobd", "web", "--config", str(config),
                   "--listen", "127.0.0.1:0"], env, work / "web.log")  # fmt: skip
    member = None
    pool = await asyncpg.create_pool(args.dsn, min_size=1, max_size=2)
    results: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}}
    finished = False
    try:
        port = (await web.wait_event("web.listening"))["port"]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            while True:
                try:
                    (await http.get("/api/status")).raise_for_status()
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            # The member (the fleet's leader: its queue_stats role publishes the live
            # counts the overview shows) runs from here on, as it would beside a console.
            member = Process([sys.executable, "-m", "pgjobd", "run", "--config", str(config)],
                             env, work / "member.log")  # fmt: skip
            await member.wait_event("member.ready", timeout_s=120)
            for _ in range(300):  # its first count: within a tick of its election
                if await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.queue_count"):
                    break
                await asyncio.sleep(0.2)
            print(f"pages ({args.requests} requests each, server time; a leader running):")
            results["pages"] = await pages(http, ids, args.requests)
            print("keyset paging:")
            results["paging"] = await paging(http, conn)

            client = Client(pool, schema=SCHEMA)
            await drain_round(conn, client, min(2_000, args.drain_jobs))  # warm-up
            quiet, watched, fetched = [], [], [0]
            print(f"drain ({args.drain_jobs:,} no-op jobs a round, 1 member, 2 processes x 50):")
            ratios = []
            for index in range(args.rounds):
                # ABBA order: a load that rises or falls over the run (other work on
                # the machine) weighs on both sides alike.
                for watch in (False, True) if index % 2 == 0 else (True, False):
                    stop = asyncio.Event()
                    task = None
                    if watch:
                        task = asyncio.create_task(
                            refresher(http, ids, args.refresh_s, stop, fetched)
                        )
                    rate = await drain_round(conn, client, args.drain_jobs)
                    stop.set()
                    if task is not None:
                        await task
                    (watched if watch else quiet).append(rate)
                ratios.append(watched[-1] / quiet[-1])
                print(f"  without console {quiet[-1]:8.0f} jobs/s   with console refreshing "
                      f"{watched[-1]:8.0f} jobs/s   ratio {ratios[-1]:.3f}")  # fmt: skip
            ratio = statistics.median(ratios)
            print(f"  median ratio {ratio:.3f} ({'met' if ratio >= DRAIN_RATIO else 'MISSED'}: "
                  f">= {DRAIN_RATIO}); {fetched[0]} page fetches while refreshing")  # fmt: skip
            results["drain"] = {"without": quiet, "with": watched, "ratios": ratios,
                                "ratio": ratio,
                                "fetches": fetched[0]}  # fmt: skip
        finished = True
    finally:
        if member is not None:
            member.stop()
        web.stop()
        await pool.close()
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await conn.close()
        if finished:
            shutil.rmtree(work)
        else:
            print(f"the console's and the member's logs are kept in {work}", file=sys.stderr)
    load1 = os.getloadavg()[0]
    print(f"1-minute load average at the end: {load1:.1f} (on {os.cpu_count()} cores)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    asyncio.run(main())
