"""The per-kind circuit breaker with a real member: a kind whose handler keeps failing
trips its breaker (breaker.opened), its waiting jobs are then not started, so not
charged attempts, until the cool-down ends (breaker.half_open); one probe runs, and once
the service is back its success closes the breaker (breaker.closed) and the rest run."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
import pytest

from pgjobd import Client

from .conftest import MemberProcess, wait_all_final, wait_until
from .events import JSON_LOG, events, wait_for_event

pytestmark = pytest.mark.anyio
StartMember = Callable[..., Awaitable[MemberProcess]]
HANDLERS = Path(__file__).parent / "handlers_breaker"
QUEUES = """
[queues.api]
concurrency = 2
"""


async def test_a_failing_kind_trips_its_breaker_and_its_jobs_wait_uncharged(
    dsn: str, schema: str, conn: asyncpg.Connection, start_member: StartMember, tmp_path: Path
) -> None:
    ledger, broken = tmp_path / "ledger", tmp_path / "broken"
    broken.touch()
    member = await start_member(QUEUES, daemon=JSON_LOG, handlers=HANDLERS)
    declared = await conn.fetchrow(
        f"SELECT breaker_failures, breaker_window, breaker_cooldown FROM {schema}.kind "
        "WHERE name = 'breaker_flaky'"
    )
    assert declared["breaker_failures"] == 3
    args = {"ledger": str(ledger), "broken": str(broken), "hold_s": 0.1}
    async with await Client.connect(dsn, schema=schema) as client:
        ids = await client.enqueue_many([("breaker_flaky", args) for _ in range(60)])
        opened = await wait_for_event(member, "breaker.opened", kind="breaker_flaky")
        assert opened["failures"] >= 3
        # While it is open (until the cool-down ends), no job of the kind starts: the
        # attempts charged, live and final, stay what they were, though jobs wait.
        charged = f"""
            SELECT k.breaker_limit, k.breaker_probe,
                   (SELECT coalesce(sum(j.attempt), 0) FROM {schema}.job AS j
                    WHERE j.kind = k.name)
                   + (SELECT coalesce(sum(h.attempt), 0) FROM {schema}.job_history AS h
                      WHERE h.kind = k.name) AS attempts,
                   (SELECT count(*) FROM {schema}.job AS j
                    WHERE j.kind = k.name AND j.state = 'available') AS waiting
            FROM {schema}.kind AS k WHERE k.name = 'breaker_flaky'"""
        seen = []
        watched_from = time.monotonic()
        while True:
            row = await conn.fetchrow(charged)
            if row["breaker_limit"] != 0 or row["breaker_probe"] is not None:
                break
            seen.append((row["attempts"], row["waiting"]))
            await anyio.sleep(0.05)
        # Most of the cool-down watched, however slowly the box answered each look.
        assert time.monotonic() - watched_from >= 1.5 and len(seen) >= 2, seen
        assert len({attempts for attempts, _ in seen}) == 1, seen
        assert min(waiting for _, waiting in seen) >= 10  # claimable, but for the breaker
        await wait_for_event(member, "breaker.half_open", kind="breaker_flaky")
        # Still broken: the probe fails and the breaker opens again.
        await wait_until(
            lambda: len(events(member, "breaker.opened", kind="breaker_flaky")) >= 2,
            timeout_s=20, what="the failed probe to open the breaker again",
        )  # fmt: skip
        broken.unlink()
        closed = await wait_for_event(member, "breaker.closed", kind="breaker_flaky",
                                      timeout_s=30)  # fmt: skip
        assert closed["probe"] in ids
        records = await wait_all_final(conn, schema, len(ids), timeout_s=60)
    assert {r["state"] for r in records.values()} == {"completed"}
    # Each run is in the ledger: the runs started add up to the attempts charged.
    runs = ledger.read_text().splitlines()
    assert len(runs) == sum(r["attempt"] for r in records.values())
