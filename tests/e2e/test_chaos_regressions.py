"""Engine bugs the chaos suite (chaos/) found, each pinned by a test of its own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from .conftest import MemberProcess, wait_until
from .events import JSON_LOG, event_names

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]


async def test_a_worker_dying_during_a_claim_does_not_take_the_member_down(
    schema: str, conn: asyncpg.Connection, start_member: StartMember
) -> None:
    """Found by `python -m chaos bad-handlers`: the producer reserves a queue's free slots,
    claims that many jobs, then submits them; a worker process that dies while the claim
    is in flight takes its slots with it, QueueWorkers.submit_many raises
    "submit() with no free slot", and the whole member exits with status 1 (every job it
    held waits for its lease to expire, each charged a crash)."""
    member = await start_member(
        queues="[queues.default]\nconcurrency = 16\nprocesses = 4\n"
        'backoff_base = "0s"\nbackoff_max = "1ms"\nmax_crashes = 1000\n',
        daemon=JSON_LOG,
    )
    # Jobs that kill their worker on every attempt (10 attempts each: 240 deaths): workers
    # die and are replaced all the time while the claim loop keeps every slot busy.
    await conn.execute(f"SELECT {schema}.enqueue('exits') FROM generate_series(1, 24)")

    async def settled() -> bool:
        if member.process.returncode is not None:
            return True
        done = await conn.fetchval(f"SELECT count(*) FROM {schema}.job_history")
        return bool(done == 24)

    await wait_until(settled, timeout_s=110, what="all jobs final, or the member gone")
    assert member.process.returncode is None, member.log[-2000:]
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.job") == 0
    # Still whole after the storm: a member whose core task died exits 1, not 0.
    assert await member.stop() == 0, member.log[-2000:]
    events = event_names(member)
    assert "member.task_died" not in events, member.log[-2000:]
    assert events.count("member.ready") == 1 and "member.draining" in events, events
