"""Fan-in: N children into one callback (depends_on), beside the same N jobs alone.

Creates schema ``bench_fanin`` (migrated fresh) and drops it at the end. One real
``pgjobd run`` member (2 processes, concurrency 20, history "all") serves queue
``default`` throughout. Each repetition runs two rounds, alternating which goes first:

- ``alone``: N ``bench_noop`` jobs, enqueued while the queue is paused, then resumed.
- ``fan_in``: the same N jobs and one ``bench_fanin_callback`` job that depends on all
  of them, enqueued alike.

Measured on the database clock from job_history: the children's drain rate, N /
(last child's finished_at - first child's attempted_at); and for the callback, from the
last child's finished_at (its completing transaction's start) to the callback's claim
(attempted_at) and to its handler's start (a wall-clock time the handler writes; same
host). Targets (issue 13): callback start < 100 ms after the last child; drain with a
callback >= 0.8x alone.

    /work/venv/bin/python bench/fanin.py [--n 10000] [--reps 3] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

from pgjobd import admin
from pgjobd.client import Client
from pgjobd.migrate import migrate

SCHEMA = "bench_fanin"
HANDLERS = Path(__file__).parent / "handlers"
CONFIG = """
[database]
schema = "{schema}"

[daemon]
handlers = ["{handlers}"]
metrics_listen = ""
log_format = "json"
drain_timeout = "10s"

[queues.default]
concurrency = 20
processes = 2
history = "all"
"""


async def empty_tables(conn: asyncpg.Connection) -> None:
    """TRUNCATE the job tables under the running member. TRUNCATE locks its tables one
    at a time, and a statement of the member that reads two of them in the other order
    can hold one while waiting for the next: PostgreSQL then ends one side as a
    deadlock (two smoke runs in five here). Then this side tries again."""
    for attempt in range(10):
        try:
            await conn.execute(f"TRUNCATE {SCHEMA}.job, {SCHEMA}.job_history, "
                               f"{SCHEMA}.job_attempt, {SCHEMA}.job_dependency")  # fmt: skip
            return
        except asyncpg.DeadlockDetectedError:
            if attempt == 9:
                raise
            await asyncio.sleep(0.05 * (attempt + 1))


async def run_round(conn: asyncpg.Connection, client: Client, pool: asyncpg.Pool, n: int,
                    *, with_callback: bool, rundir: Path) -> dict[str, float]:  # fmt: skip
    await empty_tables(conn)
    await admin.set_paused(pool, SCHEMA, "default", True)
    children: list[int] = []
    for start in range(0, n, 10_000):
        children += await client.enqueue_many(
            [("bench_noop", {"i": i}) for i in range(start, min(n, start + 10_000))]
        )
    callback = None
    if with_callback:
        callback = await client.enqueue("bench_fanin_callback", depends_on=children)
    await conn.execute(f"ANALYZE {SCHEMA}.job")
    await admin.set_paused(pool, SCHEMA, "default", False)
    total = n + (1 if with_callback else 0)
    deadline = time.time() + 600
    while await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.job_history") < total:
        if time.time() > deadline:
            raise TimeoutError("the round did not drain in 600 s")
        await asyncio.sleep(0.1)
    row = await conn.fetchrow(
        f"SELECT extract(epoch FROM max(finished_at) - min(attempted_at)) AS drain_s, "
        f"extract(epoch FROM max(finished_at)) AS last_end FROM {SCHEMA}.job_history "
        f"WHERE kind = 'bench_noop'"
    )  # fmt: skip
    result = {"rate": n / float(row["drain_s"])}
    if callback is not None:
        claimed = await conn.fetchval(
            f"SELECT extract(epoch FROM attempted_at) FROM {SCHEMA}.job_history WHERE id = $1",
            callback,
        )
        started = float((rundir / f"callback.{callback}").read_text())
        result["to_claim_ms"] = (float(claimed) - float(row["last_end"])) * 1000
        result["to_start_ms"] = (started - float(row["last_end"])) * 1000
    return result


async def main(args: argparse.Namespace) -> None:
    conn = await asyncpg.connect(args.dsn)
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await migrate(conn, SCHEMA)
    pool = await asyncpg.create_pool(args.dsn, min_size=1, max_size=4)
    client = Client(pool, schema=SCHEMA)
    with tempfile.TemporaryDirectory(prefix="pgjobd_fanin_") as tmp:
        rundir = Path(tmp)
        config = rundir / "pgjobd.toml"
        config.write_text(CONFIG.format(schema=SCHEMA, handlers=HANDLERS))
        log = (rundir / "member.log").open("wb")
        member = subprocess.Popen(  # noqa: ASYNC220 (started once, before any timing)
            [sys.executable, "-m", "pgjobd", "run", "--config", str(config)],
            stdout=log, stderr=log,
            env={**os.environ, "PGJOBD_DSN": args.dsn, "PGJOBD_BENCH_DIR": str(rundir)},
        )  # fmt: skip
        try:
            while not await conn.fetchval(  # noqa: ASYNC110 (a poll of the database)
                f"SELECT count(*) FROM {SCHEMA}.member"
            ):
                await asyncio.sleep(0.1)
            results: dict[str, list[dict[str, float]]] = {"alone": [], "fan_in": []}
            for rep in range(args.reps):
                order = [False, True] if rep % 2 == 0 else [True, False]
                for with_callback in order:
                    r = await run_round(conn, client, pool, args.n, with_callback=with_callback,
                                        rundir=rundir)  # fmt: skip
                    name = "fan_in" if with_callback else "alone"
                    results[name].append(r)
                    shown = ", ".join(f"{k} {v:,.1f}" for k, v in r.items())
                    print(f"rep {rep + 1} {name}: {shown}", flush=True)
        finally:
            member.send_signal(signal.SIGTERM)
            member.wait(60)
            log.close()
    ratios = [f["rate"] / a["rate"] for f, a in zip(results["fan_in"], results["alone"],
                                                      strict=True)]  # fmt: skip
    to_start = [r["to_start_ms"] for r in results["fan_in"]]
    to_claim = [r["to_claim_ms"] for r in results["fan_in"]]
    print(f"\nn = {args.n:,}, {args.reps} reps")
    print(f"drain alone:   {statistics.median(r['rate'] for r in results['alone']):,.0f} jobs/s")
    print(f"drain fan-in:  {statistics.median(r['rate'] for r in results['fan_in']):,.0f} jobs/s")
    print(f"ratio fan-in/alone: median {statistics.median(ratios):.2f} "
          f"(each rep: {', '.join(f'{x:.2f}' for x in ratios)}); target >= 0.80")  # fmt: skip
    print(f"last child -> callback claimed: median {statistics.median(to_claim):.1f} ms, "
          f"max {max(to_claim):.1f} ms")  # fmt: skip
    print(f"last child -> callback started: median {statistics.median(to_start):.1f} ms, "
          f"max {max(to_start):.1f} ms; target < 100 ms")  # fmt: skip
    await pool.close()
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await conn.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dsn", default=os.environ.get(
        "PGJOBD_DSN", "postgresql://root@127.0.0.1:5432/test"))  # fmt: skip
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
