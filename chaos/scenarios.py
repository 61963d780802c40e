"""The scenarios: a workload mix and a fault schedule each, driven by the run's seeded
random.Random so that a seed replays the same choices (which victim, when, how)."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import datetime
import os
import random
import re
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from .laggy import Impairment
from .runner import (
    CONNECTION_ERRORS,
    DATABASE,
    LEASE_S,
    SCHEMA,
    FaultRecord,
    Member,
    Mix,
    Run,
    log,
)  # fmt: skip


def plain_mix(rng: random.Random, n: int) -> tuple[str, dict[str, Any]]:
    return "chaos_work", {"ms": rng.randint(20, 200)}


def nasty_mix(rng: random.Random, n: int) -> tuple[str, dict[str, Any]]:
    """Mostly plain work, with handlers that crash, hang, fail, or outlive the lease."""
    x = rng.random()
    if x < 0.04:
        return "chaos_crash_once", {}
    if x < 0.07:
        return "chaos_raise_once", {"ms": 5}
    if x < 0.075:
        return "chaos_hang_soft", {}
    if x < 0.078:
        return "chaos_hang_hard", {}
    if x < 0.088:
        return "chaos_past_lease", {"ms": rng.randint(3500, 6000)}
    if x < 0.09:
        return "chaos_poison", {}
    return plain_mix(rng, n)


def quick_mix(rng: random.Random, n: int) -> tuple[str, dict[str, Any]]:
    """Short jobs: members claim all the time, so a signal is likely to land mid-claim."""
    return "chaos_work", {"ms": rng.randint(1, 30)}


def long_mix(rng: random.Random, n: int) -> tuple[str, dict[str, Any]]:
    """A fifth of the jobs run 1-2.5 s: a member always holds some when a fault lands."""
    if rng.random() < 0.2:
        return "chaos_work", {"ms": rng.randint(1000, 2500)}
    return plain_mix(rng, n)


def swap_mix(rng: random.Random, n: int) -> tuple[str, dict[str, Any]]:
    if rng.random() < 0.3:
        return "chaos_swap", {}
    return plain_mix(rng, n)


# The `limits` scenario's queues: what invariants.check_limits holds the ledger to.
LIMITED_CONCURRENCY = 4
LIMITED_RATE = (40, 1.0)  # starts per window (s)
# A queue whose only limit is its global_concurrency: it reserves its places under the
# lock and claims them without it (flow_reserve, job_claim_reserved).
RESERVED_CONCURRENCY = 3
LIMITS_QUEUES = f"""
[queues.limited]
concurrency = 6
processes = 2
max_attempts = 25
backoff_base = "10ms"
backoff_max = "200ms"
global_concurrency = {LIMITED_CONCURRENCY}
rate_limit = "{LIMITED_RATE[0]}/{LIMITED_RATE[1]:g}s"

[queues.reserved]
concurrency = 4
processes = 2
max_attempts = 25
global_concurrency = {RESERVED_CONCURRENCY}

[queues.fair]
concurrency = 4
processes = 2
max_attempts = 25
fair = true

[queues.grouped]
concurrency = 8
processes = 2
max_attempts = 25
backoff_base = "10ms"
backoff_max = "200ms"
"""


def limits_mix(rng: random.Random, n: int) -> tuple[str, dict[str, Any]]:
    """Jobs of a queue with a global concurrency and a rate limit, of a queue with only
    a global concurrency, of a fair queue (four tenants, one with half of them), jobs in
    8 ordered groups (some heads fail once), and plain work."""
    x = rng.random()
    if x < 0.3:
        return "chaos_limited", {"ms": rng.randint(20, 150)}
    if x < 0.42:
        return "chaos_reserved", {"ms": rng.randint(20, 150)}
    if x < 0.55:
        tenant = "t0" if rng.random() < 0.5 else f"t{rng.randint(1, 3)}"
        return "chaos_fair", {"ms": rng.randint(5, 60), "tenant": tenant}
    if x < 0.85:
        args: dict[str, Any] = {"ms": rng.randint(5, 60), "group": f"g{rng.randint(0, 7)}"}
        if rng.random() < 0.05:
            args["fail_once"] = True
        return "chaos_grouped", args
    return plain_mix(rng, n)


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    faults: Callable[[Run], Awaitable[None]]
    mix: Mix = plain_mix
    # [daemon] settings of this scenario's members (TOML values), over the runner's.
    daemon: Mapping[str, str] = field(default_factory=dict)
    # Slot 0's member runs in a network namespace of its own (chaos/netns.py).
    netns: bool = False
    # A synchronous streaming replica, and members on a multi-host DSN (read-write).
    replica: bool = False
    expected_dead: frozenset[str] = field(default_factory=frozenset)
    # Failed-attempt outcomes this scenario's faults may charge to an attempt that no
    # handler started (see invariant 8); none for faults a member must absorb cleanly.
    unstarted_ok: frozenset[str] = field(default_factory=frozenset)
    queues: str = ""  # more [queues.*] tables for the members' config
    # Each enqueue batch gets a callback job that depends on all of the batch's jobs.
    fan_in: bool = False
    # Members' pools through a stock PgBouncer in transaction mode (their leader and
    # LISTEN sessions direct, on leader_dsn).
    pooler: bool = False
    # Slot 0's member reaches the server through chaos/laggy.py's proxy.
    laggy: bool = False
    # The server's pg_wal ("wal") or data directory ("data") on a tmpfs of volume_mb
    # (chaos/volume.py), checkpointed every max_wal_mb of WAL.
    full_volume: str = ""
    volume_mb: int = 0
    max_wal_mb: int = 64


async def _pause(run: Run, low: float, high: float) -> bool:
    """Sleeps a seeded while; False once the fault window is over."""
    await asyncio.sleep(run.rng.uniform(low, high))
    return run.elapsed() < run.options.duration


# ---------------------------------------------------------------------------- faults


async def kill_workers(run: Run) -> None:
    while await _pause(run, 0.5, 1.5):
        members = run.live_members()
        if not members:
            continue
        member = run.rng.choice(members)
        workers = run.worker_pids(member)
        if not workers:
            continue
        victim = run.rng.choice(workers)

        async def inject(pid: int = victim) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        await run.fault("kill-9-worker", f"pid {victim} of member pid {member.pid}", inject)


async def _kill_and_restart(run: Run, member: Member, action: str) -> None:
    async def inject() -> None:
        run.kill_member(member)
        await asyncio.to_thread(member.process.wait)

    await run.fault(action, f"member{member.index} pid {member.pid}", inject)
    await asyncio.sleep(run.rng.uniform(0.2, 2.0))
    replacement = run.start_member(member.index)
    log(f"restarted member{member.index} as pid {replacement.pid}")


async def kill_members(run: Run) -> None:
    while await _pause(run, 2.0, 5.0):
        members = run.live_members()
        if members:
            await _kill_and_restart(run, run.rng.choice(members), "kill-9-member")


async def pooler_faults(run: Run) -> None:
    """kill -9 of PgBouncer itself (restarted on its port: every pooled connection of
    every member breaks at once) and of members, in seeded turns."""
    while await _pause(run, 2.0, 5.0):
        if run.rng.random() < 0.5:
            members = run.live_members()
            if members:
                await _kill_and_restart(run, run.rng.choice(members), "kill-9-member")
            continue
        bouncer = run.bouncer
        assert bouncer is not None

        async def inject(process: subprocess.Popen[bytes] = bouncer.process) -> None:
            process.kill()
            await asyncio.to_thread(process.wait)

        await run.fault("kill-9-pgbouncer", f"pid {bouncer.pid}", inject)
        await asyncio.sleep(run.rng.uniform(0.2, 2.0))
        await asyncio.to_thread(run.restart_pooler)
        log(f"restarted pgbouncer as pid {run.bouncer.pid if run.bouncer else None}")


async def kill_leader(run: Run) -> None:
    while await _pause(run, 2.0, 4.0):
        leader = await run.leader_member(within_s=10)
        if leader is None:
            run.violations.append(f"no leader found within 10s at t={run.elapsed():.1f}s")
            continue
        await _kill_and_restart(run, leader, "kill-9-leader")


async def deploy(run: Run) -> None:
    """Rolling restart: SIGTERM one member, wait for its drain and exit, start its
    replacement, wait until it joined, next member; round after round."""
    while await _pause(run, 0.5, 2.0):
        for slot in range(run.options.members):
            member = run.slots[slot]
            if member is None or not member.alive:
                continue

            await _stop_and_restart(run, member, "sigterm-member")
            if run.elapsed() >= run.options.duration:
                return


async def sighup_storm(run: Run) -> None:
    """SIGHUP every member in quick succession; between reloads the chaos_swap module
    is rewritten with a new VERSION (the ledger records which version ran each job)."""
    version = 0
    swap = run.handlers / "chaos_swap.py"
    while await _pause(run, 0.3, 1.2):
        version += 1
        text = swap.read_text()
        head, _, tail = text.partition("VERSION = ")
        swap.write_text(head + f"VERSION = {version}" + tail[tail.index("\n") :])
        targets = run.live_members()
        if run.rng.random() < 0.5 and targets:
            targets = [run.rng.choice(targets)]

        async def inject(ms: list[Member] = targets) -> None:
            for m in ms:
                m.process.send_signal(signal.SIGHUP)

        pids = ",".join(str(m.pid) for m in targets)
        await run.fault("sighup", f"handlers v{version} to pids {pids}", inject)


async def drain_during_claim(run: Run) -> None:
    """SIGTERM members at seeded moments under a stream of short jobs (claims in flight
    all the time): once, twice (stop now), or to the member's whole process group (as
    `timeout` and some init systems send). Each must exit 0 having given back what it
    claimed but never started; its replacement joins, next."""
    modes = ["sigterm", "sigterm-twice", "group-sigterm"]
    while await _pause(run, 0.2, 1.5):
        members = run.live_members()
        if not members:
            continue
        member = run.rng.choice(members)
        mode = run.rng.choice(modes)
        second_after = run.rng.uniform(0.0, 0.5)

        async def inject(m: Member = member, how: str = mode, gap: float = second_after) -> None:
            m.stopped_by_us = True
            if how == "group-sigterm":
                os.killpg(m.pid, signal.SIGTERM)  # members lead their own process group
                return
            m.process.send_signal(signal.SIGTERM)
            if how == "sigterm-twice":
                await asyncio.sleep(gap)
                with contextlib.suppress(ProcessLookupError):
                    m.process.send_signal(signal.SIGTERM)

        await run.fault(mode, f"member{member.index} pid {member.pid}", inject)
        code = await asyncio.to_thread(member.process.wait)
        if code != 0:
            run.violations.append(f"member {member.log_path.name} exited {code} on {mode}")
        run.start_member(member.index)
        await run.wait_members_ready()


async def reload_storm(run: Run) -> None:
    """SIGHUP every 50-250 ms to one or all members under a stream of short jobs: each
    reload retires a worker generation while its producers may be mid-claim."""
    while await _pause(run, 0.05, 0.25):
        targets = run.live_members()
        if run.rng.random() < 0.5 and targets:
            targets = [run.rng.choice(targets)]

        async def inject(ms: list[Member] = targets) -> None:
            for m in ms:
                with contextlib.suppress(ProcessLookupError):
                    m.process.send_signal(signal.SIGHUP)

        await run.fault("sighup", ",".join(str(m.pid) for m in targets), inject)


async def pg_restarts(run: Run) -> None:
    """The server goes away mid-load: fast shutdown, immediate shutdown (crash
    recovery at start), and kill -9 of the whole server, in seeded turns."""
    modes = ["fast", "immediate", "kill"]
    while await _pause(run, 3.0, 6.0):
        mode = run.rng.choice(modes)

        async def inject(how: str = mode) -> None:
            if how == "kill":
                await asyncio.to_thread(run.cluster.kill)
            else:
                await asyncio.to_thread(run.cluster.stop, how)  # type: ignore[arg-type]
            await asyncio.sleep(run.rng.uniform(0.2, 2.0))
            await asyncio.to_thread(run.cluster.start)

        await run.fault("postgres-" + mode, "stop, then start again", inject)


async def terminate_backends(run: Run) -> None:
    """pg_terminate_backend of random pgjobd sessions: pool, listener, leader."""
    names = ["pgjobd", "pgjobd listener", "pgjobd leader"]
    while await _pause(run, 0.3, 1.0):
        name = run.rng.choice(names)
        with contextlib.suppress(*CONNECTION_ERRORS):
            rows = await run.query(
                "SELECT pid FROM pg_stat_activity WHERE application_name = $1 ORDER BY pid",
                name,
                retry_s=2,
            )
            if not rows:
                continue
            count = 1 if name != "pgjobd" else run.rng.randint(1, min(3, len(rows)))
            victims = run.rng.sample([r["pid"] for r in rows], count)

            async def inject(pids: list[int] = victims) -> None:
                await run.query("SELECT pg_terminate_backend(p) FROM unnest($1::int[]) AS p", pids)

            await run.fault("terminate-backend", f"{name!r} backends {victims}", inject)


async def limits_faults(run: Run) -> None:
    """kill -9 of members and of the leader, and SIGHUP storms, in seeded turns, while
    limited and grouped jobs flow."""
    while await _pause(run, 1.0, 3.0):
        x = run.rng.random()
        if x < 0.35:
            members = run.live_members()
            if members:
                await _kill_and_restart(run, run.rng.choice(members), "kill-9-member")
        elif x < 0.55:
            leader = await run.leader_member(within_s=10)
            if leader is not None:
                await _kill_and_restart(run, leader, "kill-9-leader")
        else:
            # A member handles SIGHUP once it has joined; a restarted one may not have yet.
            await run.wait_members_ready()
            targets = run.live_members()

            async def inject(ms: list[Member] = targets) -> None:
                for m in ms:
                    with contextlib.suppress(ProcessLookupError):
                        m.process.send_signal(signal.SIGHUP)

            await run.fault("sighup", ",".join(str(m.pid) for m in targets), inject)


async def bad_handlers(run: Run) -> None:
    """No outside fault: the nasty workload mix (crash, hang, fail, past the lease,
    poison) is the fault."""
    await asyncio.sleep(run.options.duration)


async def long_transaction(run: Run) -> None:
    """A REPEATABLE READ transaction holds its snapshot (the xmin horizon) for a
    minute (or the fault window, if shorter) while jobs flow; vacuum cannot clean."""
    hold = min(60.0, max(5.0, run.options.duration - 2))
    await asyncio.sleep(1.0)
    conn = await run.connect()
    try:
        tx = conn.transaction(isolation="repeatable_read")

        async def inject() -> None:
            await tx.start()
            await conn.fetchval(f"SELECT count(*) FROM {SCHEMA}.job")

        await run.fault("long-transaction", f"snapshot held for {hold:.0f}s", inject)
        await asyncio.sleep(hold)
        await tx.rollback()
        log("long transaction closed")
    finally:
        await conn.close()


# ----------------------------------------------------- connection exhaustion (issue 18)

READY_OK_HEARTBEAT_S = 25.0  # /readyz's 20 s without a round trip + a 5 s heartbeat
RECOVERY_LIMIT_S = 30.0


async def _readyz(port: int) -> tuple[int | None, str]:
    """(HTTP status, body) of a member's /readyz; (None, why) if it did not answer in 2 s."""
    try:
        async with asyncio.timeout(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: member\r\n\r\n")
            await writer.drain()
            answer = await reader.read()
            writer.close()
    except (OSError, TimeoutError) as e:
        return None, repr(e)
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace").strip()


class _Progress:
    """Completions over time, read on a connection held through the fault."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.samples: list[tuple[float, int, int]] = []  # (t, finished, available)

    async def sample(self, run: Run) -> None:
        row = await self.conn.fetchrow(
            f"SELECT (SELECT count(*) FROM {SCHEMA}.job_history) AS done, "
            f"(SELECT count(*) FROM {SCHEMA}.job WHERE state = 'available') AS waiting"
        )
        self.samples.append((run.elapsed(), row["done"], row["waiting"]))

    def waiting(self, since: float, until: float) -> bool:
        """Whether jobs were waiting to be claimed at some point in the interval."""
        return any(s[2] for s in self.samples if since <= s[0] <= until)

    def rate(self, since: float, until: float) -> float:
        inside = [s for s in self.samples if since <= s[0] <= until]
        if len(inside) < 2 or inside[-1][0] == inside[0][0]:
            return 0.0
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


async def _check_readiness(run: Run, conn: asyncpg.Connection, phase: str) -> None:
    """Every live member's /readyz answers, and says 200 only while its heartbeats reach
    the database; a 503 names why."""
    ages = {
        r["pid"]: r["age"]
        for r in await conn.fetch(
            f"SELECT pid, extract(epoch FROM now() - heartbeat_at)::float8 AS age "
            f"FROM {SCHEMA}.member"
        )
    }
    for member in run.live_members():
        port = run.metrics_port(member)
        if port is None:
            continue
        status, body = await _readyz(port)
        run.readiness.append((run.elapsed(), member.pid, phase, status, body))
        if status is None:
            run.violations.append(f"{phase}: /readyz of pid {member.pid} did not answer: {body}")
        elif status == 200 and ages.get(member.pid, float("inf")) > READY_OK_HEARTBEAT_S:
            run.violations.append(
                f"{phase}: pid {member.pid} said ready with no heartbeat for "
                f"{ages.get(member.pid)} s"
            )
        elif status != 200 and not body:
            run.violations.append(f"{phase}: pid {member.pid} not ready, and said not why")


async def _hog_connections(run: Run, leave: int) -> list[asyncpg.Connection]:
    """Connections of another client, opened until the server refuses one, less `leave`."""
    hog: list[asyncpg.Connection] = []
    while True:
        try:
            hog.append(await asyncpg.connect(run.dsn, timeout=5, server_settings={
                "application_name": "chaos hog"}))  # fmt: skip
        except (asyncpg.TooManyConnectionsError, asyncpg.CannotConnectNowError):
            break
        except asyncpg.PostgresError as e:
            if "connection slots" not in str(e):
                raise
            break
    for conn in hog[:leave]:
        await conn.close()
    return hog[leave:]


async def exhaust_connections(run: Run) -> None:
    """Another client takes all but 3 of max_connections for a while, then pgjobd's
    backends are terminated at 2 per second. Members must keep running jobs (slower),
    /readyz must tell the truth throughout, and the completion rate must be back to 90 %
    of its baseline (or the backlog gone) within 30 s of the fault's end."""
    # Both phases inside the enqueue window (60 % of the fault window), so there is work.
    hold_s = kill_s = max(3.0, (run.options.duration * 0.6 - 3.0) / 2)
    observer = await run.connect()
    progress = _Progress(observer)
    try:

        async def sample_for(seconds: float, phase: str) -> None:
            until = run.elapsed() + seconds
            while run.elapsed() < until:
                await progress.sample(run)
                await _check_readiness(run, observer, phase)
                await asyncio.sleep(0.5)

        await sample_for(3.0, "baseline")
        baseline = progress.rate(0.0, run.elapsed())
        hog: list[asyncpg.Connection] = []

        async def take_slots() -> None:
            hog.extend(await _hog_connections(run, leave=3))

        await run.fault("exhaust-connections", "all but 3 slots held by another client",
                        take_slots)  # fmt: skip
        log(f"holding {len(hog)} connections for {hold_s:.0f}s")
        hog_started = run.elapsed()
        await sample_for(hold_s, "exhausted")
        hog_rate = progress.rate(hog_started, run.elapsed())
        for conn in hog:
            with contextlib.suppress(*CONNECTION_ERRORS):
                await conn.close(timeout=2)

        kill_started = run.elapsed()
        killed = 0
        while run.elapsed() < kill_started + kill_s:
            rows = await observer.fetch(
                "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'pgjobd%'"
            )
            pids = [r["pid"] for r in rows]
            if pids:
                victim = run.rng.choice(pids)
                await observer.fetchval("SELECT pg_terminate_backend($1)", victim)
                run.faults.append(FaultRecord(run.elapsed(), "terminate-backend",
                                              f"pid {victim} (2/s)", {}))  # fmt: skip
                killed += 1
            await progress.sample(run)
            await _check_readiness(run, observer, "terminating")
            await asyncio.sleep(0.5)
        kill_rate = progress.rate(kill_started, run.elapsed())

        ended = run.elapsed()
        recovered_s: float | None = None
        while run.elapsed() < ended + RECOVERY_LIMIT_S + 5:
            await progress.sample(run)
            await _check_readiness(run, observer, "recovering")
            now = run.elapsed()
            caught_up = progress.samples[-1][2] == 0 and run.enqueue_done.is_set()
            if caught_up or (now - ended >= 2 and progress.rate(now - 2, now) >= 0.9 * baseline):
                recovered_s = now - ended
                break
            await asyncio.sleep(0.5)
        summary = (
            f"baseline {baseline:.0f} jobs/s; {hog_rate:.0f} jobs/s with {len(hog)} "
            f"connections held; {kill_rate:.0f} jobs/s while {killed} backends were "
            f"terminated; back to >= 90 % (or caught up) "
            + (f"{recovered_s:.1f} s after the fault" if recovered_s is not None else "never")
        )
        answers: dict[str, dict[str, int]] = {}
        for _, _, phase, status, _ in run.readiness:
            counts = answers.setdefault(phase, {})
            counts[str(status)] = counts.get(str(status), 0) + 1
        summary += f"; /readyz answers by phase: {answers}"
        log(summary)
        run.notes.append(summary)
        if (hog_rate <= 0 and progress.waiting(hog_started, kill_started)) or (
            kill_rate <= 0 and progress.waiting(kill_started, ended)
        ):
            run.violations.append(f"members stopped running jobs during the fault: {summary}")
        if recovered_s is None or recovered_s > RECOVERY_LIMIT_S:
            run.violations.append(f"no recovery within {RECOVERY_LIMIT_S:.0f}s: {summary}")
        not_ready = [r for r in run.readiness if r[2] == "recovering" and r[0] > ended + 30]
        if any(r[3] != 200 for r in not_ready):
            run.violations.append("a member still not ready 30 s after the fault")
    finally:
        await observer.close()


# ------------------------------------------------------- network partition (issue 18)

REJOIN_LIMIT_S = 30.0


async def _member_row(run: Run, member: Member) -> asyncpg.Record | None:
    rows = await run.query(
        f"SELECT id, heartbeat_at, now() AS now FROM {SCHEMA}.member WHERE pid = $1",
        member.pid,
    )
    return rows[0] if rows else None


async def _newest_term(run: Run) -> asyncpg.Record:
    rows = await run.query(f"SELECT term, member FROM {SCHEMA}.leader ORDER BY term DESC LIMIT 1")
    return rows[0]


async def _make_slot0_lead(run: Run) -> bool:
    """SIGTERM whoever else leads (it resigns: a candidate takes over at once) until the
    namespaced member leads; a few tries. Whether it does."""
    for _ in range(6):
        leader = await run.leader_member(within_s=20)
        if leader is None or leader.index == 0:
            return leader is not None
        await _stop_and_restart(run, leader, "sigterm-leader")
    return False


async def _stop_and_restart(run: Run, member: Member, action: str) -> None:
    """SIGTERM: it must drain and exit 0; then its replacement joins."""

    async def inject() -> None:
        member.stopped_by_us = True
        member.process.send_signal(signal.SIGTERM)

    await run.fault(action, f"member{member.index} pid {member.pid}", inject)
    code = await asyncio.to_thread(member.process.wait)
    if code != 0:
        run.violations.append(f"member {member.log_path.name} exited {code} on SIGTERM")
    run.start_member(member.index)
    await run.wait_members_ready()


async def partition(run: Run) -> None:
    """Slot 0's member, the leader if it can be made so, is cut off from the database
    for longer than its lease (half the fault window, at least two leases), then the
    link comes back. Its jobs must run elsewhere, its late outcomes be refused by the
    fence, a new leader take over (once the server drops the old leader's session), and
    it must rejoin without a restart."""
    assert run.netns is not None
    netns = run.netns
    cut_s = max(2.0 * LEASE_S + 2.0, run.options.duration * 0.5)
    was_leader = await _make_slot0_lead(run)
    member = run.slots[0]
    assert member is not None
    row = await _member_row(run, member)
    member_id = row["id"] if row else "?"
    before = await _newest_term(run)
    await asyncio.sleep(1.0)
    rows = await run.query(
        f"SELECT count(*) AS held FROM {SCHEMA}.job WHERE owner = $1 AND state = 'running'",
        member_id,
    )
    held = rows[0]["held"]
    detail = f"member0 pid {member.pid} (leader: {was_leader}) cut off for {cut_s:.0f}s"
    await run.fault("partition", detail, _async(netns.cut))
    cut_at = run.elapsed()
    took_over_s: float | None = None
    while run.elapsed() < cut_at + cut_s:
        if was_leader and took_over_s is None:
            newest = await _newest_term(run)
            if newest["term"] > before["term"] and newest["member"] != member_id:
                took_over_s = run.elapsed() - cut_at
        await asyncio.sleep(0.5)
    await run.fault("heal", f"member0 pid {member.pid} linked again", _async(netns.heal))
    healed_at = run.elapsed()

    rejoined_s: float | None = None
    while run.elapsed() < healed_at + REJOIN_LIMIT_S:
        again = await _member_row(run, member)
        if again is not None and again["now"] - again["heartbeat_at"] < _seconds(
            run.elapsed() - healed_at
        ):
            rejoined_s = run.elapsed() - healed_at
            break
        await asyncio.sleep(0.25)
    if not member.alive:
        run.violations.append("the partitioned member exited instead of rejoining")
    if rejoined_s is None:
        run.violations.append(f"the partitioned member did not rejoin within {REJOIN_LIMIT_S}s")
    refused = len(re.findall(rb"outcomes whose lease was lost", member.log_path.read_bytes()))
    summary = (
        f"member0 was leader: {was_leader}, held {held} running job(s); cut {cut_s:.0f}s; "
        + (f"new leader {took_over_s:.1f}s into the cut; " if took_over_s is not None else "")
        + f"rejoined {rejoined_s if rejoined_s is None else round(rejoined_s, 1)}s after the "
        f"heal; {refused} batch(es) of its late outcomes refused by the fence"
    )
    if was_leader and took_over_s is None and cut_s > 70:
        run.violations.append(f"no new leader during the cut: {summary}")
    log(summary)
    run.notes.append(summary)
    # After the heal: it works again (the enqueuer keeps feeding jobs until 60 % in).
    await asyncio.sleep(max(0.0, run.options.duration - run.elapsed()))


async def _degrade_member0_link(
    run: Run, fault: str, detail: str, *, degrade: Callable[[], None],
    restore: Callable[[], None], degraded: str,
) -> None:  # fmt: skip
    """Slot 0's link degraded from 20 % to 70 % of the fault window; member 0's rate of
    finished jobs before and during is a note."""
    member = run.slots[0]
    assert member is not None
    row = await _member_row(run, member)
    member_id = row["id"] if row else "?"

    async def finished_by_member0() -> int:
        rows = await run.query(
            f"SELECT count(*) AS n FROM {SCHEMA}.job_history WHERE owner = $1", member_id
        )
        return int(rows[0]["n"])

    clear_s = run.options.duration * 0.2
    degraded_s = run.options.duration * 0.5
    await asyncio.sleep(clear_s)
    before = await finished_by_member0()
    await run.fault(fault, detail, _async(degrade))
    await asyncio.sleep(degraded_s)
    during = await finished_by_member0() - before
    await run.fault("link-restored", "member0", _async(restore))
    summary = (
        f"member0 finished {before / clear_s:.0f} jobs/s on a clear link, "
        f"{during / degraded_s:.0f} jobs/s {degraded}"
    )
    log(summary)
    run.notes.append(summary)
    await asyncio.sleep(max(0.0, run.options.duration - run.elapsed()))


async def slow_link(run: Run) -> None:
    """Slot 0's link to the database degraded (a 128 kbit/s token bucket with a 50 ms
    queue on both ends: queueing delay and drops) for the middle of the fault window;
    throughput may fall, correctness may not."""
    assert run.netns is not None
    await _degrade_member0_link(
        run, "slow-link", "member0: 128kbit, 50ms queue", degrade=run.netns.degrade,
        restore=run.netns.restore, degraded="on the slow one",
    )  # fmt: skip


async def lossy_link(run: Run) -> None:
    """Slot 0's link to the database gets latency and loss (chaos/laggy.py: 25-35 ms each
    way, 2 % of the chunks held 0.2-0.6 s as a lost segment's retransmission would be)
    for the middle of the fault window; throughput may fall, correctness may not."""
    proxy = run.laggy
    assert proxy is not None

    def impair() -> None:
        proxy.impairment = Impairment()

    def heal() -> None:
        proxy.impairment = None

    await _degrade_member0_link(
        run, "lossy-link", "member0: 25-35 ms each way, 2% of chunks stalled",
        degrade=impair, restore=heal, degraded="with latency and loss",
    )  # fmt: skip
    run.notes.append(f"{proxy.stalled} of {proxy.chunks} chunks stalled")


FAILOVER_LIMIT_S = 30.0


async def failover(run: Run) -> None:
    """Under load, the primary is stopped (immediate: as if its host died) and the
    synchronous replica promoted. Members, on a multi-host DSN that wants a read-write
    host, must be completing jobs on the new primary within 30 s; the invariants then
    show every enqueue acknowledged before the failover ended once."""
    replica = run.replica
    assert replica is not None
    await asyncio.sleep(run.options.duration * 0.3)

    stopped_at: list[float] = []

    async def inject() -> None:
        await asyncio.to_thread(run.cluster.stop, "immediate")
        stopped_at.append(run.elapsed())
        conn = await asyncpg.connect(replica.dsn("chaos"))
        try:
            await conn.fetchval("SELECT pg_promote(true, 30)")
        finally:
            await conn.close()

    await run.fault("failover", f"primary stopped, replica on port {replica.port} promoted",
                    inject)  # fmt: skip
    promoted_at = run.elapsed()
    # What the new primary holds right after the promotion: completions after it are
    # the members' work on the new primary.
    rows = await run.query(f"SELECT count(*) AS done FROM {SCHEMA}.job_history")
    done_before = rows[0]["done"]
    resumed_s: float | None = None
    while run.elapsed() < promoted_at + FAILOVER_LIMIT_S + 10:
        with contextlib.suppress(*CONNECTION_ERRORS):
            rows = await run.query(f"SELECT count(*) AS done FROM {SCHEMA}.job_history", retry_s=2)
            if rows[0]["done"] > done_before:
                resumed_s = run.elapsed() - promoted_at
                break
        await asyncio.sleep(0.2)
    summary = (
        f"{done_before} jobs final at the promotion ({promoted_at - stopped_at[0]:.1f}s after "
        "the primary stopped); members completing jobs on the new primary "
        f"{resumed_s if resumed_s is None else round(resumed_s, 1)}s after the promotion"
    )
    log(summary)
    run.notes.append(summary)
    if resumed_s is None or resumed_s > FAILOVER_LIMIT_S:
        run.violations.append(f"members not back within {FAILOVER_LIMIT_S:.0f}s: {summary}")
    await asyncio.sleep(max(0.0, run.options.duration - run.elapsed()))


# ---------------------------------------------------------- disk pressure (issue 18)

WAL_VOLUME_MB = 192  # three times max_wal_size: normal load fits with room to spare
DATA_VOLUME_MB = 320  # an initdb'd cluster (~40 MB) and the workload's tables, with room
FILLER_LEAVES = 1 << 20  # less than one 16 MB WAL segment: the next one cannot be made
REFUSED_WITHIN_S = 30.0
READY_AGAIN_LIMIT_S = 10.0
# Writes of another client, once the filler is in: the volume's last free megabyte (and
# the WAL segments recycled ahead) are used up in seconds rather than at the workload's
# pace.
PUSH = {
    "wal": "SELECT pg_logical_emit_message(false, 'chaos disk-full', repeat('x', 1048576))",
    "data": "INSERT INTO public.chaos_ballast SELECT repeat('x', 1000) FROM "
    "generate_series(1, 2000)",
}


class _Completions(_Progress):
    """Completions over time, each sample on a fresh connection: none while the server
    is away."""

    def __init__(self) -> None:
        self.samples = []

    async def sample(self, run: Run) -> None:
        with contextlib.suppress(*CONNECTION_ERRORS):
            rows = await run.query(
                f"SELECT (SELECT count(*) FROM {SCHEMA}.job_history) AS done, "
                f"(SELECT count(*) FROM {SCHEMA}.job WHERE state = 'available') AS waiting",
                retry_s=0,
            )
            self.samples.append((run.elapsed(), rows[0]["done"], rows[0]["waiting"]))


async def _poll_readyz(run: Run, phase: str) -> list[int | None]:
    """Every live member's /readyz answers (their statuses); a 503 says why."""
    statuses: list[int | None] = []
    for member in run.live_members():
        port = run.metrics_port(member)
        if port is None:
            continue
        status, body = await _readyz(port)
        statuses.append(status)
        run.readiness.append((run.elapsed(), member.pid, phase, status, body))
        if status is None:
            run.violations.append(f"{phase}: /readyz of pid {member.pid} did not answer: {body}")
        elif status != 200 and not body:
            run.violations.append(f"{phase}: pid {member.pid} not ready, and said not why")
    return statuses


async def _http_get(port: int, path: str) -> str:
    async with asyncio.timeout(5):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: member\r\n\r\n".encode())
        await writer.drain()
        answer = await reader.read()
        writer.close()
    return answer.decode(errors="replace")


async def _push_until_refused(run: Run, sql: str) -> tuple[float | None, str]:
    """Writes until the server refuses a statement: (when, what the client saw), or
    (None, "") if it never did within REFUSED_WITHIN_S."""
    until = run.elapsed() + REFUSED_WITHIN_S
    while run.elapsed() < until:
        try:
            await run.query(sql, retry_s=0)
        except CONNECTION_ERRORS as e:
            return run.elapsed(), f"{type(e).__name__}: {e}"
        await asyncio.sleep(0.05)
    return None, ""


async def _server_back(run: Run) -> bool:
    """Starts the server again if it went down (True: it had to be started), then waits
    until it answers."""
    restarted = not run.cluster.running
    if restarted:
        await asyncio.to_thread(run.cluster.start)
    await run.query("SELECT 1", retry_s=60)
    return restarted


def _server_log_lines(run: Run, *needles: str) -> list[str]:
    text = run.cluster.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if any(n in line for n in needles)]


def _refusals_summary(run: Run) -> str:
    refused = run.refused_enqueues
    if not refused:
        return "no enqueue was refused"
    texts: dict[str, int] = {}
    for *_, text in refused:
        texts[text[:120]] = texts.get(text[:120], 0) + 1
    batches = {first: jobs for _, first, jobs, _ in refused}
    return (
        f"{len(refused)} enqueue tries refused, t={refused[0][0]:.1f}-{refused[-1][0]:.1f}s "
        f"({len(batches)} batches, {sum(batches.values())} jobs; "
        f"{len(run.enqueues_answer_lost)} of them had committed, the answer lost; the "
        f"others committed on a later try); the client saw: {texts}"
    )


async def _check_integrity(run: Run) -> str:
    """The job tables read in full and pg_amcheck (heap and every B-tree index, with
    heapallindexed) over the database; what it found."""
    rows = await run.query(
        f"SELECT (SELECT count(*) FROM {SCHEMA}.job) AS job, "
        f"(SELECT count(*) FROM {SCHEMA}.job_history) AS job_history, "
        f"(SELECT count(*) FROM {SCHEMA}.job_attempt) AS job_attempt"
    )
    counts = dict(rows[0])
    amcheck = run.cluster.binaries.program("pg_amcheck")
    if not amcheck.exists():
        return f"rows {counts}; no pg_amcheck in {amcheck.parent}"
    done = await asyncio.to_thread(
        subprocess.run,
        [str(amcheck), "-h", "127.0.0.1", "-p", str(run.cluster.port), "-U", "postgres",
         "-d", DATABASE, "--install-missing", "--heapallindexed"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    (run.evidence / "pg_amcheck.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        run.violations.append(
            f"pg_amcheck found corruption (status {done.returncode}): "
            f"{(done.stdout + done.stderr)[:500]}"
        )
    return f"rows {counts}; pg_amcheck --heapallindexed status {done.returncode}"


async def disk_full(run: Run) -> None:
    """A volume of the server fills: a filler file takes all but 1 MB of the tmpfs under
    pg_wal (or under the data directory), another client's writes use up what was left,
    and the server stops taking writes (with pg_wal full it PANICs when it cannot make a
    WAL segment; with the data directory full, statements that need a new page fail).
    Members must ride it out without exiting; every enqueue the server acknowledged must
    end once; enqueues it refused fail with an error. Then the filler is removed (and the
    server started, if it went down): the completion rate must be back to 90 % of its
    baseline within 30 s, every member ready again within 10 s without a restart, and
    the data must check clean."""
    volume, holds = run.volume, run.volume_holds
    assert volume is not None
    await run.query("CREATE TABLE IF NOT EXISTS public.chaos_ballast (b text)")
    baseline_s = max(3.0, run.options.duration * 0.1)
    hold_s = max(3.0, run.options.duration * 0.25)
    members_before = {m.pid for m in run.live_members()}
    progress = _Completions()

    async def watch_for(seconds: float, phase: str) -> None:
        until = run.elapsed() + seconds
        while run.elapsed() < until:
            await progress.sample(run)
            await _poll_readyz(run, phase)
            await asyncio.sleep(0.5)

    await watch_for(baseline_s, "baseline")
    baseline = progress.rate(0.0, run.elapsed())
    filled: list[int] = []

    async def fill() -> None:
        filled.append(await asyncio.to_thread(volume.fill, FILLER_LEAVES))

    await run.fault(f"{holds}-volume-full", f"filler leaves {FILLER_LEAVES >> 10} kB of "
                    f"{volume.size_mb} MB", fill)  # fmt: skip
    filled_at = run.elapsed()
    refused_at, refused_with = await _push_until_refused(run, PUSH[holds])
    if refused_at is None:
        run.violations.append(
            f"the server took writes for {REFUSED_WITHIN_S:.0f}s with its {holds} volume full"
        )
    else:
        log(
            f"server refused a write {refused_at - filled_at:.1f}s after the filler: {refused_with}"
        )
    await watch_for(hold_s, "full")
    await _save_metrics(run, f"metrics-{holds}-full.txt")

    restarted: list[bool] = []

    async def give_space_back() -> None:
        volume.empty()
        restarted.append(await _server_back(run))

    await run.fault(f"{holds}-volume-emptied", "filler removed", give_space_back)
    ended = run.elapsed()
    recovered_s = ready_again_s = None
    while run.elapsed() < ended + RECOVERY_LIMIT_S + 5 and recovered_s is None:
        await progress.sample(run)
        statuses = await _poll_readyz(run, "recovering")
        now = run.elapsed()
        if ready_again_s is None and statuses and all(s == 200 for s in statuses):
            ready_again_s = now - ended
        if _recovered(run, progress, baseline, ended):
            recovered_s = now - ended
        await asyncio.sleep(0.5)
    if ready_again_s is None:
        ready_again_s = await _all_ready_again(run, ended)
    await _members_rode_it_out(run, members_before)
    await watch_for(run.options.duration - run.elapsed(), "after")
    after = progress.rate(ended, ended + 10)
    integrity = await _check_integrity(run)

    panics = _server_log_lines(run, "PANIC", "No space left on device")
    answers: dict[str, dict[str, int]] = {}
    reasons: dict[str, int] = {}
    for _, _, phase, status, body in run.readiness:
        counts = answers.setdefault(phase, {})
        counts[str(status)] = counts.get(str(status), 0) + 1
        if status != 200:
            reasons[body[:100]] = reasons.get(body[:100], 0) + 1
    _save_readiness(run)
    with (run.evidence / "progress.csv").open("w", newline="") as f:
        csv.writer(f).writerows([("t", "final_records", "available"), *progress.samples])
    refused = (
        f"server refused writes {refused_at - filled_at:.1f}s later ({refused_with[:120]})"
        if refused_at is not None
        else "server never refused"
    )
    recovery = (
        f"{recovered_s:.1f} s after the fault ({after:.0f} jobs/s over its first 10 s)"
        if recovered_s is not None
        else "never"
    )
    ready = f"{ready_again_s:.1f} s" if ready_again_s is not None else "never"
    server = "restarted" if restarted and restarted[0] else "stayed up"
    summary = (
        f"baseline {baseline:.0f} jobs/s; filler {sum(filled) >> 20} MB; {refused}; held "
        f"full {hold_s:.0f}s; server {server} when the filler went; back to >= 90 % (or "
        f"caught up) {recovery}; every member ready again after {ready}; "
        f"{_refusals_summary(run)}; server log: {panics[:3]}; "
        f"{integrity}; /readyz answers by phase: {answers}, 503 reasons: {reasons}"
    )
    log(summary)
    run.notes.append(summary)
    if recovered_s is None or recovered_s > RECOVERY_LIMIT_S:
        run.violations.append(f"no recovery within {RECOVERY_LIMIT_S:.0f}s: {summary}")
    if ready_again_s is not None and ready_again_s > READY_AGAIN_LIMIT_S:
        run.violations.append(
            f"members ready again only {ready_again_s:.1f}s after the server was back"
        )


def _save_readiness(run: Run) -> None:
    with (run.evidence / "readyz.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t", "member_pid", "phase", "status", "body"])
        writer.writerows(run.readiness)


def _recovered(run: Run, progress: _Progress, baseline: float, ended: float) -> bool:
    """The completion rate over the last 2 s is back to 90 % of the baseline, or members
    keep up with what arrives: the backlog gone once everything was enqueued, or, while
    the enqueuer still catches up, nothing waiting in the last second's samples and jobs
    completing."""
    now = run.elapsed()
    if now - ended >= 2 and progress.rate(now - 2, now) >= 0.9 * baseline:
        return True
    last = [s for s in progress.samples if s[0] >= max(ended, now - 1.2)]
    keeping_up = len(last) >= 2 and all(s[2] == 0 for s in last) and last[-1][1] > last[0][1]
    return keeping_up or (bool(last) and last[-1][2] == 0 and run.enqueue_done.is_set())


async def _save_metrics(run: Run, name: str) -> None:
    """One member's /metrics, as it stood, into the evidence folder."""
    for member in run.live_members():
        port = run.metrics_port(member)
        if port is not None:
            with contextlib.suppress(OSError, TimeoutError):
                (run.evidence / name).write_text(await _http_get(port, "/metrics"))
                return


async def _all_ready_again(run: Run, since: float) -> float | None:
    """Seconds from `since` until every live member's /readyz says 200 (None: not within
    RECOVERY_LIMIT_S, a violation)."""
    while run.elapsed() < since + RECOVERY_LIMIT_S:
        answers = [await _readyz(p) for m in run.live_members() if (p := run.metrics_port(m))]
        if answers and all(status == 200 for status, _ in answers):
            return run.elapsed() - since
        await asyncio.sleep(0.5)
    run.violations.append(f"a member still not ready {RECOVERY_LIMIT_S:.0f}s after the fault")
    return None


async def _members_rode_it_out(run: Run, pids: set[int]) -> None:
    """The members from before the fault are the ones running now, each heartbeating."""
    alive = {m.pid for m in run.live_members()}
    if pids - alive:
        run.violations.append(f"members {sorted(pids - alive)} did not ride the outage out")
    rows = await run.query(
        f"SELECT pid, extract(epoch FROM now() - heartbeat_at)::float8 AS age FROM {SCHEMA}.member"
    )
    stale = {r["pid"]: round(r["age"], 1) for r in rows if r["pid"] in pids and r["age"] > 15}
    if stale:
        run.violations.append(f"members with no heartbeat for over 15 s after the fault: {stale}")


def _async(action: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def run_it() -> None:
        await asyncio.to_thread(action)

    return run_it


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "kill-workers",
            "kill -9 random worker children",
            kill_workers,
            unstarted_ok=frozenset({"crashed"}),
        ),
        Scenario(
            "kill-members",
            "kill -9 random members, restart them",
            kill_members,
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "kill-leader",
            "kill -9 the leader repeatedly, restart it",
            kill_leader,
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario("deploy", "rolling SIGTERM of every member, replaced one by one", deploy),
        Scenario(
            "sighup",
            "SIGHUP storm, handler module swapped between reloads",
            sighup_storm,
            mix=swap_mix,
        ),
        Scenario(
            "drain-during-claim",
            "SIGTERM (once, twice, to the process group) while claims are in flight",
            drain_during_claim,
            mix=quick_mix,
        ),
        Scenario(
            "reload-storm",
            "SIGHUP every 50-250 ms while claims are in flight",
            reload_storm,
            mix=quick_mix,
        ),
        Scenario(
            "pg-restart",
            "PostgreSQL fast/immediate shutdown and kill -9, restarted",
            pg_restarts,
            # a claim that committed while its answer was lost with the server
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "terminate-backends",
            "pg_terminate_backend of pool/listener/leader sessions",
            terminate_backends,
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "bad-handlers",
            "handlers that crash, hang past timeout, exceed the lease",
            bad_handlers,
            mix=nasty_mix,
            expected_dead=frozenset({"chaos_poison"}),
            # a neighbour sent to a worker that a poison pill or a hang then took down
            unstarted_ok=frozenset({"crashed", "timeout"}),
        ),
        Scenario(
            "limits",
            "global concurrency, rate limit and ordered groups under kill -9 and SIGHUP",
            limits_faults,
            mix=limits_mix,
            unstarted_ok=frozenset({"lease_expired"}),
            queues=LIMITS_QUEUES,
        ),
        Scenario(
            "workflows",
            "fan-in callbacks (depends_on) under kill -9 of members, restarted",
            kill_members,
            unstarted_ok=frozenset({"lease_expired"}),
            fan_in=True,
        ),
        Scenario(
            "conn-exhaustion",
            "another client holds all but 3 connection slots, then pgjobd backends are "
            "terminated at 2/s",
            exhaust_connections,
            daemon={"metrics_listen": '"127.0.0.1:0"'},
            # a claim whose commit reached the server but whose answer died with its backend
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "partition",
            "one member (the leader if possible) cut off from the database for longer "
            "than its lease, then linked again",
            partition,
            mix=long_mix,
            netns=True,
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "slow-link",
            "one member's link to the database slowed to 128 kbit/s with a short queue",
            slow_link,
            netns=True,
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "lossy-link",
            "one member's link to the database with 25-35 ms of latency each way and 2% "
            "of its chunks stalled as lost segments are",
            lossy_link,
            laggy=True,
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "failover",
            "the primary stopped under load, its synchronous replica promoted; members on "
            "a multi-host DSN (target_session_attrs=read-write)",
            failover,
            replica=True,
            # claims whose commit the dying primary acknowledged to nobody
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "pgbouncer",
            "members' pools through a stock transaction-mode PgBouncer; kill -9 of "
            "PgBouncer (restarted) and of members",
            pooler_faults,
            pooler=True,
            # a claim whose commit reached the server but whose answer died with the
            # pooler or the member
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "disk-full",
            "the WAL volume fills up under load (the server stops taking writes), then "
            "space returns",
            disk_full,
            daemon={"metrics_listen": '"127.0.0.1:0"'},
            full_volume="wal",
            volume_mb=WAL_VOLUME_MB,
            # a claim whose commit reached the WAL but whose answer died with the server
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "disk-full-data",
            "the data directory's volume fills up under load (statements that need a new "
            "page fail), then space returns",
            disk_full,
            daemon={"metrics_listen": '"127.0.0.1:0"'},
            full_volume="data",
            volume_mb=DATA_VOLUME_MB,
            unstarted_ok=frozenset({"lease_expired"}),
        ),
        Scenario(
            "long-transaction",
            "a transaction holds the xmin horizon while jobs flow",
            long_transaction,
        ),
    ]
}

# The CI smoke: short, seeded scenarios that cover process, fleet, server and network faults.
# "limits": fleet-wide limits, groups and allocations under kills and reloads (issue 12).
SMOKE = ["kill-workers", "kill-leader", "pg-restart", "drain-during-claim", "conn-exhaustion",
         "partition", "pgbouncer", "disk-full", "limits"]  # fmt: skip
