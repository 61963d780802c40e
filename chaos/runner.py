"""One chaos run: a private cluster, M real `pgjobd run` members, a workload, a fault
schedule, quiescence, the invariants, and the evidence folder.

Everything that touches the database from here goes through short-lived connections
that survive the server being restarted under them (they are simply opened again).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from pgjobd import migrate
from pgjobd.embedded import KILL_SAFE_SETTINGS, Cluster, free_port
from pgjobd.leader import unsigned
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.pgbouncer import PgBouncer

from .laggy import LaggyProxy
from .netns import Netns
from .volume import Volume, relocate

SCHEMA = "pgjobd"
DATABASE = "chaos"
LEASE_S = 3
Mix = Callable[[random.Random, int], tuple[str, dict[str, Any]]]
HANDLERS_SRC = Path(__file__).parent / "handlers"
CONNECTION_ERRORS = (
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    TimeoutError,
    ConnectionError,
    asyncpg.InternalClientError,  # a connection broken mid-statement
)

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS public.chaos_ledger (
    seq         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id      bigint      NOT NULL,
    attempt     integer     NOT NULL,
    kind        text        NOT NULL,
    n           integer     NOT NULL,
    member_pid  integer     NOT NULL,
    worker_pid  integer     NOT NULL,
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz NOT NULL,
    outcome     text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    cpu_policy  integer     -- the worker's Linux scheduling policy (NULL elsewhere)
);
ALTER TABLE public.chaos_ledger ADD COLUMN IF NOT EXISTS cpu_policy integer;
-- One row per execution, whatever the retries: a write whose COMMIT answer was lost
-- with a restarting server is written again, and must not look like a second run.
CREATE UNIQUE INDEX IF NOT EXISTS chaos_ledger_execution_idx
    ON public.chaos_ledger (job_id, attempt, worker_pid, started_at);
-- Every handler's first act: proof that an attempt reached a handler.
CREATE TABLE IF NOT EXISTS public.chaos_started (
    job_id      bigint      NOT NULL,
    attempt     integer     NOT NULL,
    worker_pid  integer     NOT NULL,
    started_at  timestamptz NOT NULL,
    PRIMARY KEY (job_id, attempt, worker_pid, started_at)
);
-- The workload as enqueued: written in the enqueue's own transaction, so an enqueue
-- whose COMMIT answer was lost (the server died) is known exactly.
CREATE TABLE IF NOT EXISTS public.chaos_enqueued (
    n       integer PRIMARY KEY,
    job_id  bigint  NOT NULL UNIQUE,
    kind    text    NOT NULL
);
"""


@dataclass
class Member:
    index: int
    generation: int
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float
    stopped_by_us: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class FaultRecord:
    at: float  # seconds since the run started
    action: str
    detail: str
    running_before: dict[int, int] = field(default_factory=dict)  # job id -> fence
    recovered_s: float | None = None


@dataclass
class Options:
    scenario: str
    jobs: int
    members: int
    duration: float
    seed: int
    keep: bool
    quiesce_timeout: float = 300.0
    concurrency: int = 16
    processes: int = 2


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Run:
    """The world of one scenario run."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.rng = random.Random(options.seed)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.evidence = Path(
            tempfile.mkdtemp(prefix=f"pgjobd-chaos-{options.scenario}-s{options.seed}-{stamp}-")
        )
        self.work = Path(tempfile.mkdtemp(prefix="pgjobd-chaos-pg-"))
        self.handlers = self.evidence / "handlers"
        shutil.copytree(HANDLERS_SRC, self.handlers, ignore=shutil.ignore_patterns("__pycache__"))
        self.cluster = Cluster(
            self.work / "data",
            port=free_port(),
            settings={**KILL_SAFE_SETTINGS, "max_connections": "300"},
        )
        self.members: list[Member] = []  # every member ever started
        self.slots: list[Member | None] = [None] * options.members
        self.faults: list[FaultRecord] = []
        self.violations: list[str] = []
        self.notes: list[str] = []
        self.t0 = time.monotonic()
        self.enqueue_done = asyncio.Event()
        self.stop_background = asyncio.Event()
        self.leader_samples = 0
        self.leader_multi: list[str] = []
        self.config_path = self.evidence / "pgjobd.toml"
        self.extra_queues = ""
        self.daemon_overrides: dict[str, str] = {}
        self.member_kills: list[tuple[int, float]] = []  # (member pid, wall time)
        # The member in slot 0 in a network namespace of its own (use_netns).
        self.netns: Netns | None = None
        # A streaming replica of the cluster (use_replica), and the DSN naming both.
        self.replica: Cluster | None = None
        self.wants_replica = False
        self.multi_host_dsn: str | None = None
        # Slot 0's member reaches the server through a proxy that adds latency and
        # loss on demand (chaos/laggy.py).
        self.laggy: LaggyProxy | None = None
        self.wants_laggy = False
        # A stock PgBouncer in front of the cluster for the members' pools (use_pooler).
        self.bouncer: PgBouncer | None = None
        self.wants_pooler = False
        # /readyz answers: (t, member pid, phase, HTTP status or None, body)
        self.readiness: list[tuple[float, int, str, int | None, str]] = []
        # The server's pg_wal, or its data directory, on a small tmpfs (use_volume).
        self.volume: Volume | None = None
        self.volume_holds = ""
        # Enqueue tries the server refused: (t, the batch's first n, its jobs, the error).
        self.refused_enqueues: list[tuple[float, int, int, str]] = []
        # Batches whose failed try had committed after all (its answer lost): first n.
        self.enqueues_answer_lost: list[int] = []

    # ------------------------------------------------------------------ plumbing

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    @property
    def dsn(self) -> str:
        """The database; with a replica, both hosts, read-write wanted (whichever is
        primary)."""
        return self.multi_host_dsn or self.cluster.dsn(DATABASE)

    async def connect(self, timeout: float = 5.0) -> asyncpg.Connection:  # noqa: ASYNC109
        return await asyncpg.connect(
            self.dsn, timeout=timeout, server_settings={"application_name": "chaos runner"}
        )

    async def query(self, sql: str, *args: Any, retry_s: float = 120.0) -> list[asyncpg.Record]:
        """One statement on a fresh connection, retried while the server is away."""
        deadline = time.monotonic() + retry_s
        while True:
            try:
                conn = await self.connect()
                try:
                    rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
                    return rows
                finally:
                    await conn.close(timeout=2)
            except CONNECTION_ERRORS:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    def write_config(self) -> None:
        daemon = {
            "handlers": json.dumps([str(self.handlers)]),
            "lease": f'"{LEASE_S}s"',
            "drain_timeout": '"5s"',
            "metrics_listen": '""',
            "log_format": '"text"',
            **self.daemon_overrides,
        }
        o = self.options
        pooled = f'pooler = "transaction"\nleader_dsn = "{self.dsn}"\n' if self.bouncer else ""
        self.config_path.write_text(
            f'[database]\nschema = "{SCHEMA}"\npool_max = 6\nconnect_timeout = "3s"\n'
            + pooled
            + "\n"
            "[daemon]\n"
            + "".join(f"{k} = {v}\n" for k, v in daemon.items())
            + f"\n[queues.default]\nconcurrency = {o.concurrency}\nprocesses = {o.processes}\n"
            'timeout = "30s"\nmax_attempts = 25\nbackoff_base = "10ms"\nbackoff_max = "200ms"\n'
            'max_crashes = 10\nhistory = "all"\n'
            + self.extra_queues
            + '\n[[cron]]\nname = "chaos-minutely"\nschedule = "* * * * *"\n'
            'kind = "chaos_cron"\ncatch_up = "latest"\n'
        )

    # ------------------------------------------------------------------ setup

    def use_netns(self) -> None:
        """Put slot 0's member in a network namespace of its own, linked to the host by
        a veth pair the server also listens on."""
        self.netns = Netns.create(os.getpid())
        self.cluster.settings["listen_addresses"] = f"127.0.0.1,{self.netns.host_ip}"

    def use_volume(self, holds: str, size_mb: int, max_wal_mb: int) -> None:
        """Put the server's pg_wal (`holds` "wal") or its data directory ("data": pg_wal
        and the server log kept off it) on a tmpfs of `size_mb`, mounted now and filled
        by the scenario; checkpoints often enough that normal load fits."""
        where = self.work / "wal" if holds == "wal" else self.cluster.data_dir
        self.volume = Volume.mount(where, size_mb)
        self.volume_holds = holds
        self.cluster.settings.update(
            {"max_wal_size": f"{max_wal_mb}MB", "min_wal_size": "32MB"}  # 2 segments
        )

    def _arrange_volume(self) -> None:
        assert self.volume is not None
        identity = self.cluster.identity
        data = self.cluster.data_dir
        if self.volume_holds == "wal":
            relocate(data / "pg_wal", self.volume.path, identity.uid, identity.gid)
            return
        # Only the data fills: the WAL and the server's log stay on the ordinary disk.
        relocate(data / "pg_wal", self.work / "wal", identity.uid, identity.gid)
        server_log = self.work / "server.log"
        server_log.touch()
        self.cluster.log_path.symlink_to(server_log)

    def member_dsn(self, slot: int) -> str:
        if slot == 0 and self.laggy is not None:
            return self.dsn.replace(f"@127.0.0.1:{self.cluster.port}/",
                                    f"@127.0.0.1:{self.laggy.port}/")  # fmt: skip
        if self.netns is None or slot != 0:
            return self.dsn
        return self.dsn.replace("@127.0.0.1:", f"@{self.netns.host_ip}:")

    async def setup(self) -> None:
        log(f"evidence folder: {self.evidence}")
        if self.netns is not None:
            await asyncio.to_thread(self.cluster.init)
            with (self.cluster.data_dir / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {self.netns.subnet} trust\n")
        if self.volume is not None:
            await asyncio.to_thread(self.cluster.init)
            self._arrange_volume()
        await asyncio.to_thread(self.cluster.start)
        await self.cluster.ensure_database(DATABASE)
        conn = await self.connect()
        try:
            await migrate.migrate(conn, SCHEMA)
            await conn.execute(LEDGER_DDL)
        finally:
            await conn.close()
        if self.wants_replica:
            await self._start_replica()
        if self.wants_laggy:
            seeded = random.Random(self.rng.random())
            self.laggy = LaggyProxy("127.0.0.1", self.cluster.port, seeded)
            await self.laggy.start()
            log(f"member0's link: a proxy on port {self.laggy.port}")
        if self.wants_pooler:
            self.bouncer = await asyncio.to_thread(PgBouncer.start, self.dsn)
            log(f"pgbouncer (stock, transaction mode) on port {self.bouncer.port}")
        self.write_config()
        for slot in range(self.options.members):
            self.start_member(slot)
        await self.wait_members_ready()
        self.t0 = time.monotonic()  # the fault window starts now

    async def _start_replica(self) -> None:
        """A streaming replica of the cluster (pg_basebackup -R), then synchronous
        replication on: a commit is acknowledged once the replica has it."""
        data = self.work / "replica"
        await asyncio.to_thread(
            subprocess.run,
            [str(self.cluster.binaries.program("pg_basebackup")), "-D", str(data), "-R",
             "-X", "stream", "--checkpoint=fast", "-h", "127.0.0.1",
             "-p", str(self.cluster.port), "-U", "postgres"],
            check=True, capture_output=True,
        )  # fmt: skip
        data.chmod(0o700)
        # A standby needs at least the primary's max_connections (and the like).
        self.replica = Cluster(data, port=free_port(), binaries=self.cluster.binaries,
                               settings=self.cluster.settings)  # fmt: skip
        await asyncio.to_thread(self.replica.start)
        conn = await asyncpg.connect(self.cluster.dsn(DATABASE))
        try:
            await conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            await conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 60
            while not await conn.fetchval(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not become a synchronous standby")
                await asyncio.sleep(0.1)
        finally:
            await conn.close()
        self.multi_host_dsn = (
            f"postgresql://postgres@127.0.0.1:{self.cluster.port},127.0.0.1:{self.replica.port}"
            f"/{DATABASE}?target_session_attrs=read-write"
        )
        log(f"replica on port {self.replica.port}, synchronous; DSN {self.multi_host_dsn}")

    def restart_pooler(self) -> None:
        """PgBouncer again on the same port, after it died."""
        assert self.bouncer is not None
        port = self.bouncer.port
        restarts = len(list(self.evidence.glob("pgbouncer-*.log")))
        with contextlib.suppress(OSError):
            shutil.copy(self.bouncer.directory / "pgbouncer.log",
                        self.evidence / f"pgbouncer-{restarts}.log")  # fmt: skip
        self.bouncer.stop()
        self.bouncer = PgBouncer.start(self.dsn, port=port)

    def start_member(self, slot: int) -> Member:
        generation = sum(1 for m in self.members if m.index == slot)
        log_path = self.evidence / f"member{slot}-{generation}.log"
        dsn = self.member_dsn(slot)
        pool_dsn = self.bouncer.dsn() if self.bouncer is not None else dsn
        env = {**os.environ, "PGJOBD_DSN": pool_dsn, "CHAOS_LEDGER_DSN": dsn}
        env.pop("DATABASE_URL", None)
        command = [sys.executable, "-m", "pgjobd", "run", "--config", str(self.config_path)]
        if self.netns is not None and slot == 0:
            command = self.netns.command(command)  # `ip netns exec` execs: same pid
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: group signals reach it alone
            )
        member = Member(slot, generation, process, log_path, self.elapsed())
        self.members.append(member)
        self.slots[slot] = member
        return member

    async def wait_members_ready(self, within_s: float = 60.0) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            pids = {m.pid for m in self.live_members()}
            rows = await self.query(f"SELECT pid FROM {SCHEMA}.member")
            if pids <= {r["pid"] for r in rows}:
                return
            for m in self.live_members():
                if not m.alive:
                    raise RuntimeError(f"member {m.log_path.name} exited at start")
            await asyncio.sleep(0.1)
        raise RuntimeError("members not ready in time")

    def live_members(self) -> list[Member]:
        return [m for m in self.slots if m is not None and m.alive]

    # ------------------------------------------------------------------ workload

    async def enqueue(self, mix: Mix, fan_in: bool = False) -> None:
        """Enqueues the workload in batches spread over 60% of the fault window. With
        `fan_in`, each batch also gets a callback that depends on all its jobs (its `n`
        is -1 - the batch's first n; in the batch's own transaction)."""
        total = self.options.jobs
        rng = random.Random(self.options.seed + 1)  # the workload has its own stream
        plan = [mix(rng, n) for n in range(total)]
        batches = max(1, int(self.options.duration * 0.6 / 0.2))
        size = max(1, -(-total // batches))
        start = time.monotonic()
        for b, first in enumerate(range(0, total, size)):
            chunk = list(range(first, min(first + size, total)))
            await self._enqueue_batch(chunk, plan, fan_in)
            next_at = start + (b + 1) * 0.2
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        self.enqueue_done.set()
        log(f"enqueued {total} jobs")

    async def _enqueue_batch(
        self, chunk: list[int], plan: list[tuple[str, dict[str, Any]]], fan_in: bool = False
    ) -> None:
        kinds = [plan[n][0] for n in chunk]
        args = [json.dumps({**plan[n][1], "n": n}) for n in chunk]
        sql = (
            "WITH e AS (SELECT t.n, t.kind, "
            f"{SCHEMA}.enqueue(t.kind, t.args::jsonb, group_key => t.args::jsonb->>'group', "
            "tenant => t.args::jsonb->>'tenant') AS id "
            "FROM unnest($1::int[], $2::text[], $3::text[]) AS t(n, kind, args)) "
            "INSERT INTO public.chaos_enqueued (n, job_id, kind) SELECT n, id, kind FROM e"
        )
        if fan_in:
            callback = -1 - chunk[0]
            sql = (
                f"WITH batch AS ({sql} RETURNING job_id) "
                "INSERT INTO public.chaos_enqueued (n, job_id, kind) "
                f"SELECT {callback}, {SCHEMA}.enqueue('chaos_work', "
                f"jsonb_build_object('n', {callback}, 'ms', 5), "
                "depends_on => ARRAY(SELECT job_id FROM batch)), 'chaos_work'"
            )
        deadline = time.monotonic() + 180
        while True:
            try:
                conn = await self.connect()
                try:
                    done = await conn.fetchval(
                        "SELECT count(*) FROM public.chaos_enqueued WHERE n = ANY($1::int[])",
                        chunk,
                    )
                    if done == len(chunk):
                        self.enqueues_answer_lost.append(chunk[0])
                        return  # an earlier try committed, its answer was lost
                    if done:
                        raise RuntimeError(f"batch {chunk[0]}: partly enqueued ({done})")
                    await conn.execute(sql, chunk, kinds, args)
                    return
                finally:
                    with contextlib.suppress(*CONNECTION_ERRORS):
                        await conn.close(timeout=2)
            except CONNECTION_ERRORS as e:
                refused = (self.elapsed(), chunk[0], len(chunk), f"{type(e).__name__}: {e}")
                self.refused_enqueues.append(refused)
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ background

    async def sample_leaders(self) -> None:
        """Every ~100 ms: who holds the leader lock, and which term is the newest."""
        k1, k2 = unsigned(lock_key(LEADER, SCHEMA))
        sql = (
            "SELECT ARRAY(SELECT pid FROM pg_locks WHERE locktype = 'advisory' "
            "AND classid::bigint = $1 AND objid::bigint = $2 AND objsubid = 2 AND granted) "
            "AS holders, "
            f"(SELECT row(term, backend_pid)::text FROM {SCHEMA}.leader "
            "ORDER BY term DESC LIMIT 1) AS newest"
        )
        conn: asyncpg.Connection | None = None
        while not self.stop_background.is_set():
            try:
                if conn is None or conn.is_closed():
                    conn = await self.connect(timeout=2)
                row = await conn.fetchrow(sql, k1, k2)
                self.leader_samples += 1
                if row is not None and len(row["holders"]) > 1:
                    self.leader_multi.append(
                        f"t={self.elapsed():.2f}s lock holders {row['holders']} newest "
                        f"term {row['newest']}"
                    )
            except CONNECTION_ERRORS:
                if conn is not None:
                    conn.terminate()
                conn = None
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.1)
        if conn is not None:
            with contextlib.suppress(*CONNECTION_ERRORS):
                await conn.close(timeout=2)

    async def track_recovery(self) -> None:
        """For each fault: seconds until every job running just before it moved on
        (finished, or claimed again under a new fence)."""
        while not self.stop_background.is_set():
            pending = [f for f in self.faults if f.recovered_s is None]
            ids = sorted({i for f in pending for i in f.running_before})
            if ids:
                try:
                    rows = await self.query(
                        f"SELECT id, fence FROM {SCHEMA}.job WHERE id = ANY($1::bigint[])",
                        ids,
                        retry_s=1,
                    )
                    now_fence = {r["id"]: r["fence"] for r in rows}
                    for f in pending:
                        if all(
                            i not in now_fence or now_fence[i] != fence
                            for i, fence in f.running_before.items()
                        ):
                            f.recovered_s = max(0.0, self.elapsed() - f.at)
                except CONNECTION_ERRORS:
                    pass
            else:
                for f in pending:
                    f.recovered_s = 0.0
            await asyncio.sleep(0.1)

    async def watch_members(self) -> None:
        """A member that exits without being told to is a violation (and is replaced)."""
        while not self.stop_background.is_set():
            for slot, m in enumerate(self.slots):
                if m is not None and not m.alive and not m.stopped_by_us:
                    m.stopped_by_us = True
                    self.violations.append(
                        f"member {m.log_path.name} (pid {m.pid}) exited by itself with "
                        f"status {m.process.returncode} at t={self.elapsed():.1f}s"
                    )
                    self.start_member(slot)
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ faults

    async def fault(self, action: str, detail: str, inject: Callable[[], Awaitable[None]]) -> None:
        """Snapshots the running jobs, then injects; the tracker times the recovery."""
        running: dict[int, int] = {}
        with contextlib.suppress(*CONNECTION_ERRORS):
            rows = await self.query(
                f"SELECT id, fence FROM {SCHEMA}.job WHERE state = 'running'", retry_s=2
            )
            running = {r["id"]: r["fence"] for r in rows}
        record = FaultRecord(self.elapsed(), action, detail, running)
        await inject()
        self.faults.append(record)
        log(f"fault t={record.at:.1f}s {action} {detail} ({len(running)} jobs running)")

    def kill_member(self, member: Member, sig: int = signal.SIGKILL) -> None:
        member.stopped_by_us = True
        self.member_kills.append((member.pid, time.time()))
        with contextlib.suppress(ProcessLookupError):
            os.kill(member.pid, sig)

    def metrics_port(self, member: Member) -> int | None:
        """The port a member (with metrics_listen on port 0) said it serves on."""
        found = re.search(rb"/readyz on [^:\s]+:(\d+)", member.log_path.read_bytes())
        return int(found[1]) if found else None

    def worker_pids(self, member: Member) -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                status = (proc / "status").read_text()
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if f"\nPPid:\t{member.pid}\n" in status and b"worker" in cmdline:
                found.append(int(proc.name))
        return sorted(found)

    async def leader_member(self, within_s: float = 30.0) -> Member | None:
        k1, k2 = unsigned(lock_key(LEADER, SCHEMA))
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            rows = await self.query(
                f"SELECT l.member FROM {SCHEMA}.leader AS l JOIN pg_locks AS k "
                "ON k.pid = l.backend_pid AND k.locktype = 'advisory' AND k.granted "
                "AND k.classid::bigint = $1 AND k.objid::bigint = $2 AND k.objsubid = 2 "
                "ORDER BY l.term DESC LIMIT 1",
                k1,
                k2,
            )
            if rows:
                pid = int(rows[0]["member"].split(":")[1])
                for m in self.live_members():
                    if m.pid == pid:
                        return m
            await asyncio.sleep(0.1)
        return None

    # ------------------------------------------------------------------ the end

    async def wait_quiescent(self) -> float | None:
        """Seconds until the hot table is empty and no member holds a job (None: timeout)."""
        await self.enqueue_done.wait()
        started = time.monotonic()
        deadline = started + self.options.quiesce_timeout
        while time.monotonic() < deadline:
            rows = await self.query(
                f"SELECT (SELECT count(*) FROM {SCHEMA}.job) AS live, "
                "(SELECT count(*) FROM public.chaos_enqueued) AS enqueued"
            )
            # (at least: a fan-in run also enqueues a callback per batch)
            if rows[0]["live"] == 0 and rows[0]["enqueued"] >= self.options.jobs:
                return time.monotonic() - started
            await asyncio.sleep(0.25)
        return None

    async def stop_members(self) -> None:
        for m in self.live_members():
            m.stopped_by_us = True
            m.process.send_signal(signal.SIGTERM)
        for m in self.members:
            try:
                code = await asyncio.to_thread(m.process.wait, 40)
            except subprocess.TimeoutExpired:
                self.violations.append(f"member {m.log_path.name} ignored SIGTERM for 40s")
                m.process.kill()
                code = await asyncio.to_thread(m.process.wait)
            m.stopped_by_us = True
            _ = code

    async def dump(self) -> dict[str, list[dict[str, Any]]]:
        """The final tables, as CSV files in the evidence folder and as rows for checks."""
        tables = {
            "job": f"SELECT * FROM {SCHEMA}.job ORDER BY id",
            "job_history": f"SELECT * FROM {SCHEMA}.job_history ORDER BY id, finished_at",
            "job_attempt": f"SELECT * FROM {SCHEMA}.job_attempt ORDER BY job_id, attempt",
            "leader": f"SELECT * FROM {SCHEMA}.leader ORDER BY term",
            "member": f"SELECT * FROM {SCHEMA}.member",
            "cron": f"SELECT * FROM {SCHEMA}.cron",
            "chaos_ledger": "SELECT * FROM public.chaos_ledger ORDER BY job_id, started_at",
            "chaos_enqueued": "SELECT * FROM public.chaos_enqueued ORDER BY n",
            "chaos_started": "SELECT * FROM public.chaos_started ORDER BY job_id, attempt",
        }
        out: dict[str, list[dict[str, Any]]] = {}
        for name, sql in tables.items():
            rows = [dict(r) for r in await self.query(sql)]
            out[name] = rows
            with (self.evidence / f"{name}.csv").open("w", newline="") as f:
                if rows:
                    writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
                    writer.writeheader()
                    writer.writerows(rows)
        return out

    def write_faults(self) -> None:
        with (self.evidence / "faults.json").open("w") as f:
            json.dump(
                [
                    {
                        "at_s": round(x.at, 3),
                        "action": x.action,
                        "detail": x.detail,
                        "jobs_running_before": len(x.running_before),
                        "recovered_s": None if x.recovered_s is None else round(x.recovered_s, 3),
                    }
                    for x in self.faults
                ],
                f,
                indent=1,
            )

    def cleanup(self, keep: bool) -> None:
        with contextlib.suppress(Exception):
            shutil.copy(self.cluster.log_path, self.evidence / "postgresql.log")
        for m in self.members:
            if m.alive:
                m.process.kill()
                m.process.wait()
        with contextlib.suppress(Exception):
            self.cluster.stop("immediate")
        if self.replica is not None:
            with contextlib.suppress(Exception):
                shutil.copy(self.replica.log_path, self.evidence / "postgresql-replica.log")
            with contextlib.suppress(Exception):
                self.replica.stop("immediate")
        if self.bouncer is not None:
            with contextlib.suppress(Exception):
                shutil.copy(self.bouncer.directory / "pgbouncer.log",
                            self.evidence / "pgbouncer.log")  # fmt: skip
            self.bouncer.stop()
        if self.netns is not None:
            self.netns.destroy()
        if self.volume is not None:
            with contextlib.suppress(Exception):
                self.volume.unmount()
        shutil.rmtree(self.work, ignore_errors=True)
        if not keep:
            shutil.rmtree(self.evidence, ignore_errors=True)
