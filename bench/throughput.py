"""Job throughput of `pgjobd run` beside a raw-SQL ceiling and the Python peers, in one run.

Creates schema ``bench_throughput`` (migrated fresh) and drops it at the end. Each
repetition runs, in this order (interleaved, so noise hits them alike):

- drain rounds: N no-op jobs pre-enqueued (enqueue_many, untimed), then a real
  ``pgjobd run`` subprocess (one member, a temp config per round: processes,
  concurrency, history, and ``:def`` for the no-op as a ``def`` handler) drains them.
  Timed like the peers' harness: from the first handler start (the handler writes
  ``first.<pid>``) until a 0.1 s poll finds the hot table empty; the final-record count
  is then checked. With history "all", the exact end
  (the last ``finished_at``) and the rates over the first and last 2,000 jobs come from
  job_history. WAL bytes (``pg_current_wal_insert_lsn``, cluster-wide) and transactions
  (``pg_stat_database`` commits + rollbacks of this database, minus the harness' own
  polls) per job, from just before the daemon starts to after it exits. CPU split (in
  cores, from /proc) over the window from the member row appearing to the end.
- a statement-log round: the first round's config again, its sessions running with
  ``log_min_duration_statement = 0`` (set through the DSN); the server log gives every
  statement the member sent, with its server-side duration: the claim statement's
  p50/p99 under load and the statements per job, by query name.
- with ``--floor``, after each round's drain, the same drain by ``bench/floor_chain.py``
  (the least a member laid out as design/architecture.md says can spend per job: its
  supervisor claims and completes with pgjobd's statements and hands the jobs over
  pipes to child processes, and does nothing else), timed the same way: whether a
  target is within reach of the process layout at all.
- the raw lifecycle ceiling: two asyncpg connections, each looping pgjobd's own
  ``job_claim`` (LIMIT 50) and ``job_complete_many`` for what it claimed, nothing else.
- trickle: one member; jobs enqueued one at a time with ``Client.enqueue`` at ~100/s;
  the handler records its start minus ``time.time()`` taken just before the call. Then
  a bare round trip (``SELECT 1``) as often, back to back and at the trickle's spacing:
  what one hop to a process idle that long costs on the machine. With ``--floor``, the
  same trickle with ``bench/floor_chain.py`` in the member's place.
- peers: ``bench_<peer>.py run`` of ../shared/bench/peers (drain 1 and 2 processes,
  trickle), from the venvs that its run_all.sh creates under /tmp/peers.

    /work/venv/bin/python bench/throughput.py [--reps 3] [--peers "pgqueuer oban"]
        [--rounds 1:50:all,2:50:all,1:50:none,2:20:all:def,2:20:all:other] [--dsn DSN]
        [--trickle-round 1:50:all:other] [--json out.json]
        [--profile DIR]    # one extra drain under py-spy (--subprocesses)

Not a test: it prints figures and met/missed against the targets of issue 17 (the
defaults' ratio needs a round at the default settings, e.g. 2:20:all, and --peers).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
from procstat import children_of, cpu_snapshot, cpu_split, postgres_pids

from pgjobd.client import Client
from pgjobd.config import QueueConfig
from pgjobd.migrate import migrate
from pgjobd.protocol import CPU_POLICIES
from pgjobd.queries import QUERY_FILES, Queries, for_schema
from pgjobd.sql_text import named_blocks
from pgjobd.statements.job import CompleteRow

SCHEMA = "bench_throughput"
DEFAULT_DSN = "postgresql://root@127.0.0.1:5432/test"
HERE = Path(__file__).resolve().parent
HANDLERS = HERE / "handlers"
PEERS_HARNESS = HERE.parent.parent / "shared" / "bench" / "peers"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/tmp/peers"))
POLL_S = 0.1  # as the peers' harness
EDGE_JOBS = 2_000  # flatness: rate over the first and the last this many jobs
RAW_BATCH = 50
LEASE = timedelta(seconds=30)
# Targets of issue 17 (issue 3's, 8,000 jobs/s and 1.5x / 0.28 at the best setting,
# were met in wave 1).
DEFAULTS_PEER_RATIO = 1.5  # the default queue settings against the best peer
PEER_RATIO = 2.0  # the best setting against the best peer
RAW_RATIO = 0.5
TRICKLE_P50_MS = 2.0
TRICKLE_P99_MS = 4.0
CLAIM_P99_MS = 50.0
FLAT_RATIO = 0.8  # last-2,000 rate at least this share of the first-2,000 rate


@dataclass(frozen=True)
class Round:
    processes: int
    concurrency: int
    history: str
    handler: str = "async"  # "def": the same no-op as a `def` handler (run in a thread)
    cpu_scheduling: str | None = None  # the queue's cpu_scheduling; None: its default

    @property
    def key(self) -> str:
        suffix = "" if self.handler == "async" else f" {self.handler}"
        if self.cpu_scheduling is not None:
            suffix += f" {self.cpu_scheduling}"
        return f"p{self.processes} c{self.concurrency} {self.history}{suffix}"

    @property
    def kind(self) -> str:
        return "bench_noop" if self.handler == "async" else "bench_noop_def"

    @property
    def queue_settings(self) -> str:
        """The round's [queues.default] keys."""
        settings = (f"concurrency = {self.concurrency}\nprocesses = {self.processes}\n"
                    f'history = "{self.history}"\n')  # fmt: skip
        if self.cpu_scheduling is not None:
            settings += f'cpu_scheduling = "{self.cpu_scheduling}"\n'
        return settings

    @classmethod
    def parse(cls, text: str) -> Round:
        """P:C:HISTORY, then `def` (a `def` handler) and/or a cpu_scheduling, `batch` or
        `other`, in any order."""
        processes, concurrency, history, *options = text.split(":")
        handler, policy = "async", None
        for option in options:
            if option in ("async", "def"):
                handler = option
            elif option in CPU_POLICIES:
                policy = option
            else:
                policies = ", ".join(CPU_POLICIES)
                raise ValueError(f"round {text!r}: {option!r} is neither a handler "
                                 f"(async, def) nor a cpu_scheduling ({policies})")  # fmt: skip
        return cls(int(processes), int(concurrency), history, handler, policy)


TRICKLE_ROUND = Round(1, 50, "all")


@dataclass
class Drain:
    seconds: float  # first handler start .. the poll sees the hot table empty
    exact_seconds: float | None  # first handler start .. the last finished_at (history all)
    startup_s: float  # process spawn .. first handler start
    first_rate: float | None  # jobs/s over the first EDGE_JOBS (from finished_at)
    last_rate: float | None
    wal_bytes: int
    xacts: int
    cpu: dict[str, float]  # cores used, by role, member row seen .. end


@dataclass
class StatementLog:
    statements: dict[str, int] = field(default_factory=dict)  # by query name
    claim_ms: list[float] = field(default_factory=list)  # execute durations, server side
    complete_ms: list[float] = field(default_factory=list)
    claimed_rows: int = 0
    server_ms: dict[str, float] = field(default_factory=dict)  # by query name, every step


@dataclass
class Results:
    n: int
    rounds: list[Round]
    drains: dict[str, list[Drain]] = field(default_factory=dict)
    floors: dict[str, list[Drain]] = field(default_factory=dict)  # bench/floor_chain.py's
    raw: dict[str, list[float]] = field(default_factory=dict)  # jobs/s by history
    trickle: list[dict[str, float]] = field(default_factory=list)
    # The same trickle with every commit not waited for (synchronous_commit = off in the
    # member's and the enqueuer's sessions): what the durable commits cost its latency.
    trickle_unflushed: list[dict[str, float]] = field(default_factory=list)
    # The same trickle with bench/floor_chain.py in the member's place (with --floor): the
    # least this process layout adds to the enqueue on this machine.
    trickle_floor: list[dict[str, float]] = field(default_factory=list)
    # A bare round trip (SELECT 1), back to back and at the trickle's spacing: what one
    # hop between processes costs on this machine once they have sat idle.
    round_trips: list[dict[str, float]] = field(default_factory=list)
    peers: list[dict[str, Any]] = field(default_factory=list)  # the harness' JSONL rows
    statement_log: list[StatementLog] = field(default_factory=list)
    log_drains: list[Drain] = field(default_factory=list)
    noise: list[tuple[int, float]] = field(default_factory=list)


class Member:
    """One `pgjobd run` subprocess with a config of its own in `rundir`."""

    def __init__(self, dsn: str, rundir: Path, rnd: Round, *, schema: str = SCHEMA,
                 metrics_listen: str = "", extra: str = "",
                 floor: bool = False, floor_args: tuple[str, ...] = ()) -> None:  # fmt: skip
        """extra: TOML appended to the config (more [queues.x] tables, [retention]...).
        floor: bench/floor_chain.py in the member's place (the same queue settings), with
        floor_args (another claim strategy) if given."""
        self.rundir = rundir
        self.floor = floor
        config = rundir / "pgjobd.toml"
        config.write_text(
            f'[database]\nschema = "{schema}"\n\n'
            f"[daemon]\nhandlers = [{json.dumps(str(HANDLERS))}]\n"
            f'metrics_listen = "{metrics_listen}"\nlog_format = "text"\nlog_level = "warning"\n'
            'drain_timeout = "10s"\n\n'
            f"[queues.default]\n{rnd.queue_settings}{extra}"
        )
        env = os.environ | {"PGJOBD_DSN": dsn, "PGJOBD_BENCH_DIR": str(rundir)}
        self.log = (rundir / "member.log").open("w")
        command = [sys.executable, "-m", "pgjobd", "run", "--config", str(config)]
        if floor:
            command = [sys.executable, str(HERE / "floor_chain.py"), "--dsn", dsn,
                       "--schema", schema, "--processes", str(rnd.processes),
                       "--concurrency", str(rnd.concurrency), "--history", rnd.history,
                       *floor_args]  # fmt: skip
        # In its run directory: `python -m` puts the working directory first on sys.path,
        # so from the repository's root a member would run the repository's pgjobd
        # whatever PYTHONPATH names (another tree, for an A/B).
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=env, cwd=rundir)  # fmt: skip
        self.spawned_at = time.time()

    async def wait_ready(self, h: Harness) -> None:
        """Until it claims: a member's row appears once its workers are ready; the floor
        writes a file."""
        if not self.floor:
            await h.poll(f"SELECT count(*) FROM {h.schema}.member", lambda v: v > 0, self, 0.01)
            return
        while not (self.rundir / "ready").exists():
            self.check_alive()
            await asyncio.sleep(0.01)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = (self.rundir / "member.log").read_text()[-3000:]
            raise RuntimeError(f"pgjobd run exited {self.process.returncode}:\n{tail}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain), SIGKILL after timeout_s; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()  # our own child, by pid
            code = self.process.wait()
        self.log.close()
        return code

    def first_start(self) -> float:
        starts = [float(Path(f).read_text()) for f in glob.glob(f"{self.rundir}/first.*")]
        if not starts:
            raise RuntimeError("no handler start recorded")
        return min(starts)

    def latencies_ms(self) -> dict[int, float]:
        """The trickle's latencies by job number (args "i")."""
        return {
            int(line.split()[0]): float(line.split()[1]) * 1000
            for f in glob.glob(f"{self.rundir}/lat.*")
            for line in Path(f).read_text().splitlines()
        }


@contextlib.asynccontextmanager
async def member(dsn: str, rnd: Round, prefix: str, **options: Any) -> AsyncIterator[Member]:
    """A running member; options go to Member (schema, metrics_listen, extra)."""
    with tempfile.TemporaryDirectory(prefix=f"pgjobd_{prefix}_") as rundir:
        running = Member(dsn, Path(rundir), rnd, **options)
        try:
            yield running
        finally:
            code = running.stop()
        if code != 0:
            tail = (Path(rundir) / "member.log").read_text()[-3000:]
            raise RuntimeError(f"pgjobd run exited {code} after SIGTERM:\n{tail}")


# -- database --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def fresh_harness(dsn: str, schema: str = SCHEMA) -> AsyncIterator[tuple[Harness, Client]]:
    """SCHEMA migrated anew, the harness' sessions and a client on it; the schema is
    dropped at the end."""
    admin = await asyncpg.connect(dsn)
    await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    try:
        await migrate(admin, schema)
        poller = await asyncpg.connect(dsn, server_settings={"enable_seqscan": "off"})
        client = await Client.connect(dsn, schema=schema, max_size=2)
        try:
            yield Harness(dsn, admin, poller, schema), client
        finally:
            await client.close()
            await poller.close()
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.close()


class Harness:
    """The harness' own sessions: admin (setup, counts) and poller (counted polls)."""

    def __init__(self, dsn: str, admin: asyncpg.Connection, poller: asyncpg.Connection,
                 schema: str = SCHEMA) -> None:  # fmt: skip
        self.dsn = dsn
        self.admin = admin
        self.poller = poller
        self.polls = 0
        self.schema = schema
        self.t = f"{schema}.job"

    async def reset_and_enqueue(self, client: Client, n: int, kind: str = "bench_noop",
                                *, fresh: bool = True) -> int:  # fmt: skip
        """Enqueue n jobs (after emptying the tables when fresh); the lowest new id.
        Not fresh: what the tables hold stays (dead tuples, future jobs, history)."""
        if fresh:
            await self.admin.execute(
                f"TRUNCATE {self.t}, {self.schema}.job_history, {self.schema}.job_attempt"
            )
        first_id: int = await self.admin.fetchval(
            "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence($1, 'id')), 0) + 1",
            self.t,
        )  # ids only grow: every id from here on is one of ours
        for start in range(0, n, 10_000):
            await client.enqueue_many(
                [(kind, {"i": i}) for i in range(start, min(n, start + 10_000))]
            )
        count = await self.admin.fetchval(f"SELECT count(*) FROM {self.t} WHERE id >= $1", first_id)
        if count != n:
            raise RuntimeError(f"expected {n} jobs enqueued, found {count}")
        await self.admin.execute(f"ANALYZE {self.t}")
        return first_id

    async def poll(self, sql: str, done: Callable[[Any], bool], running: Member,
                   interval_s: float = POLL_S, timeout_s: float = 300.0) -> float:  # fmt: skip
        """Poll sql on the poller session until done(value); the wall time it was seen."""
        deadline = time.time() + timeout_s
        while True:
            value = await self.poller.fetchval(sql)
            self.polls += 1
            now = time.time()
            if done(value):
                return now
            running.check_alive()
            if now > deadline:
                raise TimeoutError(f"{sql!r} -> {value} after {timeout_s}s")
            await asyncio.sleep(interval_s)

    async def xacts(self) -> int:
        await self.admin.execute("SELECT pg_stat_clear_snapshot()")
        value: int = await self.admin.fetchval(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()"
        )
        return value

    async def wal_lsn(self) -> str:
        lsn: str = await self.admin.fetchval("SELECT pg_current_wal_insert_lsn()::text")
        return lsn

    async def wal_since(self, lsn: str) -> int:
        diff = await self.admin.fetchval(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)", lsn
        )
        return int(diff)

    async def backend_pids(self) -> list[int]:
        rows = await self.admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'pgjobd%' "
            "AND datname = current_database()"
        )
        return [row["pid"] for row in rows]


# -- measurements ----------------------------------------------------------------------


async def drain(h: Harness, client: Client, rnd: Round, n: int, *, dsn: str | None = None,
                prefix: str = "drain", on_ready: Callable[[Member], None] | None = None,
                fresh: bool = True, on_done: Callable[[Member], Awaitable[None]] | None = None,
                **options: Any) -> Drain:  # fmt: skip
    """Drain n new no-op jobs with one member (options: see Member). Not fresh: the
    tables keep what they hold; the drain ends when no job is available or running.
    on_done runs once the drain is seen done, before the member stops."""
    first_id = await h.reset_and_enqueue(client, n, rnd.kind, fresh=fresh)
    await asyncio.sleep(1.2)  # idle sessions report their transaction counts within 1 s
    xacts_before, polls_before = await h.xacts(), h.polls
    lsn = await h.wal_lsn()
    async with member(dsn or h.dsn, rnd, prefix, schema=h.schema, **options) as running:
        if on_ready is not None:
            on_ready(running)
        await running.wait_ready(h)
        supervisor = running.process.pid
        before = cpu_snapshot([supervisor, os.getpid(), *children_of(supervisor), *postgres_pids()])
        if fresh:
            done_at = await h.poll(f"SELECT count(*) FROM (SELECT 1 FROM {h.t} LIMIT 1) AS s",
                                   lambda v: v == 0, running)  # fmt: skip
        elif rnd.history == "all":  # the hot table's dead rows do not slow this poll
            done_at = await h.poll(
                f"SELECT count(*) FROM {h.schema}.job_history WHERE id >= {first_id}",
                lambda v: v >= n, running)  # fmt: skip
        else:
            done_at = await h.poll(
                f"SELECT count(*) FROM (SELECT 1 FROM {h.t} WHERE id >= {first_id} LIMIT 1) s",
                lambda v: v == 0, running)  # fmt: skip
        # Roles as at the end: pool sessions opened during the drain count from their start.
        backends, pg_all = await h.backend_pids(), postgres_pids()
        roles = {"supervisor": [supervisor], "workers": children_of(supervisor),
                 "pg member": backends, "pg other": [p for p in pg_all if p not in backends],
                 "harness": [os.getpid()]}  # fmt: skip
        cpu = cpu_split(before, cpu_snapshot([p for pids in roles.values() for p in pids]), roles)
        first = running.first_start()
        if on_done is not None:
            await on_done(running)
    wal = await h.wal_since(lsn)
    await asyncio.sleep(1.2)  # idle backends report their transaction counts within 1 s
    xacts = await h.xacts() - xacts_before - (h.polls - polls_before)
    ours = f"WHERE id >= {first_id}"
    kept = await h.admin.fetchval(f"SELECT count(*) FROM {h.schema}.job_history {ours}")
    attempts = await h.admin.fetchval(f"SELECT count(*) FROM {h.schema}.job_attempt")
    left = await h.admin.fetchval(f"SELECT count(*) FROM {h.t} {ours}")
    if left or attempts or kept != (n if rnd.history == "all" else 0):
        raise RuntimeError(f"{rnd.key}: {left} jobs left, {attempts} failed attempts, "
                           f"{kept} final records for {n} jobs")  # fmt: skip
    exact = first_rate = last_rate = None
    if rnd.history == "all":
        ends = [row[0] for row in await h.admin.fetch(
            f"SELECT extract(epoch FROM finished_at)::float8 FROM {h.schema}.job_history "
            f"{ours} ORDER BY finished_at")]  # fmt: skip
        exact = ends[-1] - first
        edge = min(EDGE_JOBS, n // 4)
        # A small drain's edge can end within one completion batch (one finished_at): no
        # rate then, as for history "none".
        first_span, last_span = ends[edge - 1] - first, ends[-1] - ends[-edge - 1]
        first_rate = edge / first_span if first_span > 0 else None
        last_rate = edge / last_span if last_span > 0 else None
    return Drain(done_at - first, exact, first - running.spawned_at, first_rate, last_rate,
                 wal, xacts, cpu)  # fmt: skip


async def raw_lifecycle(h: Harness, client: Client, q: Queries, n: int, keep: bool) -> float:
    """Two sessions, each looping job_claim (LIMIT 50) and job_complete_many: jobs/s."""
    await h.reset_and_enqueue(client, n)
    conns = [await asyncpg.connect(h.dsn) for _ in range(2)]

    async def loop(conn: asyncpg.Connection) -> int:
        finished = 0
        while rows := await q.job_claim(conn, "default", RAW_BATCH, "bench-raw", LEASE):
            await q.job_complete_many(conn, [CompleteRow(r.id, r.fence, None, keep) for r in rows])
            finished += len(rows)
        return finished

    try:
        for conn in conns:  # prepare both statements outside the timing
            await q.job_claim(conn, "no_such_queue", 1, "bench-raw", LEASE)
            await q.job_complete_many(conn, [])
        started = time.perf_counter()
        finished = sum(await asyncio.gather(*(loop(c) for c in conns)))
        seconds = time.perf_counter() - started
    finally:
        for conn in conns:
            await conn.close()
    kept = await h.admin.fetchval(f"SELECT count(*) FROM {SCHEMA}.job_history")
    if finished != n or kept != (n if keep else 0):
        raise RuntimeError(f"raw lifecycle: {finished} finished, {kept} kept of {n}")
    return n / seconds


def with_settings(dsn: str, **settings: str) -> str:
    """`dsn` with server settings for its sessions (asyncpg takes unknown parameters so)."""
    separator = "&" if urlsplit(dsn).query else "?"
    return dsn + separator + "&".join(f"{name}={value}" for name, value in settings.items())


async def trickle(
    h: Harness,
    count: int,
    rate: float,
    *,
    dsn: str | None = None,
    rnd: Round = TRICKLE_ROUND,
    floor: bool = False,
) -> dict[str, float]:
    """Jobs enqueued one at a time at `rate` to a member of round `rnd`'s settings (or
    bench/floor_chain.py in its place, when `floor`); each one's enqueue-to-start
    latency. The member and the enqueuer's client both connect with `dsn` (the harness'
    by default)."""
    await h.admin.execute(f"TRUNCATE {SCHEMA}.job, {SCHEMA}.job_history, {SCHEMA}.job_attempt")
    history = f"SELECT count(*) FROM {SCHEMA}.job_history"
    dsn = dsn or h.dsn
    async with (
        await Client.connect(dsn, schema=h.schema, max_size=2) as client,
        member(dsn, rnd, "trickle", floor=floor) as running,
    ):
        await running.wait_ready(h)
        await client.enqueue("bench_latency", {"i": -1})  # warm-up: no "t", not recorded
        await h.poll(history, lambda v: v >= 1, running)
        await asyncio.sleep(0.5)
        started = time.perf_counter()
        enqueue_ms: list[float] = []  # each enqueue's own round trip, its commit included
        for k in range(count):
            delay = started + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter()
            await client.enqueue("bench_latency", {"i": k, "t": time.time()})
            enqueue_ms.append((time.perf_counter() - sent) * 1000)
        achieved = count / (time.perf_counter() - started)
        await h.poll(history, lambda v: v >= count + 1, running)
        by_job = running.latencies_ms()
    if sorted(by_job) != list(range(count)):
        raise RuntimeError(f"trickle: {len(by_job)} latencies recorded for {count} jobs")
    ms = list(by_job.values())
    # The part that follows the enqueue's return (its commit): the wake-up, the claim and
    # the hand-over to the worker. (The handler's clock is read before the enqueue.)
    after = [by_job[k] - enqueue_ms[k] for k in range(count)]
    return {"p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99), "max_ms": max(ms),
            "rate": achieved,
            "enqueue_p50_ms": percentile(enqueue_ms, 50),
            "enqueue_p99_ms": percentile(enqueue_ms, 99),
            "after_p50_ms": percentile(after, 50),
            "after_p99_ms": percentile(after, 99)}  # fmt: skip


async def unflushed_trickle(
    h: Harness, count: int, rate: float, rnd: Round = TRICKLE_ROUND
) -> dict[str, float]:
    """The trickle again with synchronous_commit = off in every session of the member and
    of the enqueuer: the same path with no commit waiting for its WAL flush (not a
    setting pgjobd may run with: a claim or an enqueue lost in a crash of the server)."""
    return await trickle(
        h, count, rate, dsn=with_settings(h.dsn, synchronous_commit="off"), rnd=rnd
    )


async def round_trips(h: Harness, count: int, rate: float) -> dict[str, float]:
    """`SELECT 1` on a session of its own, `count` times back to back and `count` times
    at the trickle's spacing (1 / `rate`): the trickle's every hop (the enqueue, the
    wake-up, the claim, the hand-over) is a process woken after that long idle."""
    conn = await asyncpg.connect(h.dsn)
    try:
        await conn.fetchval("SELECT 1")
        figures: dict[str, float] = {}
        for label, gap_s in (("back_to_back", 0.0), ("spaced", 1 / rate)):
            ms = []
            for _ in range(count):
                sent = time.perf_counter()
                await conn.fetchval("SELECT 1")
                ms.append((time.perf_counter() - sent) * 1000)
                if gap_s:
                    await asyncio.sleep(gap_s)
            figures[f"{label}_p50_ms"] = percentile(ms, 50)
            figures[f"{label}_p99_ms"] = percentile(ms, 99)
        return figures
    finally:
        await conn.close()


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\S* \S+ \[(\d+)\]")
_DURATION = re.compile(r"LOG:\s+duration: ([0-9.]+) ms\s+(parse|bind|execute|statement)[^:]*: ?")


def read_statement_log(text: str, q: Queries) -> StatementLog:
    """The member's statements in a server log excerpt (only its sessions log them)."""
    names = {" ".join(q.sql(name).split()): name
             for file in QUERY_FILES for name in named_blocks(file)}  # fmt: skip
    entries: list[tuple[int, str, float, list[str]]] = []  # pid, step, ms, text lines
    for line in text.splitlines():
        prefix = _LOG_LINE.match(line)
        if prefix is None:
            if entries:
                entries[-1][3].append(line)
            continue
        found = _DURATION.search(line)
        if found is None:
            entries.append((0, "", 0.0, []))  # another message: ends the previous text
            continue
        entries.append((int(prefix.group(1)), found.group(2), float(found.group(1)),
                        [line[found.end():]]))  # fmt: skip
    log = StatementLog()
    for pid, step, ms, lines in entries:
        if not pid:
            continue
        statement = " ".join(" ".join(lines).split()).rstrip(";")
        name = names.get(statement) or (
            "asyncpg pool reset on release" if "pg_advisory_unlock_all()" in statement
            else "other: " + statement[:60]
        )  # fmt: skip
        log.server_ms[name] = log.server_ms.get(name, 0.0) + ms  # parse and bind too
        if step not in ("execute", "statement"):
            continue
        log.statements[name] = log.statements.get(name, 0) + 1
        if name == "job_claim":
            log.claim_ms.append(ms)
        elif name == "job_complete_many":
            log.complete_ms.append(ms)
    return log


async def logged_drain(h: Harness, client: Client, rnd: Round, n: int, *, server_log: Path,
                       q: Queries) -> tuple[Drain, StatementLog] | None:  # fmt: skip
    """A drain whose member sessions log every statement with its duration."""
    try:
        offset = len(read_from(server_log, 0))  # readable at all?
    except OSError as e:
        print(f"statement log: server log {server_log} not readable ({e}): claim p99 n/a")
        return None
    dsn = with_settings(h.dsn, log_min_duration_statement="0")
    result = await drain(h, client, rnd, n, dsn=dsn, prefix="logged")
    return result, read_statement_log(read_from(server_log, offset), q)


def read_from(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", "replace")


def run_peer(
    peer: str, rep: int, n: int, out: Path, dsn: str, *, trickle: int, trickle_rate: float
) -> None:
    """One rep of the peer's harness: its drains and a trickle as long as pgjobd's, at
    the same rate (0: none), so that the two trickles' p99s are of as many jobs."""
    python = PEERS_DIR / peer / "bin" / "python"
    script = PEERS_HARNESS / f"bench_{peer}.py"
    if not python.exists() or not script.exists():
        print(f"peer {peer}: no {python} or {script}; create the venvs with "
              f"{PEERS_HARNESS / 'run_all.sh'} first")  # fmt: skip
        return
    url = urlsplit(dsn)
    env = os.environ | {"PGHOST": url.hostname or "127.0.0.1", "PGPORT": str(url.port or 5432),
                        "PGUSER": url.username or "root",
                        "BENCH_ADMIN_DB": url.path.lstrip("/") or "test"}  # fmt: skip
    fresh = ["--fresh-db"] if rep == 1 else []
    command = [str(python), str(script), "run", "--rep", str(rep), "--n", str(n), "--out", str(out),
               "--trickle", str(trickle), "--trickle-rate", str(trickle_rate)]  # fmt: skip
    done = subprocess.run([*command, *fresh], env=env, check=False, cwd=PEERS_HARNESS)
    if done.returncode:
        print(f"peer {peer} rep {rep} failed: exit {done.returncode}")


def drop_peer_db(peer: str) -> None:
    python = PEERS_DIR / peer / "bin" / "python"
    if python.exists():
        script = str(PEERS_HARNESS / f"bench_{peer}.py")
        subprocess.run([str(python), script, "dropdb"], check=False, cwd=PEERS_HARNESS)


# -- profile -----------------------------------------------------------------------------


async def profiled_drain(h: Harness, client: Client, rnd: Round, n: int, out_dir: Path) -> None:
    """One drain with py-spy attached to the member and its workers: flame graph + top."""
    os.makedirs(out_dir, exist_ok=True)
    spies: list[subprocess.Popen[bytes]] = []
    py_spy = Path(sys.executable).with_name("py-spy")

    def attach(running: Member) -> None:
        for fmt, name in (("raw", "member.txt"), ("flamegraph", "member.svg")):
            spies.append(subprocess.Popen(
                [str(py_spy), "record", "--subprocesses", "--rate", "250", "--format", fmt,
                 "--output", str(out_dir / name), "--pid", str(running.process.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip

    result = await drain(h, client, rnd, n, prefix="profiled", on_ready=attach)
    for spy in spies:
        try:
            spy.wait(20)
        except subprocess.TimeoutExpired:
            spy.send_signal(signal.SIGINT)
            spy.wait(10)
    print(f"\nprofiled drain ({rnd.key}, py-spy --rate 250 attached, so slower): "
          f"{n / result.seconds:,.0f} jobs/s; CPU cores: {fmt_cpu(result.cpu)}")  # fmt: skip
    with contextlib.suppress(OSError):
        print(summarise_profile(read_from(out_dir / "member.txt", 0)))
    print(f"flame graph: {out_dir / 'member.svg'}")


def summarise_profile(collapsed: str, top: int = 12) -> str:
    """Per process: samples, and the pgjobd/asyncpg/anyio frames with most inclusive time."""
    per_process: dict[str, Counter[str]] = {}
    totals: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        frames = stack.split(";")
        process = frames[0]
        totals[process] += int(count_text)
        seen = set()
        for frame in frames[1:]:
            interesting = any(s in frame for s in ("pgjobd/", "asyncpg", "anyio", "msgspec"))
            if interesting and frame not in seen:
                seen.add(frame)
                per_process.setdefault(process, Counter())[frame] += int(count_text)
    lines = []
    for process, total in totals.most_common():
        lines.append(f"  {process}: {total} samples")
        for frame, count in per_process.get(process, Counter()).most_common(top):
            lines.append(f"    {count / total:6.1%} {frame}")
    return "\n".join(lines)


# -- report ------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks, as the peers' harness (common.pct)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def spread(values: list[float], fmt: str = ",.0f") -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:{fmt}}"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}–{max(values):{fmt}})"


def p50_p99(rows: list[dict[str, float]], key: str) -> str:
    """The median (spread) of the rows' `key`p50_ms, then of their `key`p99_ms."""
    return (f"{spread([t[key + 'p50_ms'] for t in rows], '.2f'):>25} / "
            f"{spread([t[key + 'p99_ms'] for t in rows], '.2f')}")  # fmt: skip


def fmt_cpu(cpu: dict[str, float]) -> str:
    return " ".join(f"{role} {cores:.2f}" for role, cores in cpu.items())


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def best_peer(r: Results) -> tuple[str, list[float]]:
    """The peer drain (name, processes) with the best median, and its rates by rep."""
    by: dict[str, dict[int, float]] = {}
    for row in r.peers:
        if row["kind"].startswith("drain"):
            by.setdefault(f"{row['peer']} {row['kind']}", {})[row["rep"]] = row["drain_jobs_s"]
    if not by:
        return "none", []
    name = max(by, key=lambda k: statistics.median(by[k].values()))
    return name, [by[name][rep] for rep in sorted(by[name])]


def paired(mine: list[float], base: list[float]) -> list[float]:
    return [a / b for a, b in zip(mine, base, strict=False) if b]


def report(r: Results) -> None:
    peer_name, peer_rates = best_peer(r)
    raw_all = r.raw.get("all", [])
    print(f"\n{'measurement':<34} {'jobs/s median (min–max)':>25} {'exact end':>8} "
          f"{'first/last 2k':>15} {'WAL B/job':>9} {'xact/job':>8} {'start s':>7}  "
          f"ratios (paired per rep)")  # fmt: skip
    for rnd in r.rounds:
        drains = r.drains[rnd.key]
        rates = [r.n / d.seconds for d in drains]
        exact = [r.n / d.exact_seconds for d in drains if d.exact_seconds]
        edges = [(d.first_rate, d.last_rate) for d in drains if d.first_rate and d.last_rate]
        edge = (f"{statistics.median(f for f, _ in edges):,.0f}/"
                f"{statistics.median(la for _, la in edges):,.0f}") if edges else "n/a"  # fmt: skip
        print(
            f"drain {rnd.key:<28} {spread(rates):>25} "
            f"{f'{statistics.median(exact):,.0f}' if exact else 'n/a':>8} {edge:>15} "
            f"{statistics.median(d.wal_bytes for d in drains) / r.n:>9,.0f} "
            f"{statistics.median(d.xacts for d in drains) / r.n:>8.3f} "
            f"{statistics.median(d.startup_s for d in drains):>7.2f}  "
            f"{spread(paired(rates, peer_rates), '.2f')} of {peer_name}; "
            f"{spread(paired(rates, raw_all), '.2f')} of raw (all)"
        )
    for key, floors in r.floors.items():
        rates = [r.n / d.seconds for d in floors]
        mine = [r.n / d.seconds for d in r.drains[key.split(" [")[0]]]
        print(f"{'floor ' + key:<34} {spread(rates):>25}  "
              f"{spread(paired(rates, peer_rates), '.2f')} of {peer_name}; "
              f"pgjobd {spread(paired(mine, rates), '.2f')} of it")  # fmt: skip
    for history, rates in r.raw.items():
        print(f"{'raw lifecycle, 2 loops × 50, ' + history:<40} {spread(rates):>25}")
    for log_drain in r.log_drains:
        print(f"{'drain, statements logged (' + r.rounds[0].key + ')':<40} "
              f"{r.n / log_drain.seconds:>25,.0f}")  # fmt: skip
    if r.trickle:
        print(f"{'trickle p50 / p99 / max ms':<34} "
              f"{spread([t['p50_ms'] for t in r.trickle], '.2f'):>25} / "
              f"{spread([t['p99_ms'] for t in r.trickle], '.2f')} / "
              f"{spread([t['max_ms'] for t in r.trickle], '.1f')}  (at "
              f"{statistics.median(t['rate'] for t in r.trickle):.0f}/s)")  # fmt: skip
        print(f"{'  of which the enqueue p50 / p99':<34} {p50_p99(r.trickle, 'enqueue_')}  "
              "(its own round trip and commit)")  # fmt: skip
        print(f"{'  after the enqueue p50 / p99':<34} {p50_p99(r.trickle, 'after_')}  "
              "(wake-up, claim, hand-over)")  # fmt: skip
    variants = (
        ("the same, no commit waiting for its flush (synchronous_commit = off):",
         r.trickle_unflushed),
        ("the same with bench/floor_chain.py in the member's place:", r.trickle_floor),
    )  # fmt: skip
    for title, rows in variants:
        if rows:
            print(title)
        for key, label in (("", "trickle"), ("enqueue_", "  the enqueue"),
                           ("after_", "  after the enqueue")) if rows else ():  # fmt: skip
            print(f"{'  ' + label + ' p50 / p99':<34} {p50_p99(rows, key)}")
    spacings = (("back_to_back_", "back to back"), ("spaced_", "at the trickle's spacing"))
    for key, label in spacings if r.round_trips else ():
        print(f"{'a bare round trip p50 / p99':<34} {p50_p99(r.round_trips, key)}  "
              f"(SELECT 1, {label})")  # fmt: skip
    peers: dict[str, list[float]] = {}
    for row in r.peers:
        if row["kind"].startswith("drain"):
            peers.setdefault(f"{row['peer']} {row['kind']}", []).append(row["drain_jobs_s"])
        elif row["kind"] == "trickle":
            peers.setdefault(f"{row['peer']} trickle p50 ms", []).append(row["lat_p50_ms"])
            peers.setdefault(f"{row['peer']} trickle p99 ms", []).append(row["lat_p99_ms"])
    for name, values in peers.items():
        print(f"{'peer ' + name:<34} {spread(values, '.2f' if 'ms' in name else ',.0f'):>25}")
    print("\nCPU, cores used from the member row appearing to the end (median over reps; "
          f"{os.cpu_count()} cores):")  # fmt: skip
    for rnd in r.rounds:
        drains = r.drains[rnd.key]
        print(f"  {rnd.key:<16} " + fmt_cpu({role: statistics.median(d.cpu[role] for d in drains)
                                            for role in drains[0].cpu}))  # fmt: skip
    for key, floors in r.floors.items():
        print(f"  floor {key:<10} " + fmt_cpu({role: statistics.median(d.cpu[role] for d in floors)
                                             for role in floors[0].cpu}))  # fmt: skip
    claim_p99: float | None = None
    if r.statement_log:
        log = r.statement_log[0]
        claims = [ms for s in r.statement_log for ms in s.claim_ms]
        completes = [ms for s in r.statement_log for ms in s.complete_ms]
        claim_p99 = percentile(claims, 99) if claims else None
        total = sum(log.statements.values())
        print(f"\nstatement log ({r.rounds[0].key}, {len(r.statement_log)} run(s), server-side "
              f"execute time): job_claim n={len(claims)} p50 {percentile(claims, 50):.2f} ms "
              f"p99 {claim_p99 or 0:.2f} ms max {max(claims, default=0):.2f} ms; "
              f"job_complete_many n={len(completes)} p50 {percentile(completes, 50):.2f} ms "
              f"p99 {percentile(completes, 99):.2f} ms")  # fmt: skip
        print(
            f"  statements per job {total / r.n:.3f} (first run, {total} in all): "
            + ", ".join(f"{name} {count}" for name, count in Counter(log.statements).most_common(8))
        )
        heaviest = Counter(log.server_ms).most_common(8)
        print(
            "  server time, ms per 1,000 jobs (first run; parse, bind and execute): "
            + ", ".join(f"{name} {ms * 1000 / r.n:.2f}" for name, ms in heaviest)
        )
    else:
        print("\nclaim p99: n/a (no statement log)")
    print("pg_stat_statements: n/a (not in shared_preload_libraries; the server is not "
          "reconfigured)")  # fmt: skip

    # targets
    def median_rate(rnd: Round) -> float:
        return statistics.median(r.n / d.seconds for d in r.drains[rnd.key])

    best = max((rnd for rnd in r.rounds if rnd.history == "all"), key=median_rate)
    rates = [r.n / d.seconds for d in r.drains[best.key]]
    lines: list[tuple[str, str, bool]] = []
    defaults = QueueConfig()
    default_round = Round(defaults.processes, defaults.concurrency, defaults.history)
    if peer_rates and default_round.key in r.drains:
        mine = [r.n / d.seconds for d in r.drains[default_round.key]]
        ratio = statistics.median(paired(mine, peer_rates))
        lines.append((f"defaults ({default_round.key}) ≥ {DEFAULTS_PEER_RATIO}× best peer",
                      f"{ratio:.2f}×", ratio >= DEFAULTS_PEER_RATIO))  # fmt: skip
    if peer_rates:
        ratio = statistics.median(paired(rates, peer_rates))
        lines.append((f"best ({best.key}) ≥ {PEER_RATIO}× best peer ({peer_name})",
                      f"{ratio:.2f}×", ratio >= PEER_RATIO))  # fmt: skip
    if raw_all:
        ratio = statistics.median(paired(rates, raw_all))
        lines.append((f"best ≥ {RAW_RATIO} of raw lifecycle ceiling", f"{ratio:.2f}",
                      ratio >= RAW_RATIO))  # fmt: skip
    if r.trickle:
        p50 = statistics.median(t["p50_ms"] for t in r.trickle)
        p99 = statistics.median(t["p99_ms"] for t in r.trickle)
        lines.append((f"trickle p50 ≤ {TRICKLE_P50_MS} ms", f"{p50:.2f}", p50 <= TRICKLE_P50_MS))
        lines.append((f"trickle p99 ≤ {TRICKLE_P99_MS} ms", f"{p99:.2f}", p99 <= TRICKLE_P99_MS))
    if claim_p99 is not None:
        lines.append((f"claim p99 < {CLAIM_P99_MS:g} ms", f"{claim_p99:.2f}",
                      claim_p99 < CLAIM_P99_MS))  # fmt: skip
    edges = [
        (d.first_rate, d.last_rate) for d in r.drains[best.key] if d.first_rate and d.last_rate
    ]
    if edges:
        flat = statistics.median(last / first for first, last in edges)
        lines.append((f"flat: last/first {EDGE_JOBS:,} jobs ≥ {FLAT_RATIO}", f"{flat:.2f}",
                      flat >= FLAT_RATIO))  # fmt: skip
    print("\ntargets (issue 17):")
    for label, value, ok in lines:
        print(f"  {label:<52} {value:>9}  {verdict(ok)}")
    print(f"noise: other active client backends per rep {[a for a, _ in r.noise]}, "
          f"1-min load average per rep {[round(x, 2) for _, x in r.noise]}")  # fmt: skip


# -- main --------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> Results:
    rounds = [Round.parse(text) for text in args.rounds.split(",")]
    results = Results(args.n, rounds, drains={rnd.key: [] for rnd in rounds})
    q = for_schema(SCHEMA)
    peers_out = Path(tempfile.mkstemp(prefix="peers_", suffix=".jsonl")[1])
    try:
        async with fresh_harness(args.dsn) as (h, client):
            admin = h.admin
            major = admin.get_server_version().major
            server_log = Path(args.pg_log or f"/var/log/postgresql/postgresql-{major}-main.log")
            try:
                await drain(h, client, rounds[0], 2_000, prefix="warmup")
                for rep in range(1, args.reps + 1):
                    results.noise.append((await admin.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = "
                        "'client backend' AND state <> 'idle' AND pid <> pg_backend_pid()"),
                        os.getloadavg()[0]))  # fmt: skip
                    for rnd in rounds:
                        d = await drain(h, client, rnd, args.n)
                        results.drains[rnd.key].append(d)
                        print(f"rep {rep} drain {rnd.key}: {args.n / d.seconds:,.0f} jobs/s",
                              flush=True)  # fmt: skip
                        floors = [("", "")] if args.floor else []
                        for label, floor_args in floors + args.floor_variant:
                            key = f"{rnd.key} [{label}]" if label else rnd.key
                            d = await drain(h, client, rnd, args.n, prefix="floor", floor=True,
                                            floor_args=tuple(floor_args.split()))  # fmt: skip
                            results.floors.setdefault(key, []).append(d)
                            print(f"rep {rep} floor {key}: {args.n / d.seconds:,.0f} jobs/s",
                                  flush=True)  # fmt: skip
                    logged = await logged_drain(
                        h, client, rounds[0], args.n, server_log=server_log, q=q
                    )
                    if logged is not None:
                        results.log_drains.append(logged[0])
                        results.statement_log.append(logged[1])
                    for history, keep in (("all", True), ("none", False)):
                        rate = await raw_lifecycle(h, client, q, args.n, keep)
                        results.raw.setdefault(history, []).append(rate)
                        print(f"rep {rep} raw lifecycle {history}: {rate:,.0f} jobs/s",
                              flush=True)  # fmt: skip
                    if args.trickle:
                        t = await trickle(
                            h, args.trickle, args.trickle_rate, rnd=args.trickle_round
                        )
                        results.trickle.append(t)
                        print(f"rep {rep} trickle: p50 {t['p50_ms']:.2f} "
                              f"p99 {t['p99_ms']:.2f} ms", flush=True)  # fmt: skip
                        t = await unflushed_trickle(
                            h, args.trickle, args.trickle_rate, args.trickle_round
                        )
                        results.trickle_unflushed.append(t)
                        print(f"rep {rep} trickle, commits not waited for: "
                              f"p50 {t['p50_ms']:.2f} p99 {t['p99_ms']:.2f} ms",
                              flush=True)  # fmt: skip
                        if args.floor:
                            t = await trickle(h, args.trickle, args.trickle_rate,
                                              rnd=args.trickle_round, floor=True)  # fmt: skip
                            results.trickle_floor.append(t)
                            print(f"rep {rep} floor trickle: p50 {t['p50_ms']:.2f} "
                                  f"p99 {t['p99_ms']:.2f} ms", flush=True)  # fmt: skip
                        results.round_trips.append(
                            await round_trips(h, args.trickle, args.trickle_rate)
                        )
                    for peer in args.peers.split():
                        run_peer(peer, rep, args.n, peers_out, args.dsn,
                                 trickle=args.trickle, trickle_rate=args.trickle_rate)  # fmt: skip
                results.peers = [json.loads(line) for line in read_from(peers_out, 0).splitlines()]
                report(results)
                if args.profile:
                    await profiled_drain(h, client, rounds[0], args.n, Path(args.profile))
            finally:
                for peer in args.peers.split():
                    drop_peer_db(peer)
        return results
    finally:
        os.unlink(peers_out)


def code_state() -> str:
    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(HERE), *args], check=False, capture_output=True)
        return run.stdout.decode().strip()

    dirty = git("status", "--porcelain", "--", "../pgjobd").splitlines()
    state = f"head {git('rev-parse', '--short', 'HEAD')}, dirty files under pgjobd/: {len(dirty)}"
    if os.environ.get("PYTHONPATH"):
        state += f"; the members import from PYTHONPATH={os.environ['PYTHONPATH']} first"
    return state


def floor_variant(text: str) -> tuple[str, str]:
    """--floor-variant's LABEL=ARGS: a label of its own and floor_chain.py arguments."""
    label, sep, floor_args = text.partition("=")
    if not sep or not label.strip() or "[" in label:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected LABEL=ARGS, a label (without '[') and floor_chain.py "
            "arguments, e.g. 'loops3=--claimers 3'"
        )
    return label.strip(), floor_args


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("PGJOBD_DSN", DEFAULT_DSN))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--n", type=int, default=20_000, help="jobs per drain")
    parser.add_argument("--rounds", default="1:50:all,2:50:all,1:50:none,1:20:all,1:100:all",
                        help="processes:concurrency:history[:def][:batch|:other] per drain "
                        "round; the first is also the statement-log and profile round")  # fmt: skip
    # 1,000: a p99 of 200 jobs is their second slowest, set by one stall of the host.
    parser.add_argument("--trickle", type=int, default=1000, help="jobs; 0 skips")
    parser.add_argument("--trickle-rate", type=float, default=100.0)
    parser.add_argument(
        "--trickle-round",
        type=Round.parse,
        default=TRICKLE_ROUND,
        help="the trickle member's settings, as a round (default 1:50:all)",
    )
    parser.add_argument("--peers", default="pgqueuer",
                        help='peers to run from the harness, e.g. "procrastinate pgqueuer '
                        'chancy oban"; "" for none')  # fmt: skip
    parser.add_argument("--pg-log", help="the server's log file (default: Debian's path)")
    parser.add_argument("--profile", metavar="DIR", help="one extra drain under py-spy")
    parser.add_argument("--floor", action="store_true",
                        help="after each round's drain, one by bench/floor_chain.py: the "
                        "least the architecture's process layout spends")  # fmt: skip
    parser.add_argument("--floor-variant", action="append", default=[],
                        type=floor_variant, metavar="LABEL=ARGS",
                        help="also a floor drain with these floor_chain.py arguments "
                        "(another claim strategy: --claimers, --share, --window-ms); "
                        "repeatable")  # fmt: skip
    parser.add_argument("--json", help="write the raw figures to this file")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    print(f"pgjobd code: {code_state()}", flush=True)
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        measured = runner.run(main(arguments))
    if arguments.json:
        with open(arguments.json, "w") as out:
            json.dump(asdict(measured), out, indent=1, default=str)
