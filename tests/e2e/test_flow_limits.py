"""Fleet-wide limits with real members: several `pgjobd run` processes share a queue
whose global_concurrency (and a kind's) must hold at every instant, while a member is
killed with SIGKILL and another reloads; a ledger written by the handlers proves it."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest

from pgjobd import Client, JobSpec

from .conftest import MemberProcess, wait_all_final, wait_until
from .events import JSON_LOG, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]
HANDLERS = Path(__file__).parent / "handlers_flow"
# The same and a kind with its own limit: every queue on job_claim_flow (HANDLERS alone
# leaves a queue whose only limit is its global_concurrency on flow_reserve).
CAPPED_HANDLERS = Path(__file__).parent / "handlers_flow_capped"


def api_queue(global_concurrency: int) -> str:
    return f"""
[queues.api]
concurrency = 4
processes = 2
global_concurrency = {global_concurrency}
"""


def ledger_runs(path: Path, kind: str | None = None) -> list[tuple[float, float, int]]:
    runs = []
    for line in path.read_text().splitlines():
        job_id, _attempt, start, end, _pid, ran_kind = line.split()
        if kind is None or ran_kind == kind:
            runs.append((float(start), float(end), int(job_id)))
    return runs


def most_at_once(runs: list[tuple[float, float, int]]) -> int:
    events = sorted([(s, 1) for s, _, _ in runs] + [(e, -1) for _, e, _ in runs])
    most = current = 0
    for _, step in events:
        current += step
        most = max(most, current)
    return most


async def test_global_concurrency_holds_across_members_through_a_kill_and_a_reload(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    daemon = f'lease = "2s"\n{JSON_LOG}'
    members = [await start_member(api_queue(3), daemon=daemon, handlers=HANDLERS) for _ in range(3)]
    async with await Client.connect(dsn, schema=schema) as client:
        ids = await client.enqueue_many(
            [("limited_record", {"path": str(ledger), "hold_s": 0.05}) for _ in range(60)]
        )

        async def some_done() -> bool:
            return ledger.exists() and len(ledger.read_text().splitlines()) >= 10

        await wait_until(some_done, what="the first jobs to run")
        members[0].send_signal(signal.SIGKILL)
        # A reload that rewrites the same limit, while jobs flow.
        members[1].send_signal(signal.SIGHUP)
        await wait_for_event(members[1], "member.reloaded")
        records = await wait_all_final(conn, schema, len(ids), timeout_s=90)
    assert {r["state"] for r in records.values()} == {"completed"}
    runs = ledger_runs(ledger)
    assert most_at_once(runs) <= 3
    assert most_at_once(runs) >= 2  # the members did run jobs side by side
    # The queue's only limit is its global_concurrency: claimed through reservations.
    assert await conn.fetchval(f"SELECT {schema}.queue_reservable('api')")


async def test_a_kinds_declared_limit_holds_across_members(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    for _ in range(2):
        await start_member(api_queue(50), daemon=JSON_LOG, handlers=CAPPED_HANDLERS)
    declared = await conn.fetchrow(
        f"SELECT global_concurrency, rate_limit, rate_window FROM {schema}.kind "
        "WHERE name = 'capped_record'"
    )
    assert (declared["global_concurrency"], declared["rate_limit"]) == (2, 1000)
    async with await Client.connect(dsn, schema=schema) as client:
        jobs = [("capped_record", {"path": str(ledger), "hold_s": 0.03}) for _ in range(30)]
        jobs += [("limited_record", {"path": str(ledger), "hold_s": 0.03}) for _ in range(30)]
        ids = await client.enqueue_many(jobs)
        await wait_all_final(conn, schema, len(ids), timeout_s=90)
    assert most_at_once(ledger_runs(ledger, "capped_record")) == 2
    assert most_at_once(ledger_runs(ledger, "limited_record")) > 2


async def test_members_that_disagree_on_a_limit_log_it_and_the_last_one_wins(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    await start_member(api_queue(5), daemon=JSON_LOG, handlers=HANDLERS)
    second = await start_member(api_queue(2), daemon=JSON_LOG, handlers=HANDLERS)
    row = await conn.fetchrow(
        f"SELECT global_concurrency, limits_by FROM {schema}.queue WHERE name = 'api'"
    )
    assert row["global_concurrency"] == 2
    event = await wait_for_event(second, "flow.limits_disagree", queue="api")
    assert "global_concurrency=5" in event["previous"]
    assert "global_concurrency=2" in event["limits"]


async def test_a_fair_queue_shares_its_starts_across_members_by_tag(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    """A queue whose only limit is fair = true, on two members, claims by its jobs' tags
    without the queue's lock (migration 0024): a tenant whose jobs arrive behind
    another's 150 starts alongside it, not after it, and every job runs once."""
    ledger = tmp_path / "ledger"
    fair_queue = "[queues.api]\nconcurrency = 3\nprocesses = 1\nfair = true\n"
    for _ in range(2):
        await start_member(fair_queue, daemon=JSON_LOG, handlers=HANDLERS)
    async with await Client.connect(dsn, schema=schema) as client:
        specs = [
            JobSpec("limited_record", {"path": str(ledger), "hold_s": 0.01}, tenant=tenant)
            for tenant in ["first"] * 150 + ["second"] * 50
        ]
        ids = await client.enqueue_many(specs)
        records = await wait_all_final(conn, schema, len(ids), timeout_s=90)
    assert {r["state"] for r in records.values()} == {"completed"}
    assert await conn.fetchval(f"SELECT {schema}.queue_fair_only('api')")
    # The members claimed by tag (the stride path under the lock leaves fair_clock at 0).
    assert await conn.fetchval(f"SELECT fair_clock FROM {schema}.queue WHERE name = 'api'") > 0
    tenant_of = dict(zip(ids, [s.tenant for s in specs], strict=True))
    runs = sorted(ledger_runs(ledger))
    assert sorted(job_id for _, _, job_id in runs) == sorted(ids)
    # The second tenant's 50 jobs run among the first 100 starts (about half of them,
    # 6 slots claiming beside each other), not after the first's 150.
    early = [tenant_of[job_id] for _, _, job_id in runs[:100]]
    assert early.count("second") >= 35, early.count("second")
