"""The scenarios: a workload mix and a fault schedule each, driven by the run's seeded
random.Random so that a seed replays the same choices (which victim, when, how)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .runner import CONNECTION_ERRORS, SCHEMA, Member, Mix, Run, log


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


def swap_mix(rng: random.Random, n: int) -> tuple[str, dict[str, Any]]:
    if rng.random() < 0.3:
        return "chaos_swap", {}
    return plain_mix(rng, n)


# The `limits` scenario's queues: what invariants.check_limits holds the ledger to.
LIMITED_CONCURRENCY = 4
LIMITED_RATE = (40, 1.0)  # starts per window (s)
LIMITS_QUEUES = f"""
[queues.limited]
concurrency = 6
processes = 2
max_attempts = 25
backoff_base = "10ms"
backoff_max = "200ms"
global_concurrency = {LIMITED_CONCURRENCY}
rate_limit = "{LIMITED_RATE[0]}/{LIMITED_RATE[1]:g}s"

[queues.grouped]
concurrency = 8
processes = 2
max_attempts = 25
backoff_base = "10ms"
backoff_max = "200ms"
"""


def limits_mix(rng: random.Random, n: int) -> tuple[str, dict[str, Any]]:
    """Jobs of a queue with a global concurrency and a rate limit, jobs in 8 ordered
    groups (some heads fail once), and plain work."""
    x = rng.random()
    if x < 0.45:
        return "chaos_limited", {"ms": rng.randint(20, 150)}
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
    expected_dead: frozenset[str] = field(default_factory=frozenset)
    # Failed-attempt outcomes this scenario's faults may charge to an attempt that no
    # handler started (see invariant 8); none for faults a member must absorb cleanly.
    unstarted_ok: frozenset[str] = field(default_factory=frozenset)
    queues: str = ""  # more [queues.*] tables for the members' config
    # Each enqueue batch gets a callback job that depends on all of the batch's jobs.
    fan_in: bool = False


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

            async def inject(m: Member = member) -> None:
                m.stopped_by_us = True
                m.process.send_signal(signal.SIGTERM)

            await run.fault("sigterm-member", f"member{slot} pid {member.pid}", inject)
            code = await asyncio.to_thread(member.process.wait)
            if code != 0:
                run.violations.append(f"member {member.log_path.name} exited {code} on SIGTERM")
            run.start_member(slot)
            await run.wait_members_ready()
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
            "long-transaction",
            "a transaction holds the xmin horizon while jobs flow",
            long_transaction,
        ),
    ]
}

# The CI smoke: short, seeded, three scenarios that cover process, fleet and server faults.
SMOKE = ["kill-workers", "kill-leader", "pg-restart", "drain-during-claim"]
