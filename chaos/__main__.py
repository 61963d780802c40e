"""`python -m chaos SCENARIO|smoke|all [--jobs N] [--members M] [--duration D] [--seed S]
[--keep]`: one summary line per scenario on stdout, progress on stderr; exit status 1
on any invariant violation (the evidence folder is then kept and named)."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from pgjobd.embedded import Cluster

from .invariants import check, check_limits
from .runner import LEASE_S, Options, Run, log
from .scenarios import (
    LIMITED_CONCURRENCY,
    LIMITED_RATE,
    RESERVED_CONCURRENCY,
    SCENARIOS,
    SMOKE,
    Scenario,
)

SMOKE_JOBS, SMOKE_DURATION = 300, 12.0
SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"
SMOKE_SOAK_MINUTES = 2


async def run_one(scenario: Scenario, options: Options) -> bool:
    run = Run(options)
    run.extra_queues = scenario.queues
    run.daemon_overrides.update(scenario.daemon)
    clean = False
    try:
        if scenario.netns:
            run.use_netns()
        if scenario.full_volume:
            run.use_volume(scenario.full_volume, scenario.volume_mb, scenario.max_wal_mb)
        run.wants_replica = scenario.replica
        run.wants_pooler = scenario.pooler
        run.wants_laggy = scenario.laggy
        await run.setup()
        log(
            f"{scenario.name}: {scenario.about}; {options.jobs} jobs, {options.members} "
            f"members, faults for {options.duration:g}s, seed {options.seed}, "
            f"lease {LEASE_S}s (short on purpose: lost jobs come back quickly)"
        )
        background = [
            asyncio.create_task(run.sample_leaders()),
            asyncio.create_task(run.track_recovery()),
            asyncio.create_task(run.watch_members()),
        ]
        enqueuer = asyncio.create_task(run.enqueue(scenario.mix, scenario.fan_in))
        await scenario.faults(run)
        await enqueuer
        waited = await run.wait_quiescent()
        if waited is None:
            run.violations.append(
                f"not quiescent after {options.quiesce_timeout:g}s (jobs left in the hot table)"
            )
        else:
            log(f"quiescent {waited:.1f}s after the fault window")
        await asyncio.sleep(0.5)  # let the recovery tracker see the last fault through
        run.stop_background.set()
        await asyncio.gather(*background)
        await run.stop_members()
        tables = await run.dump()
        run.write_faults()
        verdict = check(
            tables,
            killed_members=run.member_kills,
            expected_dead_kinds=set(scenario.expected_dead),
            unstarted_ok=scenario.unstarted_ok,
        )
        if scenario.name == "limits":
            check_limits(
                tables, verdict,
                concurrency={"chaos_limited": LIMITED_CONCURRENCY,
                             "chaos_reserved": RESERVED_CONCURRENCY},
                rate={"limited": LIMITED_RATE}, grouped_kinds={"chaos_grouped"},
            )  # fmt: skip
        violations = run.violations + verdict.violations
        if run.leader_multi:
            violations.append(
                f"two sessions held the leader lock at {len(run.leader_multi)} of "
                f"{run.leader_samples} samples, e.g. {run.leader_multi[:3]}"
            )
        unrecovered = [f for f in run.faults if f.recovered_s is None]
        if unrecovered:
            violations.append(f"{len(unrecovered)} fault(s) never recovered from")
        max_recovery = max((f.recovered_s or 0.0 for f in run.faults), default=0.0)
        print(
            f"{scenario.name}: jobs={verdict.jobs} completed={verdict.completed} "
            f"dead={verdict.dead} duplicates={verdict.duplicates} lost={verdict.lost} "
            f"max_recovery={max_recovery:.1f}s faults={len(run.faults)} "
            f"executions={verdict.executions} repeats={verdict.repeats} "
            f"cron={verdict.cron_jobs} leader_samples={run.leader_samples} "
            f"violations={len(violations)}",
            flush=True,
        )
        for note in [*run.notes, *verdict.notes]:
            log(f"note: {note}")
        for violation in violations:
            log(f"VIOLATION: {violation}")
        (run.evidence / "verdict.txt").write_text(
            "\n".join(["violations:", *violations, "notes:", *run.notes, *verdict.notes]) + "\n"
        )
        clean = not violations
        return clean
    except Exception as e:
        log(f"{scenario.name}: the run itself failed: {e!r}")
        print(f"{scenario.name}: ERROR {e!r}", flush=True)
        raise
    finally:
        keep = options.keep or not clean
        run.cleanup(keep)
        if keep:
            log(f"evidence kept in {run.evidence}")


def smoke_soak() -> bool:
    """The smoke's short soak: bench/soak.py --minutes 2 --ci on a private server (retries,
    snoozes and scheduled jobs at half of capacity; nothing lost, the hot table and the
    member's RSS bounded; no throughput ratio). Its report goes to stderr, one line to
    stdout."""
    cluster = Cluster.throwaway()
    cluster.init()
    cluster.start()
    try:
        command = [sys.executable, str(SOAK), "--minutes", str(SMOKE_SOAK_MINUTES), "--ci",
                   "--capacity-n", "5000", "--dsn", cluster.dsn()]  # fmt: skip
        done = subprocess.run(command, check=False, stdout=sys.stderr, stderr=sys.stderr)
    finally:
        cluster.stop()
    ok = done.returncode == 0
    print(f"soak: {SMOKE_SOAK_MINUTES} min, bounds {'held' if ok else 'BREACHED'}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    parser.add_argument("scenario", choices=[*SCENARIOS, "smoke", "all", "list"])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0, help="fault window (s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the evidence folder")
    parser.add_argument("--quiesce-timeout", type=float, default=300.0)
    a = parser.parse_args(argv)
    if a.scenario == "list":
        for s in SCENARIOS.values():
            print(f"{s.name:20} {s.about}")
        return 0
    options = Options(a.scenario, a.jobs, a.members, a.duration, a.seed, a.keep,
                      quiesce_timeout=a.quiesce_timeout)  # fmt: skip
    if a.scenario == "smoke":
        names = SMOKE
        options = replace(options, jobs=SMOKE_JOBS, duration=SMOKE_DURATION,
                          quiesce_timeout=90.0)  # fmt: skip
    elif a.scenario == "all":
        names = list(SCENARIOS)
    else:
        names = [a.scenario]
    started = time.monotonic()
    failed = []
    for name in names:
        try:
            ok = asyncio.run(run_one(SCENARIOS[name], replace(options, scenario=name)))
        except Exception:
            ok = False  # reported by run_one; the other scenarios still run
        if not ok:
            failed.append(name)
    if a.scenario == "smoke" and not smoke_soak():
        failed.append("soak")
    took = time.monotonic() - started
    log(f"{len(names)} scenario(s) in {took:.0f}s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
