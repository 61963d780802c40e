"""Enqueue throughput of pgjobd beside raw-PostgreSQL baselines, in one run, one database.

Creates schema ``bench_enqueue`` (migrated fresh), two copies of its hot table (``job_bare``:
columns, defaults and identity only; ``job_indexed``: ``INCLUDING ALL`` plus the hot table's
storage options) and a plain table with only a primary key (``job_pk``), and schema
``bench_enqueue_lean``: migrated, less the hot table's trigger and name CHECKs. Runs every
measurement once per repetition, interleaved (each on freshly truncated tables; the order
reversed every other repetition), and drops the schemas at the end. The client's earlier
COPY paths (bench/enqueue_paths.py) run beside today's for an A/B. Not a test.

    /work/venv/bin/python bench/enqueue.py --reps 5 [--dsn DSN] [--json out.json] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import hashlib
import json
import os
import pstats
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec
from enqueue_paths import OldCopyClient, StagedCopyClient

from pgjobd import client as client_module
from pgjobd.client import Client, JobSpec, skip_session_reset
from pgjobd.migrate import available, migrate

SCHEMA = "bench_enqueue"
# The same schema less the hot table's guards on what a producer's own INSERTs write (its
# BEFORE INSERT trigger, which turns off COPY's multi-row inserts, and the name CHECKs):
# what enqueue_many could reach without them.
LEAN = "bench_enqueue_lean"
LEAN_GUARDS = f"""
    DROP TRIGGER job_tenant_guard ON {LEAN}.job;
    ALTER TABLE {LEAN}.job DROP CONSTRAINT job_kind_name_valid,
                           DROP CONSTRAINT job_queue_name_valid"""
DEFAULT_DSN = "postgresql://root@127.0.0.1:5432/test"
TABLES = ("job", "job_bare", "job_indexed", "job_pk")
RAW_COLUMNS = ("state", "queue", "kind", "priority", "run_at", "args", "max_attempts")
RAW_UNNEST = f"""
INSERT INTO {SCHEMA}.{{table}} (state, queue, kind, priority, run_at, args, max_attempts,
                                unique_key)
SELECT 'available', u.q, u.k, u.p, u.r, u.a::jsonb, u.m, u.uk
FROM unnest($1::text[], $2::text[], $3::smallint[], $4::timestamptz[], $5::text[], $6::int[],
            $7::text[]) AS u(q, k, p, r, a, m, uk)"""
RAW_ONE = (f"INSERT INTO {SCHEMA}.job_indexed ({', '.join(RAW_COLUMNS)}) "
           "VALUES ('available', 'default', 'noop', 0, now(), $1::jsonb, 20)")  # fmt: skip
SQL_EACH = (f"SELECT count({SCHEMA}.enqueue('noop', jsonb_build_object('i', g))) "
            "FROM generate_series(1, $1::int) AS g")  # fmt: skip
# (pgjobd measurement, its raw baseline, minimum ratio to print as a target or None)
RATIOS: list[tuple[str, str, float | None]] = [
    ("enqueue_1tx", "raw_insert_1tx", None),
    ("many_copy", "many_copy_old", 1.0),  # issue 11: won back, one home for defaults kept
    ("many_copy", "raw_copy_pk", 0.5),  # issue 17, item 8
    ("many_copy_lean", "raw_copy_pk", None),
    ("raw_copy_lean", "raw_copy_pk", None),
    ("many_copy", "raw_copy_job", None),
    ("many_copy", "raw_copy_indexed", None),
    ("many_copy", "raw_copy_bare", None),
    ("many_copy_staged", "many_copy_old", None),
    ("small_copy", "small_copy_old", 1.0),
    ("raw_copy_job", "raw_copy_pk", None),
    ("many_function", "raw_insert_bare", None),
    ("many_function", "raw_insert_indexed", None),
    ("sql_each", "raw_insert_bare", None),
]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SEED_JOBS_S = 10_000
MANY_JOBS_S = 100_000


class CountingConnection(asyncpg.Connection):  # type: ignore[misc]  # asyncpg is untyped
    """Records the client statements (round trips once prepared) it sends, and the time
    each took until its answer (the rest of a call's time is the client's own work)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[tuple[str, float]] = []

    async def _timed(self, query: str, call: Awaitable[Any]) -> Any:
        code = [line for line in query.splitlines() if not line.lstrip().startswith("--")]
        t0 = time.perf_counter()
        try:
            return await call
        finally:
            self.sent.append((" ".join(" ".join(code).split())[:48], time.perf_counter() - t0))

    async def execute(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._timed(query, super().execute(query, *args, **kw))

    async def fetch(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._timed(query, super().fetch(query, *args, **kw))

    async def fetchval(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._timed(query, super().fetchval(query, *args, **kw))

    async def fetchrow(self, query: str, *args: Any, **kw: Any) -> Any:
        return await self._timed(query, super().fetchrow(query, *args, **kw))

    async def copy_records_to_table(self, table_name: str, **kw: Any) -> Any:
        call = super().copy_records_to_table(table_name, **kw)
        return await self._timed(f"COPY {table_name}", call)


@dataclass
class Measure:
    key: str
    label: str
    table: str  # where the rows land: checked to hold `jobs` rows afterwards
    jobs: int
    run: Callable[[], Awaitable[object]] = field(repr=False)
    pgjobd: bool = False
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU in the run
    # This process's and its server backends' CPU in the run (from /proc): what the run
    # cost, which other load on the machine changes less than it changes wall time.
    total_cpu: list[float] = field(default_factory=list)
    wal_bytes: list[int] = field(default_factory=list)
    statements: list[str] = field(default_factory=list)
    # Per repetition: the seconds spent waiting for each kind of statement.
    waits: list[dict[str, float]] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [self.jobs / s for s in self.seconds]


def build(
    clients: dict[str, Client], raw: CountingConnection, n: int, single_n: int
) -> list[Measure]:
    """The measurements in run order, each with its input prepared (untimed)."""
    client = clients["today"]
    now = datetime.now(UTC)
    payloads = [json.dumps({"i": i}) for i in range(1, n + 1)]
    tuples = [("noop", {"i": i}) for i in range(1, n + 1)]
    specs = [JobSpec("noop", {"i": i}, unique_key=f"k{i}") for i in range(1, n + 1)]
    records = [("available", "default", "noop", 0, now, p, 20) for p in payloads]
    arrays = (["default"] * n, ["noop"] * n, [0] * n, [now] * n, payloads, [20] * n,
              [f"k{i}" for i in range(1, n + 1)])  # fmt: skip

    async def enqueue_each() -> None:
        for i in range(1, single_n + 1):
            await client.enqueue("noop", {"i": i})

    async def enqueue_each_one_txn() -> None:
        async with client.pool.acquire() as conn, conn.transaction():
            for i in range(1, single_n + 1):
                await client.enqueue("noop", {"i": i}, conn=conn)

    async def raw_each() -> None:
        for p in payloads[:single_n]:
            await raw.execute(RAW_ONE, p)

    def copy(table: str, schema: str = SCHEMA) -> Callable[[], Awaitable[object]]:
        return lambda: raw.copy_records_to_table(
            table, schema_name=schema, columns=RAW_COLUMNS, records=records
        )

    def insert(table: str) -> Callable[[], Awaitable[object]]:
        return lambda: raw.execute(RAW_UNNEST.format(table=table), *arrays)

    encoder = msgspec.json.Encoder()

    async def small_batches(client: Client) -> None:
        for start in range(0, single_n, 10):
            await client.enqueue_many(tuples[start : start + 10])

    async def copy_serialising() -> None:
        # The baseline: each row's args serialised inside the timing.
        start = datetime.now(UTC)
        rows = [("available", "default", "noop", 0, start, encoder.encode(args).decode(), 20)
                for _, args in tuples]  # fmt: skip
        await raw.copy_records_to_table(
            "job_pk", schema_name=SCHEMA, columns=RAW_COLUMNS, records=rows
        )

    return [
        Measure("enqueue_1tx", "pgjobd enqueue, 1 job/txn", "job", single_n, enqueue_each,
                pgjobd=True),
        Measure("raw_insert_1tx", "raw INSERT 1 row/txn, indexed copy", "job_indexed",
                single_n, raw_each),
        Measure("enqueue_loop", "pgjobd enqueue ×N in 1 txn (conn=)", "job", single_n,
                enqueue_each_one_txn, pgjobd=True),
        Measure("many_copy", "pgjobd enqueue_many, COPY path", "job", n,
                lambda: client.enqueue_many(tuples), pgjobd=True),
        Measure("many_copy_lean", "… into the hot table less its guards", f"{LEAN}.job", n,
                lambda: clients["lean"].enqueue_many(tuples), pgjobd=True),
        Measure("many_copy_old", "… its path before issue 11", "job", n,
                lambda: clients["old"].enqueue_many(tuples), pgjobd=True),
        Measure("many_copy_staged", "… its staged path (issue 11)", "job", n,
                lambda: clients["staged"].enqueue_many(tuples), pgjobd=True),
        Measure("small_copy", f"pgjobd enqueue_many ×{single_n // 10}, 10 jobs each", "job",
                single_n, lambda: small_batches(clients["today"]), pgjobd=True),
        Measure("small_copy_old", "… its path before issue 11", "job", single_n,
                lambda: small_batches(clients["old"]), pgjobd=True),
        Measure("raw_copy_pk", "raw COPY, only a PK, args encoded in time", "job_pk", n,
                copy_serialising),
        Measure("raw_copy_job", "raw COPY into the hot table itself", "job", n, copy("job")),
        Measure("raw_copy_lean", "raw COPY, the hot table less its guards", f"{LEAN}.job", n,
                copy("job", LEAN)),
        Measure("raw_copy_bare", "raw COPY, unindexed copy", "job_bare", n, copy("job_bare")),
        Measure("raw_copy_indexed", "raw COPY, indexed copy", "job_indexed", n,
                copy("job_indexed")),
        Measure("many_function", "pgjobd enqueue_many, unique keys (SQL fn)", "job", n,
                lambda: client.enqueue_many(specs), pgjobd=True),
        Measure("raw_insert_bare", "raw INSERT…unnest, unindexed copy", "job_bare", n,
                insert("job_bare")),
        Measure("raw_insert_indexed", "raw INSERT…unnest, indexed copy", "job_indexed", n,
                insert("job_indexed")),
        Measure("sql_each", f"SQL {SCHEMA}.enqueue() ×N, 1 statement", "job", n,
                lambda: raw.fetchval(SQL_EACH, n), pgjobd=True),
    ]  # fmt: skip


def backend_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) the server processes `pids` have used so far."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / CLOCK_TICKS


async def timed(admin: asyncpg.Connection, conns: list[CountingConnection], m: Measure) -> None:
    tables = ", ".join([*(f"{SCHEMA}.{t}" for t in TABLES), f"{LEAN}.job"])
    await admin.execute(f"TRUNCATE {tables}")
    for conn in conns:
        conn.sent.clear()
    lsn = await admin.fetchval("SELECT pg_current_wal_insert_lsn()")
    pids = [conn.get_server_pid() for conn in conns]
    server0 = backend_cpu(pids)
    t0, cpu0 = time.perf_counter(), time.process_time()
    await m.run()
    m.seconds.append(time.perf_counter() - t0)
    m.cpu_seconds.append(time.process_time() - cpu0)
    m.total_cpu.append(m.cpu_seconds[-1] + backend_cpu(pids) - server0)
    wal = await admin.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1)", lsn)
    m.wal_bytes.append(int(wal))
    m.statements = [q for conn in conns for q, _ in conn.sent]
    waits: dict[str, float] = {}
    for conn in conns:
        for q, seconds in conn.sent:
            waits[q] = waits.get(q, 0.0) + seconds
    m.waits.append(waits)
    table = m.table if "." in m.table else f"{SCHEMA}.{m.table}"
    count = await admin.fetchval(f"SELECT count(*) FROM {table}")
    if count != m.jobs:
        raise RuntimeError(f"{m.key}: expected {m.jobs} rows in {m.table}, found {count}")


def spread(values: list[float], fmt: str = ",.0f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def report(measures: list[Measure], noise: list[tuple[int, float]]) -> dict[str, Any]:
    by_key = {m.key: m for m in measures}
    ratios: dict[str, list[float]] = {}
    pairs = [(k, b, t) for k, b, t in RATIOS if k in by_key and b in by_key]
    cpu_ratios: dict[str, list[float]] = {}
    for mine, base, _ in pairs:  # paired per repetition, so shared noise cancels
        ratios[f"{mine}/{base}"] = [
            b / a for a, b in zip(by_key[mine].seconds, by_key[base].seconds, strict=True)
        ]
        cpu_ratios[f"{mine}/{base}"] = [
            b / a for a, b in zip(by_key[mine].total_cpu, by_key[base].total_cpu, strict=True)
        ]
    head = (f"{'measurement':<42} {'N':>6} {'jobs/s median (min–max)':>27} {'WAL B/job':>9} "
            f"{'stmts':>5} {'py CPU':>6}  ")  # fmt: skip
    print(f"\n{head}ratio to raw baseline (paired per rep), median (min–max)")
    for m in measures:
        lines = [f"{spread(ratios[f'{m.key}/{b}'], '.2f')} of {by_key[b].label}"
                 + (f" [target ≥ {t}: {met(ratios[f'{m.key}/{b}'], t)}]" if t else "")
                 + f"; by CPU {spread(cpu_ratios[f'{m.key}/{b}'], '.2f')}"
                 for k, b, t in pairs if k == m.key]  # fmt: skip
        wal = statistics.median(m.wal_bytes) / m.jobs
        cpu = statistics.median(c / w for c, w in zip(m.cpu_seconds, m.seconds, strict=True))
        print(
            f"{m.label:<42} {m.jobs:>6} {spread(m.rates):>27} {wal:>9.0f} "
            f"{len(m.statements):>5} {cpu:>6.0%}  " + (lines[0] if lines else "")
        )
        for line in lines[1:]:
            print(" " * len(head) + line)
    if "many_copy" in by_key:
        copy_rate = by_key["many_copy"].rates
        print(
            f"\ntargets: enqueue_many (COPY path) ≥ {MANY_JOBS_S:,} jobs/s: "
            f"{met(copy_rate, MANY_JOBS_S)} (median {statistics.median(copy_rate):,.0f}); "
            f"seed {SEED_JOBS_S:,} enqueues/s: "
            + "; ".join(f"{m.key} {met(m.rates, SEED_JOBS_S)}" for m in measures if m.pgjobd)
        )
    shown = ("enqueue_1tx", "many_copy", "many_copy_old", "many_copy_staged", "many_function")
    for key in (k for k in shown if k in by_key):
        print(
            f"statements, {key}: {len(by_key[key].statements)} per run; distinct: "
            + " | ".join(dict.fromkeys(by_key[key].statements))
        )
    print("\nwhere the time goes, ms, median of the reps (a statement: until its answer; "
          "the client: the rest of the call)")  # fmt: skip
    spent_in = ("many_copy", "many_copy_lean", "many_copy_old", "many_copy_staged", "raw_copy_pk",
                "raw_copy_job", "raw_copy_lean")  # fmt: skip
    for key in (k for k in spent_in if k in by_key):
        m = by_key[key]
        spent = {q: statistics.median(w.get(q, 0.0) for w in m.waits) * 1000
                 for q in dict.fromkeys(q for w in m.waits for q in w)}  # fmt: skip
        client = statistics.median(
            s - sum(w.values()) for s, w in zip(m.seconds, m.waits, strict=True)
        )
        waited = "; ".join(f"{q} {ms:.1f}" for q, ms in spent.items())
        print(f"  {key}: total {statistics.median(m.seconds) * 1000:.0f}, the client "
              f"{client * 1000:.0f}; {waited}")  # fmt: skip
    print(
        f"noise: other active client backends per rep {[a for a, _ in noise]}, "
        f"1-min load average per rep {[round(load, 2) for _, load in noise]}"
    )
    print("(by CPU: the same ratio of this process's and its server backends' CPU seconds)")
    return {"ratios": ratios, "cpu_ratios": cpu_ratios}


def met(values: list[float], target: float) -> str:
    return "met" if statistics.median(values) >= target else "missed"


async def profile_copy(client: Client, n: int) -> None:
    """One enqueue_many COPY-path call under cProfile: where the Python side spends time."""
    tuples = [("noop", {"i": i}) for i in range(1, n + 1)]
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    await client.enqueue_many(tuples)
    profiler.disable()
    print(f"\ncProfile of one enqueue_many({n:,}) COPY-path call, wall "
          f"{time.perf_counter() - t0:.3f} s (profiled, so slower):")  # fmt: skip
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    admin = await asyncpg.connect(args.dsn)
    drop = f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; DROP SCHEMA IF EXISTS {LEAN} CASCADE"
    await admin.execute(drop)
    try:
        await migrate(admin, SCHEMA)
        await migrate(admin, LEAN)
        await admin.execute(LEAN_GUARDS)
        options = await admin.fetchval(f"SELECT reloptions FROM pg_class "
                                       f"WHERE oid = '{SCHEMA}.job'::regclass")  # fmt: skip
        await admin.execute(f"""
            CREATE TABLE {SCHEMA}.job_bare (LIKE {SCHEMA}.job INCLUDING DEFAULTS
                                            INCLUDING IDENTITY);
            CREATE TABLE {SCHEMA}.job_indexed (LIKE {SCHEMA}.job INCLUDING ALL)
                WITH ({", ".join(options or ["fillfactor=100"])});
            CREATE TABLE {SCHEMA}.job_pk (
                id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, state text,
                queue text, kind text, priority smallint, run_at timestamptz, args jsonb,
                max_attempts integer);""")
        pooled: list[CountingConnection] = []  # the pool's one connection, unproxied

        async def keep(conn: CountingConnection) -> None:
            pooled.append(conn)

        # The pool as Client.connect makes it (no reset query on release).
        pool = await asyncpg.create_pool(args.dsn, min_size=1, max_size=1, init=keep,
                                         reset=skip_session_reset,
                                         connection_class=CountingConnection)  # fmt: skip
        raw: CountingConnection = await asyncpg.connect(
            args.dsn, connection_class=CountingConnection
        )
        clients = {"today": Client(pool, schema=SCHEMA),
                   "old": OldCopyClient(pool, schema=SCHEMA),
                   "staged": StagedCopyClient(pool, schema=SCHEMA),
                   "lean": Client(pool, schema=LEAN)}  # fmt: skip
        client = clients["today"]
        try:
            conns = [*pooled, raw]
            for m in build(clients, raw, 200, 20):  # warm-up: prepare, load types
                if args.only and m.key not in args.only:
                    continue
                await timed(admin, conns, m)
            measures = [m for m in build(clients, raw, args.n, args.single_n)
                        if not args.only or m.key in args.only]  # fmt: skip
            noise: list[tuple[int, float]] = []
            for rep in range(1, args.reps + 1):
                noise.append((await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE backend_type = "
                    "'client backend' AND state <> 'idle' AND pid <> pg_backend_pid()"),
                    os.getloadavg()[0]))  # fmt: skip
                # Reversed every other rep: neither side of a pair always runs first.
                for m in measures if rep % 2 else measures[::-1]:
                    await timed(admin, conns, m)
                print(f"rep {rep}: " + ", ".join(f"{m.key} {m.rates[-1]:,.0f}" for m in measures),
                      flush=True)  # fmt: skip
            extra = report(measures, noise)
            if args.profile:
                await admin.execute(f"TRUNCATE {SCHEMA}.job")
                await profile_copy(client, args.n)
        finally:
            await raw.close()
            await pool.close()
        figures = {m.key: {k: v for k, v in asdict(m).items() if k != "run"} for m in measures}
        return {"n": args.n, "single_n": args.single_n, "reps": args.reps,
                "server": admin.get_server_version()._asdict(), "noise": noise,
                "measurements": figures, **extra}  # fmt: skip
    finally:
        await admin.execute(drop)
        await admin.close()


def code_state() -> dict[str, str]:
    """Which pgjobd was measured: the tree may hold uncommitted changes."""

    def git(*args: str) -> str:
        where = os.path.dirname(os.path.abspath(__file__))
        run = subprocess.run(["git", "-C", where, *args], check=False, capture_output=True)
        return run.stdout.decode().strip()

    with open(client_module.__file__, "rb") as f:
        client_sha = hashlib.sha256(f.read()).hexdigest()[:12]
    dirty = git("status", "--porcelain", "--", "../pgjobd").splitlines()
    return {"head": git("rev-parse", "--short", "HEAD"), "dirty_files": str(len(dirty)),
            "client_py_sha256": client_sha,
            "migrations": " ".join(f"{m.version}:{m.checksum}" for m in available())}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("PGJOBD_DSN", DEFAULT_DSN))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n", type=int, default=20_000, help="jobs per bulk measurement")
    parser.add_argument("--single-n", type=int, default=2_000, help="jobs, 1-job measurements")
    parser.add_argument("--json", help="write the raw figures to this file")
    parser.add_argument("--profile", action="store_true", help="cProfile one enqueue_many")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--only", type=lambda text: text.split(","), default=None,
                        help="run only these measurements (keys, comma-separated)")  # fmt: skip
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    code = code_state()
    print("pgjobd code: " + ", ".join(f"{k} {v}" for k, v in code.items()), flush=True)
    loop_factory = None
    if arguments.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        results = runner.run(main(arguments)) | {"code": code}
    if arguments.json:
        with open(arguments.json, "w") as out:
            json.dump(results, out, indent=1)
