"""The invariants every scenario must leave intact, checked on the dumped final tables.

Vocabulary: an *execution* is one ledger row (a handler ran, at-least-once: a job may
run again after a fault); a *final record* is a job_history row (exactly once per job).
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

# job_attempt outcomes that mean the attempt's holder lost the job while (maybe) still
# running it: only after one of these may a second execution overlap the first.
LEASE_LOST = {"lease_expired", "crashed", "timeout"}
MAX_EXAMPLES = 5
# The chaos members leave every queue's cpu_scheduling at its default, "batch": each
# execution must run under it, in replaced workers, restarted members and reloads too.
QUEUE_POLICY = getattr(os, "SCHED_BATCH", None)


@dataclass
class Verdict:
    jobs: int = 0
    completed: int = 0
    dead: int = 0
    cancelled: int = 0
    duplicates: int = 0
    lost: int = 0
    executions: int = 0
    repeats: int = 0  # executions beyond one per job: at-least-once at work
    cron_jobs: int = 0
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fail(self, rule: str, examples: list[str], count: int | None = None) -> None:
        if examples:
            total = count if count is not None else len(examples)
            shown = "; ".join(examples[:MAX_EXAMPLES])
            self.violations.append(f"{rule}: {total} case(s), e.g. {shown}")


def check(
    tables: dict[str, list[dict[str, Any]]],
    *,
    killed_members: list[tuple[int, float]],
    expected_dead_kinds: set[str],
    unstarted_ok: frozenset[str] = frozenset(),
) -> Verdict:
    v = Verdict()
    enqueued = {r["job_id"]: r for r in tables["chaos_enqueued"]}
    v.jobs = len(enqueued)
    history: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in tables["job_history"]:
        history[r["id"]].append(r)
    attempts: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in tables["job_attempt"]:
        attempts[r["job_id"]].append(r)
    ledger: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in tables["chaos_ledger"]:
        ledger[r["job_id"]].append(r)
    v.executions = sum(len(x) for x in ledger.values())

    # 1. Every enqueued job has exactly one final record; nothing else has one.
    missing = [str(i) for i in enqueued if i not in history]
    doubled = [f"{i}x{len(h)}" for i, h in history.items() if len(h) > 1]
    cron_ids = {i for i, h in history.items() if h[0]["kind"] == "chaos_cron"}
    phantom = [str(i) for i in history if i not in enqueued and i not in cron_ids]
    v.duplicates = len(doubled)
    v.fail("enqueued job without a final record", missing)
    v.fail("job with more than one final record", doubled)
    v.fail("final record of a job never enqueued", phantom)

    # 2. Nothing left in the hot table.
    hot = [f"{r['id']}:{r['state']}" for r in tables["job"]]
    v.fail("job left in the hot table", hot)
    v.lost = len(missing) + len({r["id"] for r in tables["job"]} & set(enqueued))

    finals = {i: h[0] for i, h in history.items() if i in enqueued}
    states = Counter(r["state"] for r in finals.values())
    v.completed, v.dead, v.cancelled = states["completed"], states["dead"], states["cancelled"]
    unexpected_dead = [
        f"{i} {r['kind']} {r['reason']} attempt {r['attempt']}"
        for i, r in finals.items()
        if r["state"] == "dead" and r["kind"] not in expected_dead_kinds
    ]
    if unexpected_dead:
        v.notes.append(
            f"{len(unexpected_dead)} job(s) of kinds meant to succeed ended dead (allowed: "
            f"max_crashes/max_attempts reached under faults), e.g. {unexpected_dead[:3]}"
        )

    # 3. A completed job's final record matches a successful execution (id, attempt).
    unmatched = []
    for i, r in finals.items():
        if r["state"] != "completed":
            continue
        ok = [
            e
            for e in ledger.get(i, [])
            if e["attempt"] == r["attempt"] and e["outcome"].startswith("ok")
        ]
        if not ok:
            seen = [(e["attempt"], e["outcome"]) for e in ledger.get(i, [])]
            unmatched.append(f"job {i} completed at attempt {r['attempt']}, executions {seen}")
    v.fail("completed final record with no matching execution", unmatched)

    # 4. Attempt counts: every failed attempt has exactly one job_attempt row numbered
    # 1..k (a crash, a timeout and a lease expiry are failed attempts; a drain's
    # give-back and a snooze are not and are not counted); completed = k + 1, dead = k.
    bad_count, bad_numbers = [], []
    for i, r in finals.items():
        rows = attempts.get(i, [])
        numbers = sorted(a["attempt"] for a in rows)
        if numbers != list(range(1, len(numbers) + 1)):
            outcomes = [(a["attempt"], a["outcome"]) for a in rows]
            bad_numbers.append(f"job {i}: attempt rows {outcomes}")
        expected = len(rows) + (1 if r["state"] == "completed" else 0)
        if r["state"] in ("completed", "dead") and r["attempt"] != expected:
            bad_count.append(
                f"job {i} {r['state']} attempt={r['attempt']} with {len(rows)} failed-attempt rows"
            )
    v.fail("job_attempt rows not numbered 1..k (a failure recorded twice?)", bad_numbers)
    v.fail("final attempt count != failed attempts (+1 if completed)", bad_count)

    # 5. No two executions of one job overlapped, unless the first one's lease was lost
    # (a lease_expired/crashed/timeout row for its attempt) or its member was killed.
    killed = defaultdict(list)
    for pid, at in killed_members:
        killed[pid].append(at)
    overlaps = []
    for i, execs in ledger.items():
        lost_attempts = {a["attempt"] for a in attempts.get(i, []) if a["outcome"] in LEASE_LOST}
        ordered = sorted(execs, key=lambda e: e["started_at"])
        for a, b in itertools.pairwise(ordered):
            if b["started_at"] >= a["ended_at"]:
                continue
            if a["attempt"] in lost_attempts:
                continue
            if any(_ts(a["started_at"]) <= t for t in killed.get(a["member_pid"], [])):
                continue
            overlaps.append(
                f"job {i}: attempt {a['attempt']} pid {a['worker_pid']} "
                f"[{a['started_at']:%H:%M:%S.%f}-{a['ended_at']:%H:%M:%S.%f}] and attempt "
                f"{b['attempt']} pid {b['worker_pid']} from {b['started_at']:%H:%M:%S.%f}"
            )
    v.fail("overlapping executions with no lease lost in between", overlaps)

    # 6. No cron slot enqueued twice.
    cron_keys = Counter(
        r["unique_key"] for h in history.values() for r in h if r["kind"] == "chaos_cron"
    ) + Counter(r["unique_key"] for r in tables["job"] if r["kind"] == "chaos_cron")
    v.cron_jobs = sum(cron_keys.values())
    v.fail("cron slot enqueued twice", [f"{k}x{c}" for k, c in cron_keys.items() if c > 1])

    # 7. Leader terms: each term belongs to one member session (checked by sampling in
    # the runner); here: terms strictly increase with election time.
    terms = sorted(tables["leader"], key=lambda r: r["term"])
    disorder = [
        f"term {b['term']} elected {b['elected_at']} before term {a['term']} {a['elected_at']}"
        for a, b in itertools.pairwise(terms)
        if b["elected_at"] < a["elected_at"]
    ]
    v.fail("leader terms out of order", disorder)

    # 8. No attempt is charged to a job that no handler started, except a failed attempt
    # whose outcome the run's faults explain (`unstarted_ok`: a worker killed with jobs
    # still in its pipe is charged `crashed`; a member killed, or a claim whose answer
    # the server never delivered, is charged `lease_expired` by the reaper).
    started: dict[int, set[int]] = defaultdict(set)
    for r in tables.get("chaos_started", []):
        started[r["job_id"]].add(r["attempt"])
    uncharged_ok = []
    for i, r in finals.items():
        outcomes = {a["attempt"]: a["outcome"] for a in attempts.get(i, [])}
        for attempt in range(1, r["attempt"] + 1):
            if attempt in started[i]:
                continue
            outcome = outcomes.get(attempt, r["state"])
            if outcome not in unstarted_ok:
                uncharged_ok.append(
                    f"job {i} ({r['kind']}) attempt {attempt} charged ({outcome}) "
                    f"but no handler started it; final {r['state']} {r['reason']}"
                )
    v.fail("attempt charged to a job no handler started", uncharged_ok)

    # 9. Dependencies (the workflows scenario): a job with depends_on ran only after every
    # one of its dependencies had its final record, and completed only if they all did
    # (else it ended dead, dependency_failed, and never ran).
    early, wrong_end = [], []
    for i, r in finals.items():
        deps = r.get("depends_on") or []
        if not deps:
            continue
        ended = [history[d][0] for d in deps if d in history]
        all_completed = len(ended) == len(deps) and all(d["state"] == "completed" for d in ended)
        expected = "completed" if all_completed else "dead"
        if r["state"] != expected or (expected == "dead" and r["reason"] != "dependency_failed"):
            wrong_end.append(f"job {i} ended {r['state']} {r['reason']}, expected {expected}")
        last_dep = max((_ts(d["finished_at"]) for d in ended), default=0.0)
        for execution in ledger.get(i, []):
            if not all_completed or _ts(execution["started_at"]) < last_dep:
                early.append(f"job {i} ran at {execution['started_at']}, its last dependency "
                             f"ended at {last_dep}")  # fmt: skip
    v.fail("dependant ran before its dependencies ended", early)
    v.fail("dependant's end disagrees with its dependencies'", wrong_end)
    callbacks = sum(1 for r in finals.values() if r.get("depends_on"))
    if callbacks:
        v.notes.append(f"{callbacks} jobs with dependencies checked")

    # Every execution ran under its queue's cpu_scheduling (NULL: no policies here).
    off_policy = [
        f"job {i} attempt {e['attempt']} pid {e['worker_pid']} under policy {e['cpu_policy']}"
        for i, x in ledger.items()
        for e in x
        if e.get("cpu_policy") is not None and e["cpu_policy"] != QUEUE_POLICY
    ]
    v.fail("execution not under its queue's cpu_scheduling", off_policy)

    versions = sorted({e["outcome"] for x in ledger.values() for e in x if ":v" in e["outcome"]})
    if versions:
        v.notes.append(f"handler versions seen by chaos_swap jobs: {', '.join(versions)}")

    v.repeats = sum(max(0, len(x) - 1) for i, x in ledger.items() if i in enqueued)
    return v


def _ts(value: datetime) -> float:
    return value.timestamp()


def check_limits(
    tables: dict[str, list[dict[str, Any]]],
    v: Verdict,
    *,
    concurrency: dict[str, int],
    rate: dict[str, tuple[int, float]],
    grouped_kinds: set[str],
) -> None:
    """9-11, the `limits` scenario's fleet-wide limits (contract §9).

    A job counts against a limit until its final record or its lease's expiry: an
    execution whose attempt lost its lease (a lease_expired, crashed or timeout row) may
    go on running unseen by the database after that, so 9 and 11 leave such executions
    out. Handler times (the ledger) lie inside the database's running intervals: a
    handler starts after its claim commits and ends before its outcome is recorded.
    """
    lost = {
        (a["job_id"], a["attempt"]) for a in tables["job_attempt"] if a["outcome"] in LEASE_LOST
    }
    executions = [e for e in tables["chaos_ledger"] if (e["job_id"], e["attempt"]) not in lost]

    # 9. Global concurrency per kind: never more executions at once than the limit.
    for kind, limit in concurrency.items():
        runs = [(e["started_at"], e["ended_at"]) for e in executions if e["kind"] == kind]
        most, when = most_at_once(runs)
        if most > limit:
            v.fail(f"more than {limit} {kind} jobs running at once", [f"{most} at {when}"])
        v.notes.append(f"{kind}: at most {most} running at once (global_concurrency {limit})")

    # 10. Rate per queue: no more than N starts in any window. Starts are the claims'
    # database clock (attempted_at of each final record: the last attempt's claim; a
    # subset of all starts, so a violation here is a violation).
    for queue, (n, window_s) in rate.items():
        starts = sorted(
            r["attempted_at"]
            for r in tables["job_history"]
            if r["queue"] == queue and r["attempted_at"] is not None
        )
        crowded = [
            f"{n + 1} starts from {starts[i]:%H:%M:%S.%f} to {starts[i + n]:%H:%M:%S.%f}"
            for i in range(len(starts) - n)
            if (starts[i + n] - starts[i]).total_seconds() < window_s
        ]
        v.fail(f"more than {n} starts of queue {queue} in a {window_s:g}s window", crowded)
        if starts:
            v.notes.append(
                f"queue {queue}: {len(starts)} final starts checked against {n}/{window_s:g}s"
            )

    # 11. Ordered groups: within a group, in (priority, id) order, every execution of a
    # job starts after every execution of the job before it ended: one at a time, in
    # order (a failed head's retry included).
    spans: dict[int, tuple[datetime, datetime]] = {}
    for e in executions:
        first, last = spans.get(e["job_id"], (e["started_at"], e["ended_at"]))
        spans[e["job_id"]] = (min(first, e["started_at"]), max(last, e["ended_at"]))
    groups: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in tables["job_history"]:
        if r["kind"] in grouped_kinds:
            args = r["args"] if isinstance(r["args"], dict) else json.loads(r["args"])
            groups[args["group"]].append((r["priority"], r["id"]))
    disorder = []
    for group, members in groups.items():
        ordered = [job_id for _, job_id in sorted(members) if job_id in spans]
        for a, b in itertools.pairwise(ordered):
            if spans[b][0] < spans[a][1]:
                disorder.append(
                    f"group {group}: job {b} started {spans[b][0]:%H:%M:%S.%f} before job "
                    f"{a} ended {spans[a][1]:%H:%M:%S.%f}"
                )
    v.fail("group member started before the one ahead of it ended", disorder)
    if groups:
        v.notes.append(f"{len(groups)} groups, {sum(map(len, groups.values()))} jobs in order")


def most_at_once(runs: list[tuple[datetime, datetime]]) -> tuple[int, datetime | None]:
    """The most intervals overlapping at one instant, and when (an end frees its place
    before a start at the same instant)."""
    events = sorted([(s, 1) for s, _ in runs] + [(e, -1) for _, e in runs])
    most, current, when = 0, 0, None
    for at, step in events:
        current += step
        if current > most:
            most, when = current, at
    return most, when
