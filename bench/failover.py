"""Failover of a fleet of real `pgjobd run` members under load: SIGKILL the leader, again
and again, and time the takeover and the return of the dead member's jobs.

    /work/venv/bin/python bench/failover.py [--kills 20] [--lease 30s] [--members 3]
        [--rate 8] [--dsn DSN] [--json out.json]

One run, one database (`--dsn`, else $PGJOBD_DSN, else
postgresql://root@127.0.0.1:5432/test); schema ``bench_failover`` is created fresh and
dropped at the end. `--members` members (subprocesses, a temp config: one queue,
concurrency 8 over 2 worker processes, max_crashes 1000 so that a job orphaned by
several kills in a row is not quarantined, lease `--lease`, the handlers of
bench/failover_handlers) serve a steady trickle of `--rate` jobs/s, each sleeping a
random 0.5-2 s. Then, `--kills` times: wait until the leader has jobs running, SIGKILL
the leader's member process (its worker processes are left to notice on their own, as
after a crash of the member alone), start a replacement member so the fleet stays at
`--members`, and measure:

- **new leader**: from the kill (wall clock just after kill(2)) to the `elected_at` of
  the next term's row in `<schema>.leader` (set by the database in the new leader's
  session), counted only once that row's backend is seen holding the leader lock.
- **orphans available**: the jobs the killed member was running (state 'running',
  owner = its member id, read 0.5 s after the kill, when its sessions are gone and any
  statement they had in flight has finished): from the kill to the `failed_at` of the
  job_attempt row with outcome 'lease_expired' that the new leader's reaper wrote
  for that attempt. Per kill: the last of its orphans.
- **orphans running again**: from the kill to the moment another member claimed each
  orphan again (`attempted_at` of the next attempt, read from the job or, if it has
  already finished, its job_history record). Per kill: the last of its orphans;
  per job: every orphan.

A kill's orphans must all be running again before the next kill (timeout: lease + 60 s).
Targets (issue 5): new leader median < 2 s and max < 5 s; orphans running again within
lease + the reaper's interval (5 s). The printed table gives median and max of each.
Not a test: it prints figures and met/missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import asyncpg

from pgjobd.client import Client
from pgjobd.duration import parse_duration
from pgjobd.leader import unsigned
from pgjobd.lock_keys import LEADER, lock_key
from pgjobd.migrate import migrate
from pgjobd.roles.reaper import INTERVAL_S as REAPER_INTERVAL_S

SCHEMA = "bench_failover"
DEFAULT_DSN = "postgresql://root@127.0.0.1:5432/test"
HERE = Path(__file__).resolve().parent
HANDLERS = HERE / "failover_handlers"
POLL_S = 0.01
ORPHAN_SNAPSHOT_DELAY_S = 0.5
NEW_LEADER_MEDIAN_S = 2.0
NEW_LEADER_MAX_S = 5.0


@dataclass
class Member:
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class Kill:
    n: int
    term: int
    member: str
    new_leader_s: float
    orphans: int = 0
    available_s: list[float] = field(default_factory=list)
    running_again_s: list[float] = field(default_factory=list)
    lease_expired_rows: int = 0
    dead: int = 0  # orphans that the reaper declared dead instead (should stay 0)


class Fleet:
    def __init__(self, dsn: str, workdir: Path, lease: str, members: int) -> None:
        self.dsn = dsn
        self.workdir = workdir
        self.size = members
        self.config = workdir / "pgjobd.toml"
        self.config.write_text(
            f'[database]\nschema = "{SCHEMA}"\n\n'
            f'[daemon]\nhandlers = ["{HANDLERS}"]\nmetrics_listen = ""\nlog_format = "text"\n'
            f'lease = "{lease}"\ndrain_timeout = "5s"\n\n'
            # A job orphaned by max_crashes kills in a row would be quarantined (dead,
            # worker_crash), and this measures failover, not that policy.
            "[queues.default]\nconcurrency = 8\nprocesses = 2\nmax_crashes = 1000\n"
        )
        self.members: list[Member] = []
        self.started = 0

    def start(self) -> Member:
        log = self.workdir / f"member{self.started}.log"
        self.started += 1
        env = {**os.environ, "PGJOBD_DSN": self.dsn}
        env.pop("DATABASE_URL", None)
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "pgjobd", "run", "--config", str(self.config)],
                stdout=out, stderr=out, env=env, start_new_session=True,
            )  # fmt: skip
        member = Member(process, log)
        self.members.append(member)
        return member

    async def wait_ready(self, conn: asyncpg.Connection, member: Member) -> None:
        deadline = time.monotonic() + 60
        while not await conn.fetchval(
            f"SELECT count(*) FROM {SCHEMA}.member WHERE pid = $1", member.pid
        ):
            if member.process.poll() is not None:
                raise SystemExit(f"member exited {member.process.returncode}:\n{_tail(member)}")
            if time.monotonic() > deadline:
                raise SystemExit(f"member {member.pid} not ready after 60 s:\n{_tail(member)}")
            await asyncio.sleep(0.05)

    def by_pid(self, pid: int) -> Member | None:
        return next((m for m in self.members if m.pid == pid), None)

    def stop_all(self) -> None:
        for member in self.members:
            if member.process.poll() is None:
                member.process.send_signal(signal.SIGTERM)
        for member in self.members:
            try:
                member.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait()
            _kill_group(member)


def _kill_group(member: Member) -> None:
    """The member's leftover worker processes, if any (they are in its session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(member.pid, signal.SIGKILL)


def _tail(member: Member) -> str:
    return member.log.read_text(errors="replace")[-3000:]


async def current_leader(conn: asyncpg.Connection) -> asyncpg.Record | None:
    """The latest term, if its backend holds the leader lock now."""
    k1, k2 = unsigned(lock_key(LEADER, SCHEMA))
    row: asyncpg.Record | None = await conn.fetchrow(
        f"SELECT l.term, l.member, l.backend_pid, l.elected_at FROM {SCHEMA}.leader AS l "
        "WHERE EXISTS (SELECT FROM pg_locks AS k WHERE k.locktype = 'advisory' "
        "  AND k.classid::bigint = $1 AND k.objid::bigint = $2 AND k.objsubid = 2 "
        "  AND k.pid = l.backend_pid AND k.granted) "
        "ORDER BY l.term DESC LIMIT 1",
        k1, k2,
    )  # fmt: skip
    return row


async def load(client: Client, rate: float, stop: asyncio.Event, rng: random.Random) -> int:
    """A steady trickle of sleepy jobs until `stop`; returns how many were enqueued."""
    sent = 0
    started = time.monotonic()
    while not stop.is_set():
        await client.enqueue("failover_sleep", {"s": round(rng.uniform(0.5, 2.0), 3)})
        sent += 1
        delay = started + sent / rate - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
    return sent


async def kill_leader(
    n: int, conn: asyncpg.Connection, fleet: Fleet, lease_s: float, rng: random.Random
) -> Kill:
    # A leader with jobs in hand (else there is nothing to orphan).
    deadline = time.monotonic() + 30
    while True:
        leader = await current_leader(conn)
        if leader is not None:
            running = await conn.fetchval(
                f"SELECT count(*) FROM {SCHEMA}.job WHERE state = 'running' AND owner = $1",
                leader["member"],
            )
            if running or time.monotonic() > deadline:
                break
        await asyncio.sleep(0.05)
    member = fleet.by_pid(int(leader["member"].split(":")[1]))
    if member is None:
        raise SystemExit(f"the leader {leader['member']} is not one of ours")
    os.kill(member.pid, signal.SIGKILL)
    killed_at = time.time()
    fleet.members.remove(member)

    # The new leader: a later term whose backend holds the lock.
    deadline = time.monotonic() + 60
    while True:
        new = await current_leader(conn)
        if new is not None and new["term"] > leader["term"]:
            break
        if time.monotonic() > deadline:
            raise SystemExit("no new leader within 60 s")
        await asyncio.sleep(POLL_S)
    elected_at: datetime = new["elected_at"]
    kill = Kill(n, leader["term"], leader["member"], elected_at.timestamp() - killed_at)

    # What it left running: read once its sessions are gone.
    await asyncio.sleep(max(0.0, killed_at + ORPHAN_SNAPSHOT_DELAY_S - time.time()))
    orphans = {
        r["id"]: r["attempt"]
        for r in await conn.fetch(
            f"SELECT id, attempt FROM {SCHEMA}.job WHERE state = 'running' AND owner = $1",
            leader["member"],
        )
    }
    kill.orphans = len(orphans)
    member.process.wait()
    fleet.start()  # back to full strength; ready-wait below, with the orphans

    again: dict[int, float] = {}
    deadline = time.monotonic() + lease_s + 60
    dead: set[int] = set()
    while len(again) + len(dead) < len(orphans):
        rows = await conn.fetch(
            f"SELECT id, attempt, attempted_at, NULL AS state FROM {SCHEMA}.job "
            "WHERE id = ANY($1) "
            f"UNION ALL SELECT id, attempt, attempted_at, state::text FROM {SCHEMA}.job_history "
            "WHERE id = ANY($1)",
            list(orphans),
        )
        for row in rows:
            if row["attempt"] > orphans[row["id"]] and row["id"] not in again:
                again[row["id"]] = row["attempted_at"].timestamp() - killed_at
            elif row["attempt"] == orphans[row["id"]] and row["state"] == "dead":
                dead.add(row["id"])
        if time.monotonic() > deadline:
            print(f"kill {n}: {len(orphans) - len(again)} orphans not back", file=sys.stderr)
            break
        await asyncio.sleep(0.05)
    kill.running_again_s = sorted(again.values())
    kill.dead = len(dead)
    reaped = await conn.fetch(
        f"SELECT a.job_id, a.failed_at FROM {SCHEMA}.job_attempt AS a "
        "WHERE a.outcome = 'lease_expired' AND a.member = $1",
        leader["member"],
    )
    kill.lease_expired_rows = len(reaped)
    kill.available_s = sorted(
        r["failed_at"].timestamp() - killed_at for r in reaped if r["job_id"] in orphans
    )
    _kill_group(member)
    for fresh in fleet.members:
        await fleet.wait_ready(conn, fresh)
    await asyncio.sleep(rng.uniform(1.0, 2.0))  # let the new leader settle, vary phase
    return kill


def _stats(values: list[float]) -> tuple[int, float | None, float | None]:
    if not values:
        return 0, None, None
    return len(values), statistics.median(values), max(values)


def report(kills: list[Kill], lease_s: float, args: argparse.Namespace) -> str:
    orphan_target = lease_s + REAPER_INTERVAL_S
    rows = [
        ("new leader", [k.new_leader_s for k in kills],
         f"median < {NEW_LEADER_MEDIAN_S:g} s, max < {NEW_LEADER_MAX_S:g} s",
         lambda med, mx: med < NEW_LEADER_MEDIAN_S and mx < NEW_LEADER_MAX_S),
        ("orphans available (per kill, last)", [max(k.available_s) for k in kills if
                                                k.available_s], "", None),
        ("orphans running again (per kill, last)", [max(k.running_again_s) for k in kills if
                                                    k.running_again_s],
         f"max < lease + reaper = {orphan_target:g} s", lambda med, mx: mx < orphan_target),
        ("orphans running again (per job)", [s for k in kills for s in k.running_again_s],
         f"max < {orphan_target:g} s", lambda med, mx: mx < orphan_target),
    ]  # fmt: skip
    lines = [
        f"failover: {len(kills)} kills of the leader, {args.members} members, lease "
        f"{args.lease}, reaper every {REAPER_INTERVAL_S:g} s, load {args.rate:g} jobs/s "
        "of 0.5-2 s",
        f"orphaned jobs: {sum(k.orphans for k in kills)} "
        f"(lease_expired rows for them: {sum(len(k.available_s) for k in kills)}, "
        f"running again: {sum(len(k.running_again_s) for k in kills)}, "
        f"dead instead: {sum(k.dead for k in kills)})",
        "",
        f"{'measure':<40} {'n':>4} {'median s':>9} {'max s':>8}  target",
    ]
    for name, values, target, check in rows:
        n, med, mx = _stats(values)
        verdict = ""
        if check is not None and med is not None and mx is not None:
            verdict = "  met" if check(med, mx) else "  MISSED"
        lines.append(f"{name:<40} {n:>4} {_fmt(med):>9} {_fmt(mx):>8}  {target}{verdict}".rstrip())
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--lease", default="30s", help='member lease, e.g. "5s" (default 30s)')
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--rate", type=float, default=8.0, help="jobs enqueued per second")
    parser.add_argument("--dsn", default=os.environ.get("PGJOBD_DSN") or DEFAULT_DSN)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args()
    lease_s = parse_duration(args.lease).total_seconds()
    rng = random.Random(args.seed)

    conn = await asyncpg.connect(args.dsn)
    await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    await migrate(conn, SCHEMA)
    kills: list[Kill] = []
    enqueued = 0
    with tempfile.TemporaryDirectory(prefix="pgjobd-failover-") as tmp:
        fleet = Fleet(args.dsn, Path(tmp), args.lease, args.members)
        stop = asyncio.Event()
        try:
            for _ in range(args.members):
                fleet.start()
            for member in list(fleet.members):
                await fleet.wait_ready(conn, member)
            async with await Client.connect(args.dsn, schema=SCHEMA) as client:
                loader = asyncio.create_task(load(client, args.rate, stop, rng))
                await asyncio.sleep(3)  # every member busy
                for n in range(1, args.kills + 1):
                    kill = await kill_leader(n, conn, fleet, lease_s, rng)
                    kills.append(kill)
                    print(
                        f"kill {n:>2}: term {kill.term}, new leader after "
                        f"{kill.new_leader_s:.2f} s, {kill.orphans} orphans running again "
                        f"after max {max(kill.running_again_s, default=0):.2f} s",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
                stop.set()
                enqueued = await loader
        finally:
            stop.set()
            fleet.stop_all()
            await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            await conn.close()
    print(report(kills, lease_s, args))
    print(f"enqueued {enqueued} jobs")
    if args.json:
        args.json.write_text(json.dumps([asdict(k) for k in kills], indent=1))


if __name__ == "__main__":
    asyncio.run(main())
