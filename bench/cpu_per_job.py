"""CPU-seconds per 1,000 jobs of a drain, by process role, this tree against a baseline
commit, in one run (issue 17, target 3).

Each drain: N no-op jobs enqueued (untimed), one real `pgjobd run` member (processes,
concurrency from --round) drains them; CPU is read from /proc (user + system ticks)
from the member row appearing until the hot table is empty, for the supervisor, its
worker processes and the member's PostgreSQL backends. CPU time, unlike wall time,
moves little when other work shares the machine.

The baseline's code is exported with `git archive` into a temporary directory; every
drain runs as a child process of this script (`--drain`) with PYTHONPATH set to the
tree it measures, so the member, its migrations and its client are that tree's own. Each
tree drains in its own schema of a database of the bench's own (`pgjobd_bench_cpu`,
created on the --dsn's server if missing), so sessions of other work on the server are
never counted as the member's. Drains alternate ABBA per rep.

    .venv/bin/python bench/cpu_per_job.py [--baseline d1c1ca0] [--reps 3] [--n 20000] [--floor]
        [--round 1:100:all] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from procstat import TICK_S, children_of, cpu_snapshot

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HANDLERS = HERE / "handlers"
DEFAULT_DSN = "postgresql://root@127.0.0.1:5432/test"
DATABASE = "pgjobd_bench_cpu"
ROLES = ("supervisor", "workers", "pg member")


async def member_backends(admin: Any) -> list[int]:
    rows = await admin.fetch(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'pgjobd%' "
        "AND datname = current_database()"
    )
    return [row["pid"] for row in rows]


async def one_drain(dsn: str, schema: str, n: int, rnd: str, floor: bool) -> dict[str, float]:
    """Runs in the child, with the measured tree's pgjobd on sys.path. floor: the drain
    is bench/floor_chain.py's (this tree's statements), not a member's."""
    import asyncpg  # noqa: PLC0415 (the measured tree's, not this one's)

    from pgjobd.client import Client  # noqa: PLC0415
    from pgjobd.migrate import migrate  # noqa: PLC0415

    processes, concurrency, history = rnd.split(":")

    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    await migrate(admin, schema)
    client = await Client.connect(dsn, schema=schema, max_size=2)
    for start in range(0, n, 10_000):
        await client.enqueue_many(
            [("bench_noop", {"i": i}) for i in range(start, min(n, start + 10_000))]
        )
    await client.close()
    await admin.execute(f"ANALYZE {schema}.job")
    with tempfile.TemporaryDirectory(prefix="pgjobd_cpu_") as rundir:
        config = Path(rundir) / "pgjobd.toml"
        config.write_text(
            f'[database]\nschema = "{schema}"\n\n'
            f"[daemon]\nhandlers = [{json.dumps(str(HANDLERS))}]\n"
            'metrics_listen = ""\nlog_format = "text"\nlog_level = "warning"\n'
            'drain_timeout = "10s"\n\n'
            f"[queues.default]\nconcurrency = {concurrency}\n"
            f'processes = {processes}\nhistory = "{history}"\n'
        )
        env = os.environ | {"PGJOBD_DSN": dsn, "PGJOBD_BENCH_DIR": rundir}
        command = [sys.executable, "-m", "pgjobd", "run", "--config", str(config)]
        if floor:
            command = [sys.executable, str(HERE / "floor_chain.py"), "--dsn", dsn,
                       "--schema", schema, "--processes", processes,
                       "--concurrency", concurrency, "--history", history]  # fmt: skip

        async def ready() -> bool:  # the floor says so with a file; a member joins
            if floor:
                return (Path(rundir) / "ready").exists()
            return bool(await admin.fetchval(f"SELECT count(*) FROM {schema}.member"))

        with (Path(rundir) / "member.log").open("w") as out:
            member = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)  # noqa: ASYNC220
        try:
            while not await ready():
                if member.poll() is not None:
                    raise RuntimeError((Path(rundir) / "member.log").read_text()[-3000:])
                await asyncio.sleep(0.01)
            backends = await member_backends(admin)
            before = cpu_snapshot([member.pid, *children_of(member.pid), *backends])
            left = f"SELECT count(*) FROM (SELECT 1 FROM {schema}.job LIMIT 1) s"
            while await admin.fetchval(left):  # noqa: ASYNC110 (polling the database)
                await asyncio.sleep(0.05)
            backends = await member_backends(admin)  # sessions opened since count whole
            pids = {"supervisor": [member.pid], "workers": children_of(member.pid),
                    "pg member": backends}  # fmt: skip
            after = cpu_snapshot([p for group in pids.values() for p in group])
        finally:
            member.terminate()
            member.wait(30)
        done = await admin.fetchval(f"SELECT count(*) FROM {schema}.job_history")
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()
    if history == "all" and done != n:
        raise RuntimeError(f"{done} of {n} jobs have a final record")
    per_1000 = {
        role: sum(after.by_pid[p] - before.by_pid.get(p, 0) for p in group if p in after.by_pid)
        * TICK_S * 1000 / n
        for role, group in pids.items()
    }  # fmt: skip
    per_1000["jobs/s"] = n / (after.at - before.at)
    return per_1000


def bench_database(dsn: str) -> str:
    """The DSN of the bench's own database on the server of `dsn`, created if missing."""
    import asyncpg  # noqa: PLC0415 (the parent never imports pgjobd or its stack eagerly)

    async def ensure() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE):
                await conn.execute(f"CREATE DATABASE {DATABASE}")
        finally:
            await conn.close()

    asyncio.run(ensure())
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{DATABASE}"))


def run_child(tree: Path, tag: str, args: argparse.Namespace) -> dict[str, float]:
    env = os.environ | {"PYTHONPATH": str(tree)}
    floor = ["--floor"] if tag == "floor" else []
    out = subprocess.run(
        [sys.executable, __file__, "--drain", "--schema", f"bench_cpu_{tag}", "--n", str(args.n),
         "--round", args.round, "--dsn", args.dsn, *floor],
        env=env, check=True, capture_output=True, text=True, cwd=tree,
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="d1c1ca0", help="commit to compare with")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--round", default="1:100:all", help="processes:concurrency:history")
    parser.add_argument("--dsn", default=os.environ.get("PGJOBD_DSN", DEFAULT_DSN))
    parser.add_argument("--floor", action="store_true",
                        help="also drain with bench/floor_chain.py: the least a member "
                        "laid out as design/architecture.md says can spend")  # fmt: skip
    parser.add_argument("--drain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schema", default="bench_cpu", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drain:
        result = asyncio.run(one_drain(args.dsn, args.schema, args.n, args.round, args.floor))
        print(json.dumps(result))
        return
    args.dsn = bench_database(args.dsn)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain", "pgjobd"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    print(f"this tree: {head}{' (dirty)' if dirty else ''}; baseline {args.baseline}; "
          f"round {args.round}; {args.n:,} jobs per drain", flush=True)  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {"baseline": [], "this": [], "floor": []}
    with tempfile.TemporaryDirectory(prefix="pgjobd_baseline_") as base:
        archive = subprocess.run(["git", "archive", args.baseline], cwd=REPO, check=True,
                                 capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", base], input=archive, check=True)
        trees = {"baseline": Path(base), "this": REPO, "floor": REPO}
        for rep in range(args.reps):
            order = ("baseline", "this") if rep % 2 == 0 else ("this", "baseline")
            if args.floor:
                order = (*order, "floor") if rep % 2 == 0 else ("floor", *order)
            for name in order:
                started = time.time()
                result = run_child(trees[name], name, args)
                results[name].append(result)
                total = sum(result[r] for r in ROLES)
                print(f"rep {rep + 1} {name:<8} {total:6.3f} CPU-s per 1,000 jobs "
                      f"({', '.join(f'{r} {result[r]:.3f}' for r in ROLES)}); "
                      f"{result['jobs/s']:,.0f} jobs/s; {time.time() - started:.0f} s",
                      flush=True)  # fmt: skip

    def median(name: str, role: str) -> float:
        """The median CPU-s per 1,000 jobs of one role ("total": all) over the reps."""
        return statistics.median(
            sum(r[x] for x in ROLES) if role == "total" else r[role] for r in results[name]
        )

    print(f"\nCPU-seconds per 1,000 jobs, median of {args.reps} (this / baseline):")
    for role in (*ROLES, "total"):
        base_m, this_m = median("baseline", role), median("this", role)
        ratio = f"{this_m / base_m:5.2f}" if base_m else "  n/a"  # no tick: a short drain
        print(f"  {role:<11} baseline {base_m:6.3f}  this {this_m:6.3f}  ratio {ratio}")
    ratios = [sum(t[x] for x in ROLES) / sum(b[x] for x in ROLES)
              for t, b in zip(results["this"], results["baseline"], strict=True)]  # fmt: skip
    print(f"  total ratio per rep: {', '.join(f'{r:.2f}' for r in ratios)} (target <= 0.6)")
    rates = [
        t["jobs/s"] / b["jobs/s"] for t, b in zip(results["this"], results["baseline"], strict=True)
    ]
    print(
        f"jobs/s (wall time: the machine's load moves it) this / baseline per rep: "
        f"{', '.join(f'{r:.2f}' for r in rates)}; median {statistics.median(rates):.2f}"
    )

    if args.floor:
        print(f"\nthe architecture's floor (bench/floor_chain.py), median of {args.reps}:")
        for role in (*ROLES, "total"):
            floor_m = median("floor", role)
            this_m, base_m = median("this", role) or math.nan, median("baseline", role) or math.nan
            print(f"  {role:<11} floor {floor_m:6.3f}  this / floor "
                  f"{this_m / floor_m if floor_m else math.nan:5.2f}  "
                  f"floor / baseline {floor_m / base_m:5.2f}")  # fmt: skip
        floor_rates = [f["jobs/s"] / t["jobs/s"]
                       for f, t in zip(results["floor"], results["this"], strict=True)]  # fmt: skip
        print(f"  jobs/s floor / this per rep: {', '.join(f'{r:.2f}' for r in floor_rates)}; "
              f"median {statistics.median(floor_rates):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
